"""DeepSpeed ZeRO's engine buffers in the estimate (``quantities.zero_partition.deepspeed_buckets``,
``deepspeed_step_grad``) and the DeepSpeed config file (``spec/deepspeed.py``).

The mechanisms follow DeepSpeed's source (commit 38327e0): stage 1/2 bucket buffers live through
backward (two under overlap_comm), stage 3's is made with the engine and kept, as is its flat
gradient partition; the step flattens each group's gradient partition and casts it to fp32. The
published Lightning + DeepSpeed ZeRO-3 run on GPT-2 XL checks the whole (``validation/published``)."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import trainmem
from trainmem.allocator_rules import block_bytes
from trainmem.errors import TrainmemError
from trainmem.validate import validate

ROOT = Path(__file__).resolve().parents[1]
MODEL = "llama-3.2-1b"
BASE = dict(dp=4, precision="bf16", seq_len=1024, optimizer_impl="fused")


def _phase(report, name, step=2):
    return next(p for p in report.phases if p.name == name and p.step == step)


@pytest.mark.parametrize("release", ["0.16.4", None])
def test_zero2_buckets_live_through_backward_two_under_overlap_comm(release):
    """A bucket far larger than anything else makes backward the peak: overlap_comm adds exactly
    one more buffer, contiguous_gradients false removes them, and none outlives backward. Before
    DeepSpeed v0.18.3 the buckets are made when backward starts, so the loss's backward has them too;
    from it the first gradient's hook makes them (``TrainingSpec.ds_buckets_at_backward_start``).
    Every gradient fits this bucket, so the epilogue reduces them all at once: without contiguous
    gradients they are all there, unsharded, beside their flat copy (``deepspeed.reduce``,
    ``quantities.zero_partition.deepspeed_epilogue``: less than the bucket more than with it)."""
    big = 2_000_000_000
    kw = dict(reduce_bucket_size=big, deepspeed_version=release, **BASE)
    one = trainmem.estimate(MODEL, zero=2, overlap_comm=False, **kw)
    two = trainmem.estimate(MODEL, zero=2, overlap_comm=True, **kw)
    none = trainmem.estimate(MODEL, zero=2, contiguous_gradients=False, **kw)
    bucket = block_bytes(big * 2)  # bf16 engine: 2 bytes per element
    assert _phase(two, "backward").peak - _phase(one, "backward").peak == bucket
    assert none.peak_where == "deepspeed.reduce" and not [c for c in none.components if c.category == "communication"]
    assert 0 < _phase(one, "backward").peak - _phase(none, "backward").peak < bucket
    assert ("cross_entropy.backward" in one.peak_where) == (release is not None)
    # released when backward's gradients are reduced: the phase ends without them
    assert _phase(two, "backward").allocated == _phase(none, "backward").allocated
    assert two.peak_phase.startswith("backward")


def test_zero3_bucket_and_gradient_partition_exist_from_engine_start():
    r = trainmem.estimate(MODEL, zero=3, reduce_bucket_size=10_000_000, **BASE)
    off = trainmem.estimate(MODEL, zero=3, reduce_bucket_size=10_000_000, contiguous_gradients=False, **BASE)
    grads = next(c.bytes for c in r.components if c.name == "gradients")
    # the bucket and the sharded gradients (the flat partition buffer) are there before any step
    assert _phase(r, "model_loaded", 0).allocated - _phase(off, "model_loaded", 0).allocated == block_bytes(20_000_000)
    assert _phase(off, "model_loaded", 0).allocated >= grads > 0
    # zero_grad does not free them
    assert _phase(r, "zero_grad").allocated == _phase(r, "optimizer_step").allocated


def test_step_makes_fp32_partition_and_flat_copy():
    """fused optimizer (no temporaries of its own): the step's peak is the end-of-step memory plus
    the gradients kept for the cast (stage 2: ``grads_in_partition``, freed by the step), the fp32
    gradient of the partition and its flat bf16 copy (stage 2: one group, the whole partition); an
    fp32 engine's cast is the flat copy itself."""
    from trainmem.estimate.quantities.build import quantities
    from trainmem.spec.resolve import resolve
    r = trainmem.estimate(MODEL, zero=2, **BASE)
    n = -(-r.model.num_params // 4)  # trainable elements / dp (every parameter trains)
    q = quantities(r.model, r.training)
    held = q.ds_cast_grads
    assert block_bytes(n * 2) <= held  # the whole parameters over the partition: at least the partition
    # before the cast, the gradient norm's float64 copy of the largest piece of rank 0's partition
    # (the embedding, first and whole in it: 128256 x 2048)
    assert q.ds_norm_temp == block_bytes(128256 * 2048 * 8)
    step = _phase(r, "optimizer_step")
    assert step.peak - step.allocated == max(held + block_bytes(n * 4) + block_bytes(n * 2), held + q.ds_norm_temp)
    f32 = trainmem.estimate(MODEL, zero=2, **{**BASE, "precision": "fp32"})
    q = quantities(f32.model, f32.training)
    step = _phase(f32, "optimizer_step")
    assert step.peak - step.allocated == q.ds_cast_grads + max(block_bytes(n * 4), q.ds_norm_temp)
    off = trainmem.estimate(MODEL, zero=2, offload_optimizer=True, **BASE)
    step = _phase(off, "optimizer_step")
    assert step.peak == step.allocated


def test_stage3_sub_group_bounds_the_step():
    whole = trainmem.estimate(MODEL, zero=3, sub_group_size=10**12, **BASE)
    small = trainmem.estimate(MODEL, zero=3, sub_group_size=1_000_000, **BASE)
    n = -(-whole.model.num_params // 4)
    s_whole, s_small = _phase(whole, "optimizer_step"), _phase(small, "optimizer_step")
    assert s_whole.peak - s_whole.allocated == block_bytes(n * 4) + block_bytes(n * 2)
    # a sub-group holds < sub_group_size + the largest tensor's partition (the embedding, 128256 x 2048 / 4)
    cap = 1_000_000 - 1 + -(-(128256 * 2048) // 4)
    assert s_small.peak - s_small.allocated == block_bytes(cap * 4) + block_bytes(cap * 2)


def test_engine_options_need_a_deepspeed_stage():
    for bad in (dict(reduce_bucket_size=100), dict(overlap_comm=True), dict(contiguous_gradients=False),
                dict(zero=2, sub_group_size=100), dict(fsdp="full", reduce_bucket_size=100)):
        with pytest.raises(TrainmemError, match="--zero|--sub-group-size"):
            trainmem.estimate(MODEL, dp=2, **bad)


def test_deepspeed_config_file(tmp_path):
    cfg = {"zero_optimization": {"stage": 2, "overlap_comm": True, "contiguous_gradients": True,
                                 "reduce_bucket_size": "auto", "allgather_bucket_size": 5e8,
                                 "offload_optimizer": {"device": "cpu"}}}
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(cfg))
    r = trainmem.estimate(MODEL, deepspeed_config=str(path), **BASE)
    t = r.training
    # "auto" filled as the HF Trainer fills it: hidden_size x hidden_size (transformers deepspeed.py L232)
    assert (t.zero, t.reduce_bucket_size, t.overlap_comm, t.offload_optimizer) == (2, 2048 * 2048, True, True)
    # an explicit flag wins, except a contradicting stage
    assert trainmem.estimate(MODEL, deepspeed_config=cfg, reduce_bucket_size=7, **BASE).training.reduce_bucket_size == 7
    with pytest.raises(TrainmemError, match="contradicts"):
        trainmem.estimate(MODEL, deepspeed_config=cfg, zero=3, **BASE)
    with pytest.raises(TrainmemError, match="offload_param"):
        trainmem.estimate(MODEL, deepspeed_config={"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}},
                          **BASE)


def test_deepspeed_config_cli_errors_are_one_line(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text("{ not json")
    for args in (["--deepspeed-config", str(bad)], ["--deepspeed-config", str(tmp_path / "missing.json")],
                 ["--reduce-bucket-size", "5e8"]):
        p = subprocess.run([sys.executable, "-m", "trainmem", "estimate", MODEL, *args], capture_output=True, text=True)
        assert p.returncode == 2, p.stderr
        assert len(p.stderr.strip().splitlines()) == 1 and "Traceback" not in p.stderr


def test_published_lightning_deepspeed_zero3_gpt2_xl():
    """Lightning's DeepSpeedStrategy, ZeRO-3 fp16, GPT-2 XL b40 on 4 A100s (ColossalAI-Pytorch-lightning
    benchmark), with the engine's bucket and the parameters its reuse distance keeps gathered (before
    both: -7.3%). The peak is in forward (the loss), where Lightning's host-memory partitions
    (``remote_device cpu``, as in the 12B row of the same script) are missing from the GPU for the
    whole run: exactly the fp16 partitions' bytes fewer than with them there. That leaves -2.97%
    (it was +0.02% with the partitions wrongly on the GPU), within the 5% of the accuracy tables; the
    gap is not explained yet and no term is fitted to it."""
    fx = json.loads((ROOT / "validation" / "published" / "deepspeed_zero3_gpt2_xl_b40.json").read_text())
    setup = dict(fx["setup"])
    host = trainmem.estimate(fx["model"], **setup)
    dev = trainmem.estimate(fx["model"], **{**setup, "remote_device": None, "zero_init": "on"})
    weights = next(c.bytes for c in dev.components if c.name == "parameters")  # each tensor's fp16 partition
    assert weights >= -(-host.model.num_params // 4) * 2
    assert host.peak_phase.startswith("forward")
    assert dev.peak_allocated - host.peak_allocated == weights
    v = validate(str(ROOT / "validation" / "published"), ["estimate"], ["deepspeed_zero3_gpt2_xl_b40"])
    (check,) = [c for c in v.checks if c.quantity == "peak_allocated"]
    assert abs(check.error) < 0.05, check.error


def test_zero3_reuse_distance_keeps_layers_only_without_the_prefetchers_marks():
    """stage3_max_reuse_distance (``quantities.zero3_gather.deepspeed_gather_zones``): without prefetch a module's
    parameters stay gathered after its forward while their next use lies within the distance: at the
    top layer's forward the K layers below it (2 head + 3 j layer < distance under full recompute; the
    tied head is not gathered yet). With the default prefetch the prefetcher's passes over gathered
    entries keep them anyway, whatever the distance; distance 0 releases everything but the current
    module, and none is gathered at the optimizer step."""
    opts = dict(zero=3, dp=4, precision="fp16", seq_len=1024, batch_size=2, recompute="full", optimizer_impl="fused")
    layer_n = 12 * 1600 * 1600 + 13 * 1600   # GPT-2 XL block: attention and MLP weights + biases, norms
    head_n = 50257 * 1600                    # the tied wte / lm_head
    # what stays gathered of a layer: its four weight matrices, each its own fp16 block (biases and norms,
    # 1e5 elements or fewer, persist: ``zero3_replay.PERSISTENCE_THRESHOLD``)
    kept = sum(block_bytes(n * 2) for n in (1600 * 4800, 1600 * 1600, 1600 * 6400, 6400 * 1600))
    k = -(-(10**9 - 2 * head_n) // (3 * layer_n))
    assert k == 10

    def forward_diff(**kw) -> int:
        far = trainmem.estimate("gpt2-xl", **kw, **opts)
        near = trainmem.estimate("gpt2-xl", stage3_max_reuse_distance=0, **kw, **opts)
        assert _phase(far, "optimizer_step").allocated == _phase(near, "optimizer_step").allocated
        return _phase(far, "forward").allocated - _phase(near, "forward").allocated
    diff = forward_diff(stage3_prefetch_bucket_size=0)
    assert diff == (k - 1) * kept, (diff, (k - 1) * kept)   # the nine layers below the current one
    assert forward_diff() == 0


def test_zero2_gradient_partition_is_whole_once_backward_reduces():
    """ZeRO-2's ``grads_in_partition`` is one buffer of the whole parameters that overlap the rank's
    partition (at least the partition, less than the partition and one more parameter), made at the
    first bucket reduction: when a bucket fills in backward (BERT-large's 335M elements over a
    10M-element bucket), in the layers' backward every gradient byte of the rank is allocated, so a
    layer-backward moment holds at least the states, the weights and that partition; when every
    gradient fits in one bucket (DeepSpeed's default 500M elements), the epilogue makes it after
    the layers (``reduce_first_in_backward``)."""
    from trainmem.estimate.quantities.build import quantities
    from trainmem.estimate.states import model_states
    from trainmem.spec.resolve import resolve
    small = dict(seq_len=128, batch_size=1, reduce_bucket_size=10 ** 7)
    res = resolve("bert-large-uncased", zero=2, dp=2, precision="fp32", **small)
    q = quantities(res.model, res.training)
    st = model_states(res.model, res.training)
    assert 0 < st.grads <= q.ds_partition_grads < st.grads + st.largest_param
    for other in (dict(zero=1), dict(zero=3), dict(zero=2, offload_optimizer=True), dict(zero=2, reduce_bucket_size=None)):
        r = resolve("bert-large-uncased", dp=2, precision="fp32", **{**small, **other})
        assert quantities(r.model, r.training).ds_partition_grads == 0
    rep = trainmem.estimate("bert-large-uncased", zero=2, dp=2, precision="fp32", **small)
    # step 2 backward: the weights, the states and the whole partition at once
    assert _phase(rep, "backward", 2).peak >= q.fixed + q.states + q.grads


def test_plan_takes_deepspeed_engine_options_for_the_stages_it_explores():
    from trainmem.plan import plan
    r = plan(MODEL, 8, seq_len=1024, global_batch=16, gpu="h100", zero="2,3", reduce_bucket_size=10**8)
    assert r.top and all(x.zero in (2, 3) for x in r.top)
    with pytest.raises(TrainmemError, match="explore --zero 1, 2 or 3"):
        plan(MODEL, 8, seq_len=1024, global_batch=16, gpu="h100", zero="0", reduce_bucket_size=10**8)


def test_published_lsaie_llama8b_zero3_sdpa_on_repeated_kv():
    """The ETH LSAIE Llama-8B ZeRO-3 rows: the course's model (src/model.py at 0202e41,
    Attention.forward) copies its 8 key/value heads to the 32 query heads (repeat_kv: expand +
    reshape) before F.scaled_dot_product_attention(is_causal=True), so SDPA saves K and V of
    (1, 32, 2048, 128) bf16 instead of (1, 8, 2048, 128). Every layer's activations are alive at the
    peak (no recompute), so the fixture's --attention-call repeat-kv adds exactly 32 layers x 2 x
    2048 x (32 - 8) x 128 x 2 bytes over transformers' enable_gqa call; both rows within 2%."""
    for name in ("lsaie_llama8b_zero3_b1_s2048", "lsaie_llama8b_zero3_offload_b1_s2048"):
        fx = json.loads((ROOT / "validation" / "published" / f"{name}.json").read_text())
        setup = dict(fx["setup"])
        assert setup["attention_call"] == "repeat-kv"
        copied = trainmem.estimate(fx["model"], **setup)
        grouped = trainmem.estimate(fx["model"], **{**setup, "attention_call": "model"})
        extra = 32 * 2 * 2048 * (32 - 8) * 128 * 2   # layers x (K, V) x tokens x added heads x head dim x bf16
        assert copied.peak_allocated - grouped.peak_allocated == extra
        v = validate(str(ROOT / "validation" / "published"), ["estimate"], [name])
        (check,) = [c for c in v.checks if c.quantity == "peak_allocated"]
        assert abs(check.error) < 0.02, (name, check.error)


#: a two-layer GPT-2 small enough to count by hand: every tensor's shape, in parameter order (the head is
#: tied to wte, so it is not a tensor of its own)
TINY = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 2,
        "n_positions": 128, "vocab_size": 1000, "tie_word_embeddings": True}
_H = 64
TINY_SHAPES = [(1000, _H), (128, _H)] + [(_H,), (_H,), (_H, 3 * _H), (3 * _H,), (_H, _H), (_H,), (_H,), (_H,),
                                         (_H, 4 * _H), (4 * _H,), (4 * _H, _H), (_H,)] * 2 + [(_H,), (_H,)]
TINY_SETUP = dict(zero=3, dp=2, precision="fp16", seq_len=128, batch_size=1, optimizer_impl="fused",
                  sub_group_size=10**12, reduce_bucket_size=1_000_000, transformers_version="4.21")


def _numel(shape):
    n = 1
    for x in shape:
        n *= x
    return n


def test_remote_device_cpu_keeps_the_fp16_partitions_in_host_memory():
    """zero.Init(remote_device="cpu") without offload_param in the config (Lightning's DeepSpeedStrategy
    before 2.1): each rank's fp16 partition, ceil(numel / dp) elements x 2 bytes per tensor, is in pinned
    host memory from model load to the end, so every phase holds exactly those bytes fewer; the fp32
    master partition, the gradient partition buffer and the step's fp32 gradient and flat copy stay on
    the GPU (stage3.py _create_fp32_partitions, _setup_for_real_optimizer, _prepare_fp32_grad_for_sub_group)."""
    gpu = trainmem.estimate(TINY, remote_device="gpu", **TINY_SETUP)  # (zero.Init's remote_device: --zero-init on)
    cpu = trainmem.estimate(TINY, remote_device="cpu", **TINY_SETUP)
    assert sum(_numel(s) for s in TINY_SHAPES) == gpu.model.num_params == 172_288
    partitions = sum(block_bytes(-(-_numel(s) // 2) * 2) for s in TINY_SHAPES)   # fp16 halves, one block each
    assert partitions == 179_712
    parts = {c.name: c.bytes for c in gpu.components}
    assert parts["parameters"] == partitions
    assert {c.name: c.bytes for c in cpu.components}.get("parameters", 0) == 0
    for a, b in zip(gpu.phases, cpu.phases):
        assert (a.name, a.step) == (b.name, b.step)
        assert a.allocated - b.allocated == partitions, a.name
        # (at load the optimizer gathers each parameter in turn; the largest, the 1000 x 64 embedding, has its
        # partition copied to the GPU from the host beside it: states.ds_init_gathers)
        copy = block_bytes(1000 * 64 // 2 * 2) if a.name == "model_loaded" else 0
        assert a.peak - b.peak == partitions - copy, a.name
    # the step's own bytes do not move: the fp32 gradient of the sub-group (here the whole partition) and
    # its flat fp16 copy
    n = -(-gpu.model.num_params // 2)
    step = _phase(cpu, "optimizer_step")
    assert step.peak - step.allocated == block_bytes(n * 4) + block_bytes(n * 2)


def test_remote_device_is_a_zero3_option():
    """--remote-device is zero.Init's, so stage 3 only; the estimate reads gpu and cpu (nvme, ZeRO-Infinity's
    parameter swapping, is not modelled)."""
    with pytest.raises(TrainmemError, match="--remote-device configures DeepSpeed ZeRO-3: give --zero 3"):
        trainmem.estimate(TINY, **{**TINY_SETUP, "zero": 2, "sub_group_size": None}, remote_device="cpu")
    with pytest.raises(TrainmemError, match="--zero 1, 2 or 3"):
        trainmem.estimate(TINY, dp=2, remote_device="cpu")
    with pytest.raises(TrainmemError, match="--remote-device 'nvme' is not one of: gpu, cpu"):
        trainmem.estimate(TINY, remote_device="nvme", **TINY_SETUP)
    same = trainmem.estimate(TINY, remote_device="gpu", **TINY_SETUP)
    assert same.peak_allocated == trainmem.estimate(TINY, zero_init="on", **TINY_SETUP).peak_allocated
    for args in (["--remote-device", "cpu"], ["--zero", "3", "--dp", "2", "--remote-device", "nvme"]):
        p = subprocess.run([sys.executable, "-m", "trainmem", "estimate", MODEL, *args], capture_output=True, text=True)
        assert p.returncode == 2, p.stderr
        assert "Traceback" not in p.stderr and "remote-device" in p.stderr


def test_published_lightning_deepspeed_zero3_gpt2_12b_partitions_on_the_host():
    """The ColossalAI-Pytorch-lightning GPT-2 12B row (8 A100s, micro-batch 1): the peak is the optimizer
    step's (fp32 master, Adam states, gradient partition, IPG bucket, the fp32 gradient and its flat copy),
    and Lightning's zero.Init(remote_device="cpu") keeps the 2-byte partitions off the GPU: exactly the
    fp16 partitions' bytes (ceil(numel / 8) x 2 per tensor) fewer than with them on the GPU (+9.7%
    before), within 2%."""
    fx = json.loads((ROOT / "validation" / "published" / "deepspeed_zero3_gpt2_12b_b1.json").read_text())
    setup = dict(fx["setup"])
    assert setup["remote_device"] == "cpu"
    host = trainmem.estimate(fx["model"], **setup)
    dev = trainmem.estimate(fx["model"], **{**setup, "remote_device": None, "zero_init": "on"})
    weights = next(c.bytes for c in dev.components if c.name == "parameters")  # each tensor's fp16 partition
    assert weights >= -(-host.model.num_params // 8) * 2
    assert host.peak_phase.startswith("optimizer_step") and dev.peak_phase.startswith("optimizer_step")
    assert dev.peak_allocated - host.peak_allocated == weights
    v = validate(str(ROOT / "validation" / "published"), ["estimate"], ["deepspeed_zero3_gpt2_12b_b1"])
    (check,) = [c for c in v.checks if c.quantity == "peak_allocated"]
    assert abs(check.error) < 0.02, check.error


def test_engine_step_leaves_its_zeroed_state_after_zero_grad():
    """DeepSpeed's engine runs its ZeRO optimizer's zero_grad inside ``engine.step()``, after the
    step freed the gradients (stages 1, 2) or kept its partition buffer (stage 3): the memory after
    zero_grad is the memory after the step. The published runs' 'MemAllocated' lines read it: the
    CSCS BERT-base ZeRO-1 run's weights, fp32 partition and Adam states, and the FATE GPT-2 ZeRO-2 fp32
    run's 1.87 GiB (validation/published)."""
    for stage in (1, 2, 3):
        r = trainmem.estimate(MODEL, zero=stage, **BASE)
        assert _phase(r, "zero_grad").allocated == _phase(r, "optimizer_step").allocated
        assert _phase(r, "zero_grad").allocated >= sum(c.bytes for c in r.components if c.category in
                                                       ("parameters", "master_weights", "optimizer_states"))
    plain = trainmem.estimate(MODEL, dp=4, precision="bf16", seq_len=1024)  # no DeepSpeed: zero_grad frees
    assert _phase(plain, "zero_grad").allocated < _phase(plain, "optimizer_step").allocated


def test_old_pytorch_defaults_do_not_reach_deepspeeds_own_zero_grad_and_fused_adam():
    """Before PyTorch 2.0 ``zero_grad`` kept zeroed gradients and torch's Adam ran a loop; under
    ``--zero`` the engine's ZeRO optimizer sets gradients to None (v0.7.2 ``stage_1_and_2.py``
    ``zero_grad(set_grads_to_None=True)``) and its FusedAdam is DeepSpeed's, on any PyTorch."""
    from trainmem.spec.releases import torch_defaults
    from trainmem.spec.resolve import resolve
    assert torch_defaults((1, 13))["zero_grad"] == "zeros"
    assert "zero_grad" not in torch_defaults((1, 13), zero=2)
    assert torch_defaults((1, 13), fsdp="full", zero=2)["zero_grad"] == "zeros"  # FSDP's own zero_grad
    t = resolve(MODEL, zero=1, dp=4, precision="fp16", optimizer_impl="fused", torch_version="1.13").training
    assert t.zero_grad == "none" and t.optimizer_impl == "fused"
    with pytest.raises(TrainmemError, match="fused"):
        resolve(MODEL, dp=4, precision="fp16", optimizer="adamw", optimizer_impl="fused", torch_version="1.13")


def test_deepspeed_config_engine_keys_are_read_not_dropped(tmp_path):
    """bf16/fp16.enabled, train_micro_batch_size_per_gpu, gradient_accumulation_steps and
    train_batch_size change memory: read from the file (deepspeed 0.19.8 runtime/config.py
    _set_batch_related_parameters L607-648), "auto" left to the flags, a contradicting flag refused."""
    zo = {"zero_optimization": {"stage": 2}}
    base = dict(dp=8, seq_len=1024)
    t = trainmem.estimate(MODEL, deepspeed_config={**zo, "bf16": {"enabled": True}, "gradient_accumulation_steps": 8,
                                                   "train_micro_batch_size_per_gpu": 4}, **base).training
    assert (t.precision, t.batch_size, t.grad_accum) == ("bf16", 4, 8)
    assert trainmem.estimate(MODEL, deepspeed_config={**zo, "fp16": {"enabled": True}}, **base).training.precision == "fp16"
    auto = {**zo, "bf16": {"enabled": "auto"}, "train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
            "gradient_accumulation_steps": "auto"}
    t = trainmem.estimate(MODEL, deepspeed_config=auto, batch_size=2, grad_accum=3, precision="bf16-amp", **base).training
    assert (t.precision, t.batch_size, t.grad_accum) == ("bf16-amp", 2, 3)
    # train_batch_size over the data-parallel ranks, as the engine derives the rest
    t = trainmem.estimate(MODEL, deepspeed_config={**zo, "train_batch_size": 512}, **base).training
    assert (t.batch_size, t.grad_accum) == (64, 1)
    t = trainmem.estimate(MODEL, deepspeed_config={**zo, "train_batch_size": 512, "train_micro_batch_size_per_gpu": 16},
                          **base).training
    assert (t.batch_size, t.grad_accum) == (16, 4)
    bf16 = trainmem.estimate(MODEL, deepspeed_config={**zo, "bf16": {"enabled": True}}, **base)
    assert bf16.peak_allocated < trainmem.estimate(MODEL, deepspeed_config=zo, precision="bf16-amp", **base).peak_allocated
    for cfg, flags, words in [({**zo, "train_micro_batch_size_per_gpu": 4}, dict(batch_size=2), "train_micro_batch"),
                              ({**zo, "bf16": {"enabled": True}}, dict(precision="fp32"), "bf16.enabled"),
                              ({**zo, "bf16": {"enabled": True}, "fp16": {"enabled": True}}, {}, "both true"),
                              ({**zo, "train_batch_size": 4}, {}, "less than one sample"),
                              ({**zo, "gradient_accumulation_steps": 0}, {}, "positive integer")]:
        with pytest.raises(TrainmemError, match=words):
            trainmem.estimate(MODEL, deepspeed_config=cfg, **{**base, **flags})


def test_deepspeed_config_contradiction_is_one_cli_line(tmp_path, capsys):
    from trainmem.cli import main
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 4}))
    assert main(["estimate", MODEL, "--dp", "8", "--deepspeed-config", str(path), "--batch-size", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--batch-size 2 contradicts" in err[0] and "train_micro_batch_size_per_gpu (4)" in err[0]


def test_deepspeed_config_batch_keys_reach_every_cli_command(tmp_path, capsys):
    """The CLI's --batch-size and --grad-accum default to None, so that a config's micro-batch and
    accumulation are read, not contradicted by a default of 1 the user never typed."""
    from trainmem.cli import main
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}, "train_micro_batch_size_per_gpu": 4,
                                "gradient_accumulation_steps": 8, "bf16": {"enabled": True}}))
    args = ["gpt2", "--set", "n_layer=1", "--seq-len", "32", "--dp", "2", "--deepspeed-config", str(path)]
    for cmd in ("estimate", "trace"):
        assert main([cmd, *args, "--json"]) == 0, cmd
        t = json.loads(capsys.readouterr().out)["training"]
        assert (t["batch_size"], t["grad_accum"], t["precision"]) == (4, 8, "bf16"), cmd
    assert main(["compare", *args]) == 0
    assert "bf16 · micro-batch 4 × seq 32" in capsys.readouterr().out


def test_deepspeed_config_optimizer_section_is_read_not_dropped():
    """With an ``optimizer`` section the engine builds its own optimizer and the HF Trainer steps it
    (transformers 5.24 integrations/deepspeed.py L576-577): deepspeed 0.19.8 engine.py
    _configure_basic_optimizer L2476-2550 -> trainmem's optimizer and implementation."""
    zo = {"zero_optimization": {"stage": 2}, "bf16": {"enabled": True}}
    base = dict(dp=8, seq_len=1024)

    def spec(section, extra=None, **flags):
        t = trainmem.estimate(MODEL, deepspeed_config={**zo, **(extra or {}), "optimizer": section},
                              **{**base, **flags}).training
        return t.optimizer, t.optimizer_impl

    assert spec({"type": "AdamW", "params": {"lr": "auto", "betas": "auto"}}) == ("adamw", "fused")  # FusedAdam
    assert spec({"type": "Adam"}) == ("adamw", "fused")  # adam_w_mode defaults to true
    assert spec({"type": "Adam", "params": {"adam_w_mode": False}}) == ("adam", "fused")
    assert spec({"type": "AdamW", "params": {"torch_adam": True}}) == ("adamw", None)  # torch's default
    assert spec({"type": "AdamW", "params": {"torch_adam": True}}, optimizer_impl="foreach") == ("adamw", "foreach")
    assert spec({"type": "AdamW", "params": {"torch_adam": True, "foreach": False}}) == ("adamw", "for-loop")
    offload = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    assert spec({"type": "AdamW"}, offload) == ("adamw", None)  # DeepSpeedCPUAdam steps on the host
    assert spec({"type": "adagrad"}) == ("adagrad", None)
    untested = {"zero_allow_untested_optimizer": True}  # engine.py L2294-2301: SGD under ZeRO needs it
    assert spec({"type": "SGD", "params": {"momentum": 0.9}}, untested) == ("sgd-momentum", None)
    assert spec({"type": "SGD"}, untested, optimizer="sgd") == ("sgd", None)  # a flag that agrees is taken
    assert spec({"type": "AdamW"}, optimizer="adamw_torch_fused") == ("adamw", "fused")
    # the section, not the default AdamW, is what steps: SGD keeps no states
    sgd = trainmem.estimate(MODEL, deepspeed_config={**zo, **untested, "optimizer": {"type": "SGD"}}, **base)
    adamw = trainmem.estimate(MODEL, deepspeed_config={**zo, "optimizer": {"type": "AdamW"}}, **base)
    assert sgd.peak_allocated < adamw.peak_allocated
    assert trainmem.estimate(MODEL, deepspeed_config=zo, **base).training.optimizer_impl is None  # no section


@pytest.mark.parametrize("section, flags, words", [
    ({"type": "Lamb"}, {}, "optimizer.type 'Lamb': DeepSpeed's FusedLamb"),
    ({"type": "Lion"}, {}, "FusedLion"),
    ({"type": "Muon"}, {}, "MuonWithAuxAdam"),
    ({"type": "OneBitAdam"}, {}, "'OneBitAdam' is not one trainmem models"),
    ({"type": "sgd"}, {}, "exact name"),  # getattr(torch.optim, "sgd") is the module, not the class
    ({"type": "RMSprop", "params": {"centered": True}}, {}, "centered"),
    ({"type": "SGD"}, {}, "zero_allow_untested_optimizer"),
    ({"params": {"lr": 1e-4}}, {}, "must be an object with a \"type\""),
    ({"type": "AdamW"}, dict(optimizer="sgd"), "--optimizer sgd contradicts the DeepSpeed config's optimizer.type"),
    ({"type": "AdamW"}, dict(optimizer_impl="foreach"), "--optimizer-impl foreach contradicts"),
    ({"type": "AdamW", "params": {"torch_adam": True}}, dict(optimizer_impl="fused"), "never fused"),
])
def test_deepspeed_config_optimizer_refused_in_one_line(section, flags, words):
    with pytest.raises(TrainmemError, match=words) as e:
        trainmem.estimate(MODEL, deepspeed_config={"zero_optimization": {"stage": 2}, "optimizer": section},
                          dp=8, seq_len=1024, **flags)
    assert "\n" not in str(e.value)


def test_deepspeed_config_optimizer_contradiction_is_one_cli_line(tmp_path, capsys):
    from trainmem.cli import main
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}, "optimizer": {"type": "AdamW"}}))
    assert main(["estimate", MODEL, "--dp", "8", "--deepspeed-config", str(path), "--optimizer", "sgd"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "optimizer.type (adamw)" in err[0] and "drop the flag" in err[0]
