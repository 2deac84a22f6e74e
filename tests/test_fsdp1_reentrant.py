"""FSDP1 under reentrant checkpointing holds every layer's input and its gradient to the end of backward.

transformers before 4.52 checkpoints each layer from the model's loop, around the FSDP-wrapped
``decoder_layer.__call__``, with ``use_reentrant=True`` by default. The recompute hands the FSDP unit
detached leaves; a unit whose flat parameter is frozen (peft's wrap policy: adapters in units of their
own) registers a multi-grad hook on them whose ``AccumulateGrad`` keeps each leaf, and the gradient
accumulated into it, until FSDP's final callback (``estimate.quantities.fsdp1.fsdp1_held_inputs``).

The slow test runs the real code (installed torch, transformers, peft) on a 2-rank gloo group and
counts the residual-stream tensors alive when the bottom layer's recompute starts, for the loop of
transformers < 4.52 (reentrant, outside the unit), the layer's own checkpoint of 4.52 and later
(inside the unit), torch's apply_activation_checkpointing after wrapping (a CheckpointWrapper inside each
unit: it holds nothing, as inside), non-reentrant checkpointing outside it, and the loop of transformers < 4.52
with FSDP's reshard-only hook switched off (the hold goes: the hook is what holds). Every run passes
``use_cache=False``, as transformers' own checkpointing and Answer.AI's train.py do: a ``DynamicCache`` left
on keeps the recompute's keys and values, and through their graph each detached input and its gradient.
The fast tests check when the estimate applies it and the two published fms-acceleration Mistral-7B LoRA
FSDP1 rows."""
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
from gloo_ranks import run_ranks

import trainmem
from trainmem.errors import TrainmemError
from trainmem.estimate.moments import _held_inputs
from trainmem.estimate.quantities.fsdp1 import fsdp1_held_inputs
from trainmem.spec.training import TrainingSpec

LAYERS = 4
RANK_SCRIPT = r'''
import functools, json, sys, warnings, weakref
import torch, torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
warnings.filterwarnings("ignore")
rank, mode, out = int(sys.argv[1]), sys.argv[2], sys.argv[3]
if mode == "unhooked":                      # the loop of transformers < 4.52 without FSDP1's reshard-only hook
    import torch.distributed.fsdp._runtime_utils as fsdp_runtime
    fsdp_runtime._register_post_backward_reshard_only_hook = lambda *args, **kwargs: None
dist.init_process_group("gloo", rank=rank, world_size=2)
import transformers
transformers.logging.set_verbosity_error()
from transformers import LlamaConfig, LlamaForCausalLM
from peft import LoraConfig, get_peft_model
from peft.utils.other import fsdp_auto_wrap_policy
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from torch.utils.checkpoint import checkpoint
LAYERS, B, S, H = 4, 2, 64, 256


class Live(TorchDispatchMode):
    """The storages the ops made that are still alive (a weakref.finalize per storage)."""
    def __init__(self):
        super().__init__()
        self.meta, self.phase = {}, "forward"
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        ins = {a.untyped_storage()._cdata for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                s = t.untyped_storage()
                if s._cdata in ins or id(s) in self.meta or not s.nbytes():
                    continue
                self.meta[id(s)] = (self.phase, tuple(t.shape), t.dtype)
                weakref.finalize(s, self.meta.pop, id(s), None)
        return out


class Outside(torch.nn.Module):
    """transformers < 4.52: the model's loop runs checkpoint(decoder_layer.__call__, hidden_states, ...)
    around the FSDP unit (4.48.1 models/mistral/modeling_mistral.py L548-559)."""
    def __init__(self, unit, reentrant):
        super().__init__()
        self.unit, self.reentrant = unit, reentrant
    def forward(self, hidden_states, **kwargs):
        return checkpoint(functools.partial(self.unit.__call__, **kwargs), hidden_states, use_reentrant=self.reentrant)


torch.manual_seed(0)
cfg = LlamaConfig(num_hidden_layers=LAYERS, hidden_size=H, num_attention_heads=4, num_key_value_heads=2,
                  intermediate_size=2 * H, vocab_size=512, head_dim=64)
model = LlamaForCausalLM(cfg).to(torch.bfloat16)
model.enable_input_require_grads()          # TRL's SFTTrainer before get_peft_model (reentrant checkpointing)
model = get_peft_model(model, LoraConfig(r=8, target_modules=["q_proj", "v_proj"]))
base = model.base_model.model
if mode == "inside":                         # transformers >= 4.52: the layer checkpoints itself, inside the unit
    base.gradient_checkpointing_enable({"use_reentrant": True})
model = FSDP(model, auto_wrap_policy=fsdp_auto_wrap_policy(base), use_orig_params=True, device_id=torch.device("cpu"))
if mode == "applied":                        # torch's apply_activation_checkpointing after wrapping (accelerate's
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (  # fsdp_activation_checkpointing,
        CheckpointImpl, apply_activation_checkpointing, checkpoint_wrapper)    # Answer.AI fsdp_qlora)
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=functools.partial(
        checkpoint_wrapper, checkpoint_impl=CheckpointImpl.REENTRANT), check_fn=lambda m: isinstance(m, LlamaDecoderLayer))
if mode not in ("inside", "applied"):
    for i, unit in enumerate(base.model.layers):
        base.model.layers[i] = Outside(unit, mode in ("reentrant", "unhooked"))
model.train()
seen = {}
live = Live()
bottom = base.model.layers[0]
inner = (bottom.unit if mode not in ("inside", "applied") else bottom)._fsdp_wrapped_module
norm = getattr(inner, "_checkpoint_wrapped_module", inner).input_layernorm
def at_recompute(mod, *a):                   # the bottom layer's recompute starts
    if live.phase == "backward" and "bottom" not in seen:
        stream = [ph for ph, shape, dt in live.meta.values() if shape == (B, S, H) and dt == torch.bfloat16]
        seen["bottom"] = [stream.count("forward"), stream.count("backward")]
norm.register_forward_pre_hook(at_recompute)
x = torch.randint(0, 512, (B, S))
with live:
    loss = model(input_ids=x, labels=x, use_cache=False).loss
    live.phase = "backward"
    loss.backward()
adapters = sum(p.grad is not None for n, p in model.named_parameters() if "lora_" in n)
if rank == 0:
    with open(out, "w") as f:
        json.dump({"bottom": seen["bottom"], "adapter_grads": adapters}, f)
dist.barrier()  # both ranks done before the group goes (an early exit aborts gloo's threads)
dist.destroy_process_group()
'''


def _run(tmp_path, mode):
    out = tmp_path / f"{mode}.json"
    run_ranks(tmp_path / "rank.py", RANK_SCRIPT, mode, out)
    return json.loads(out.read_text())


@pytest.mark.slow
def test_reentrant_checkpoint_around_a_frozen_fsdp1_unit_holds_inputs_and_gradients(tmp_path):
    runs = {mode: _run(tmp_path, mode) for mode in ("reentrant", "inside", "nonreentrant", "applied", "unhooked")}
    for run in runs.values():  # every adapter trained in each (the embedding's output requires grad)
        assert run["adapter_grads"] == 2 * 2 * LAYERS
    # without the hold: the bottom layer's saved input, and the gradient it received
    assert runs["inside"]["bottom"] == runs["nonreentrant"]["bottom"] == [1, 1]
    # torch's apply_activation_checkpointing run after wrapping puts the wrapper inside each unit (Answer.AI's
    # fsdp_qlora, accelerate's fsdp_activation_checkpointing): the recompute never calls the unit, no hold
    assert runs["applied"]["bottom"] == [1, 1]
    # the loop around the unit without FSDP1's reshard-only hook: no hold either, so the hook is the holder
    assert runs["unhooked"]["bottom"] == [1, 1]
    # with it: every layer's input, and the gradients of the inputs of all layers above the bottom
    assert runs["reentrant"]["bottom"] == [LAYERS, LAYERS - 1]
    # the estimate's term counts the same tensors (one layer's input each) beyond the normal bottom moment
    extra = sum(runs["reentrant"]["bottom"]) - sum(runs["inside"]["bottom"])
    q = SimpleNamespace(layers=LAYERS, fsdp1_held_inputs=1)
    assert _held_inputs(q, LAYERS * 1000, 1) == extra * 1000


FSDP1_LORA = dict(recompute="full", reentrant=True, lora_rank=16, dp=2, fsdp="full", fsdp_version=1,
                  transformers_version="4.48.1")


@pytest.mark.parametrize("change, held", [
    ({}, True),
    ({"transformers_version": "4.52.1"}, False),   # GradientCheckpointingLayer: the checkpoint inside the unit
    ({"reentrant": False}, False),
    ({"fsdp_lora_units": "layer"}, False),          # the layer's flat parameter requires grad: no such hook
    ({"fsdp_version": 2}, False),
    ({"lora_rank": 0}, False),
    ({"checkpoint_wrapper": True}, False),         # torch's CheckpointWrapper inside each unit (Answer.AI, accelerate)
])
def test_when_fsdp1_holds_the_inputs(change, held):
    assert fsdp1_held_inputs(TrainingSpec(**{**FSDP1_LORA, **change})) is held


def test_checkpoint_wrapper_needs_full_recompute_on_every_layer():
    with pytest.raises(TrainmemError, match="--checkpoint-wrapper"):
        TrainingSpec(checkpoint_wrapper=True)
    with pytest.raises(TrainmemError, match="--checkpoint-wrapper"):
        TrainingSpec(checkpoint_wrapper=True, recompute="full", recompute_every=2)


def test_reentrant_needs_full_recompute_on_every_layer():
    with pytest.raises(TrainmemError, match="--reentrant"):
        TrainingSpec(reentrant=True)
    with pytest.raises(TrainmemError, match="--reentrant"):
        TrainingSpec(reentrant=True, recompute="full", recompute_every=2)


FMS = dict(seq_len=4096, precision="bf16", optimizer="adamw", recompute="full", attention="flash",
           gpu="a100-80gb", lora_rank=16, lora_targets="q_proj,k_proj,v_proj,o_proj", lora_dropout=0.1, dp=2,
           fsdp="full", fsdp_version=1, transformers_version="4.48.1")


@pytest.mark.parametrize("batch, measured", [(2, 15144870400), (4, 21959827968)])
def test_published_fms_mistral_lora_fsdp1_rows(batch, measured):
    """fms-acceleration a100_80gb.csv at 24bdadb (validation/published/hf_fms_mistral7b_lora_g2_b*.json):
    the peak is the bottom layer's backward with every layer's input and 30 gradients held."""
    held = trainmem.estimate("mistral-7b", batch_size=batch, reentrant=True, **FMS)
    plain = trainmem.estimate("mistral-7b", batch_size=batch, reentrant=False, **FMS)
    by_release = trainmem.estimate("mistral-7b", batch_size=batch, **FMS)   # 4.48.1: reentrant by default
    assert by_release.peak_allocated == held.peak_allocated
    assert abs(held.peak_allocated / measured - 1) < 0.01
    assert plain.peak_allocated / measured - 1 < -0.08        # the -8.7 % / -10.0 % before
    assert held.peak_where.startswith("layer[0]")
    per_layer = batch * 4096 * 4096 * 2                        # one bf16 hidden state per token
    comp = {c.name: c.bytes for c in held.components}
    assert comp["activations.fsdp1_held_inputs"] == (31 + 30) * per_layer


@pytest.mark.parametrize("version, options, reentrant", [
    ("4.48", {"recompute": "full"}, True),            # use_reentrant=True, transformers 4.x's default
    ("5.23", {"recompute": "full"}, False),           # 5.0 turned it to False
    ("4.48", {}, False),                              # no gradient checkpointing
    ("4.48", {"recompute": "full", "recompute_every": 2}, False),
])
def test_hf_trainer_preset_checkpoints_reentrant_before_transformers_5(version, options, reentrant):
    r = trainmem.estimate("llama-3.2-1b", framework="hf-trainer", framework_version=version, **options)
    assert r.training.checkpoint_reentrant is reentrant


@pytest.mark.parametrize("trl, options, reentrant", [
    ("0.13.0", {}, True),                                   # transformers 4's own default
    ("0.27.0", {}, False),                                  # SFTConfig: use_reentrant=False under transformers < 5
    ("0.27.0", {"lora_rank": 8, "zero": 3, "dp": 2}, False),
    ("0.28.0", {"lora_rank": 8, "zero": 3, "dp": 2}, True),  # PEFT under ZeRO-3 forced back to reentrant
])
def test_trl_sets_use_reentrant_by_release(trl, options, reentrant):
    r = trainmem.estimate("llama-3.2-1b", framework="trl", framework_version=trl, recompute="full",
                          transformers_version="4.48.1", seq_len=512, **options)
    assert r.training.checkpoint_reentrant is reentrant


def test_published_answerai_lora_row_without_held_inputs():
    """Answer.AI fsdp_qlora (train.py 50efa1e): torch's apply_activation_checkpointing after the FSDP wrap
    (``checkpoint_wrapper``) holds no layer inputs, and the loop keeps ``output`` (transformers 4.37.2's fp32
    logits) through backward; the LoRA b1 s2048 row's published peak allocated is 9.16 GiB
    (validation/published/answerai_fsdpqlora_llama2_7b_lora_fsdp2_b1_s2048.json)."""
    path = "validation/published/answerai_fsdpqlora_llama2_7b_lora_fsdp2_b1_s2048.json"
    fixture = json.loads((Path(__file__).parent.parent / path).read_text())
    setup, measured = fixture["setup"], 9.16 * 2**30
    assert setup["checkpoint_wrapper"] is True and setup["hold_output"] == "backward"
    row = trainmem.estimate(fixture["model"], **setup)
    held = trainmem.estimate(fixture["model"], **{**setup, "checkpoint_wrapper": False})
    comp = {c.name: c.bytes for c in row.components}
    assert "activations.fsdp1_held_inputs" not in comp
    assert comp["logits.logits"] == 2048 * 32000 * 4                # the kept fp32 logits, b1 s2048
    assert abs(row.peak_allocated / measured - 1) < 0.01
    assert held.peak_allocated / measured - 1 > 0.03                 # with the reshard-only hold counted
