"""torchao's low-bit AdamW (``adamw-torchao-8bit`` / ``-4bit`` / ``-fp8``, the HF Trainer's
``adamw_torch_8bit`` / ``adamw_torch_4bit``): states and the compiled step's buffers.

* ``estimate.torchao_optim.state_tensors`` against the real ``_AdamBase._new_buffer`` on the CPU
  (each tensor of each state, bytes); ``step_events`` against the buffers of the code inductor
  generates for the real ``single_param_adam`` (``torch._inductor.utils.run_and_get_code``, the
  ``empty_strided_cpu`` calls and ``del`` lines of its ``call``), marked slow (a compile each).
  Both need torchao (``pip install --target DIR torchao`` and DIR on PYTHONPATH); without it they
  are skipped.
* trace's emulation (``trainmem.lowbit``) allocates ``state_tensors`` and, inside its step,
  ``step_events``'s peak, measured with LiveBytes on the CPU; estimate and trace agree on a GPT-2.
* the option: names, refusals in one line.
"""
from __future__ import annotations

import re

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import trainmem  # noqa: E402
from trainmem.errors import TrainmemError  # noqa: E402
from trainmem.estimate import torchao_optim as ao  # noqa: E402
from trainmem.lowbit import LowBitAdamW  # noqa: E402
from trainmem.measure import LiveBytes  # noqa: E402
from trainmem.spec import TrainingSpec  # noqa: E402
from trainmem.spec.resolve import framework_names  # noqa: E402

from test_cli import assert_one_error_line, run_cli  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

NAMES = list(ao.TORCHAO_LAYOUTS)
#: quantized (512 x 1024), too small (40 x 25), >= 4096 but not a whole number of 256/128-blocks (4100),
#: a 4-bit block but not an 8-bit one (4224 = 33 x 128)
SHAPES = [(512, 1024), (40, 25), (4100,), (4224,)]


def _torchao_class(name: str):
    optim = pytest.importorskip("torchao.optim")
    return getattr(optim, ao.TORCHAO_CLASSES[name])


def _parts(state) -> list[int]:
    """Bytes of each device tensor of one real torchao state: the subclass's tensors (codes, scale,
    qmap) or the plain tensor."""
    if hasattr(state, "tensor_attrs"):
        return [getattr(state, a).nbytes for a in state.tensor_attrs]
    return [state.nbytes]


# ----- against the real torchao -----------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("name", NAMES)
def test_states_match_real_torchao(name, dtype):
    """``_new_buffer`` (the real one, no compile) makes, per state, exactly ``state_tensors``' tensors."""
    cls = _torchao_class(name)
    for shape in SHAPES:
        p = torch.nn.Parameter(torch.zeros(shape, dtype=dtype))
        opt = cls([p])
        real = _parts(opt._new_buffer(p, True)) + _parts(opt._new_buffer(p, False))
        assert real == list(ao.state_tensors(name, p.numel(), p.element_size(), opt.block_size)), (name, shape)


_SIZES = {"torch.float32": 4, "torch.bfloat16": 2, "torch.uint8": 1, "torch.int32": 4, "torch.int64": 8,
          "torch.float8_e4m3fn": 1, "torch.bool": 1}


def _inductor_events(code: str) -> list[int]:
    """The buffers inductor's ``call`` allocates (+bytes) and frees (-bytes), in order; a buffer
    renamed for reuse (``bufB = bufA; del bufA  # reuse``) keeps its storage."""
    live: dict[str, int] = {}
    out: list[int] = []
    for line in code.split("def call(")[1].splitlines():
        m = re.search(r"(buf\d+) = empty_strided_cpu\(\(([^)]*)\), \([^)]*\), (torch\.\w+)\)", line)
        if m:
            n = 1
            for d in m.group(2).split(","):
                n *= int(d) if d.strip() else 1
            live[m.group(1)] = n * _SIZES[m.group(3)]
            out.append(live[m.group(1)])
            continue
        m = re.search(r"(buf\d+) = (buf\d+); del (buf\d+)\s+# reuse", line)
        if m:
            live[m.group(1)] = live.pop(m.group(2))
            continue
        for name in re.findall(r"\bdel (buf\d+)", line):
            if name in live:
                out.append(-live.pop(name))
    return out


def _peak(events) -> int:
    live = peak = 0
    for e in events:
        live += e
        peak = max(peak, live)
    return peak


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("name", NAMES)
def test_step_buffers_match_inductor(name, dtype):
    """The real step compiled by inductor on the CPU: a quantized tensor's graph allocates
    ``step_events``' buffers (the same sizes, the same peak); a plain state's none."""
    from torch._inductor.utils import run_and_get_code
    cls = _torchao_class(name)
    # the class's block size, and the HF Trainer's 256 for AdamW4bit (whose own default is 128)
    blocks = [None, 256] if name == "adamw-torchao-4bit" else [None]
    for shape, block in [(s, b) for s in [(512, 1024), (40, 25)] for b in blocks]:
        torch._dynamo.reset()
        p = torch.nn.Parameter(torch.randn(shape, dtype=dtype))
        p.grad = torch.randn_like(p)
        opt = cls([p]) if block is None else cls([p], block_size=block)
        _, codes = run_and_get_code(opt.step)
        real = [e for c in codes for e in _inductor_events(c)]
        ours = list(ao.step_events(name, p.numel(), opt.block_size))
        assert sorted(e for e in real if e > 0) == sorted(e for e in ours if e > 0), (name, shape)
        assert _peak(real) == _peak(ours) == ao.step_peak(name, p.numel(), opt.block_size, lambda x: x)
        if not ao.quantized(p.numel(), opt.block_size):
            assert real == []


# ----- the emulation (what trace runs) ---------------------------------------------------------
@pytest.mark.parametrize("name", NAMES)
def test_emulation_allocates_states_and_step_buffers(name):
    """``LowBitAdamW`` on the CPU: its states are ``state_tensors`` and its steady step (states
    already made) allocates ``step_peak`` of the largest tensor above what was live, measured with
    LiveBytes."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(s, dtype=torch.bfloat16)) for s in SHAPES]
    opt = LowBitAdamW(params, optimizer=name)
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()
    for p in params:
        st = opt.state[p]
        got = [v.nbytes for k, v in st.items() if k != "step"]
        assert sorted(got) == sorted(ao.state_tensors(name, p.numel(), 2, opt.block_size))
        assert st["step"].device.type == "cpu"
    with LiveBytes() as lb:
        before = lb.mark("before")
        opt.step()
        during = lb.mark("step")
    expect = max(ao.step_peak(name, p.numel(), opt.block_size, lambda x: x) for p in params)
    assert during.peak - before.current == expect > 0


@pytest.mark.parametrize("name", NAMES)
def test_estimate_matches_trace(name):
    """The whole step on a 2-layer GPT-2 in bf16: estimate's and trace's peak and optimizer phase
    agree (the token embedding, the largest tensor, is quantized: 50257 x 768 is 256-divisible)."""
    kw = dict(precision="bf16", batch_size=2, seq_len=64, optimizer=name, set={"n_layer": 2})
    e, t = trainmem.estimate("gpt2", **kw), trainmem.trace("gpt2", **kw)
    assert abs(e.peak_allocated - t.peak_allocated) <= 0.005 * t.peak_allocated
    pe, pt = e.phase("optimizer_step", 2), t.phase("optimizer_step", 2)
    assert abs((pe.peak - pe.allocated) - (pt.peak - pt.allocated)) <= 0.01 * (pt.peak - pt.allocated)
    # the reserved replay runs each tensor's graph too (reserved.optimizer._torchao_graph): the first step's
    # fp32 moments of the embedding need segments of their own
    assert abs(e.peak_reserved - t.peak_reserved) <= 0.01 * t.peak_reserved


@pytest.mark.parametrize("name", ["adamw-torchao-8bit", "adamw-torchao-4bit"])
def test_estimate_matches_trace_in_backward(name):
    """Under optimizer-in-backward each tensor's compiled step runs in its hook beside its gradient:
    the tied token embedding's, last, sets the peak in both."""
    kw = dict(precision="bf16", batch_size=2, seq_len=64, optimizer=name, set={"n_layer": 2},
              optimizer_in_backward=True)
    e, t = trainmem.estimate("gpt2", **kw), trainmem.trace("gpt2", **kw)
    assert abs(e.peak_allocated - t.peak_allocated) <= 0.005 * t.peak_allocated


def test_measure_builds_torchaos_class():
    """measure runs the real class with the run's block size (``workload.optimizer_class``)."""
    cls = _torchao_class("adamw-torchao-4bit")
    from trainmem.workload import make_optimizer
    t = TrainingSpec(**framework_names({"optimizer": "adamw_torch_4bit"}))
    opt = make_optimizer(t, [torch.nn.Parameter(torch.zeros(4096))], emulate=False)
    assert type(opt) is cls and opt.block_size == 256


def test_estimate_counts_torchao_state_bytes():
    """The estimate's optimizer states are ``state_tensors`` of every trainable tensor, rounded per
    tensor: smaller than bitsandbytes' AdamW8bit by nothing but torchao's per-state 1 KiB maps and
    its bf16 (not fp32) states of the small tensors, which bitsandbytes keeps in fp32."""
    from trainmem.estimate.states import model_states
    from trainmem.spec import resolve_model
    m = resolve_model("gpt2", {"n_layer": 2})
    st = {o: model_states(m, TrainingSpec(precision="bf16", optimizer=o)).optimizer
          for o in ("adamw-8bit", "adamw-torchao-8bit", "adamw-torchao-4bit", "adamw")}
    assert st["adamw-torchao-4bit"] < st["adamw-torchao-8bit"] < st["adamw"] // 1.9
    assert abs(st["adamw-torchao-8bit"] - st["adamw-8bit"]) < 0.01 * st["adamw-8bit"]


# ----- the option --------------------------------------------------------------------------------
def test_hf_names_map_with_the_trainers_block_size():
    """``adamw_torch_8bit``/``adamw_torch_4bit``: torchao's AdamW8bit/AdamW4bit with ``block_size``
    256 (transformers trainer_optimizer.py ``_get_torchao_optimizer``), 4-bit's own default 128."""
    t8 = TrainingSpec(**framework_names({"optimizer": "adamw_torch_8bit"}))
    t4 = TrainingSpec(**framework_names({"optimizer": "adamw_torch_4bit"}))
    assert (t8.optimizer, t8.torchao_block) == ("adamw-torchao-8bit", 256)
    assert (t4.optimizer, t4.torchao_block) == ("adamw-torchao-4bit", 256)
    assert TrainingSpec(optimizer="adamw-torchao-4bit").torchao_block == 128


@pytest.mark.parametrize("kw,needle", [
    ({"optimizer": "adamw-torchao-8bit", "optimizer_impl": "fused"}, "optimizer-impl"),
    ({"optimizer": "adamw", "torchao_block_size": 128}, "torchao_block_size"),
    ({"optimizer": "adamw-torchao-8bit", "torchao_block_size": 0}, "torchao_block_size"),
    ({"optimizer": "adamw-torchao-8bit", "torchao_version": "0.6.1"}, "0.7.0"),
    ({"optimizer": "adamw-torchao-4bit", "zero": 2, "dp": 2}, "ZeRO"),
])
def test_refusals_are_one_line(kw, needle):
    with pytest.raises(TrainmemError) as e:
        TrainingSpec(**kw)
    assert "\n" not in str(e.value) and needle in str(e.value)


def test_cli_takes_the_names(capsys):
    rc, out, err = run_cli(capsys, "estimate", "gpt2", "--optimizer", "adamw_torch_4bit", "--precision", "bf16")
    assert rc == 0, err
    line = assert_one_error_line(*run_cli(capsys, "estimate", "gpt2", "--optimizer", "adamw-torchao-8bit",
                                          "--optimizer-impl", "foreach"))
    assert "optimizer-impl" in line


# ----- CPUOffloadOptimizer (--torchao-offload) ------------------------------------------------------
def test_offload_default_minimal_size_is_torchaos():
    """``TORCHAO_OFFLOAD_MIN`` is ``CPUOffloadOptimizer``'s ``minimal_size`` default (its constructor
    asserts a CUDA/XPU device, so the class is read, not run, on the CPU)."""
    import inspect
    optim = pytest.importorskip("torchao.optim")
    from trainmem.spec.training import TORCHAO_OFFLOAD_MIN
    assert inspect.signature(optim.CPUOffloadOptimizer).parameters["minimal_size"].default == TORCHAO_OFFLOAD_MIN


@pytest.mark.parametrize("mode", ["optimizer", "gradients"])
def test_offload_keeps_only_small_tensors_states_on_the_device(mode):
    """Tensors of at least 4096 elements are stepped on the host; the smaller ones keep their bf16
    AdamW states on the device, in the on-device optimizer (fused: one fp32 ``step`` each)."""
    from trainmem.allocator_rules import block_bytes
    from trainmem.estimate.states import model_states
    from trainmem.spec import resolve_model
    m = resolve_model("gpt2", {"n_layer": 2})
    st = model_states(m, TrainingSpec(precision="bf16", torchao_offload=mode))
    small = [p.numel for p in m.parameter_tensors() if p.numel < 4096]   # the norms and biases
    assert len(small) == 2 * 8 + 2
    assert st.optimizer == sum(2 * block_bytes(n * 2) for n in small)  # exp_avg, exp_avg_sq: bf16 each
    assert st.optimizer < 0.01 * model_states(m, TrainingSpec(precision="bf16")).optimizer
    assert st.master == 0


def test_offload_gradients_frees_them_in_backward():
    """``offload_gradients=True``: after backward the device holds no gradient of an offloaded
    tensor, so the step starts from the weights and the small tensors' states only; without it the
    gradients stay until ``zero_grad``."""
    kw = dict(precision="bf16", batch_size=1, seq_len=128, recompute="full", set={"n_layer": 2})
    opt = trainmem.estimate("gpt2", torchao_offload="optimizer", **kw)
    grads = trainmem.estimate("gpt2", torchao_offload="gradients", **kw)
    after_opt = opt.phase("zero_grad", 2)
    after_grads = grads.phase("zero_grad", 2)
    assert after_opt.allocated == after_grads.allocated          # weights + small states, either way
    assert opt.phase("optimizer_step", 2).allocated > after_opt.allocated  # ... gradients held until zero_grad
    assert grads.peak_allocated < opt.peak_allocated


@pytest.mark.parametrize("kw,needle", [
    ({"torchao_offload": "optimizer", "dp": 2}, "--dp"),
    ({"torchao_offload": "optimizer", "optimizer": "adamw-8bit"}, "torch.optim"),
    ({"torchao_offload": "gradients", "grad_accum": 2}, "gradient accumulation"),
    ({"torchao_offload": "gradients", "optimizer_in_backward": True}, "--optimizer-in-backward"),
    ({"torchao_offload": "states"}, "torchao-offload"),
])
def test_offload_refusals_are_one_line(kw, needle):
    with pytest.raises(TrainmemError) as e:
        TrainingSpec(**kw)
    assert "\n" not in str(e.value) and needle in str(e.value)


def test_trace_refuses_offload(capsys):
    line = assert_one_error_line(*run_cli(capsys, "trace", "gpt2", "--set", "n_layer=2", "--torchao-offload",
                                          "optimizer"))
    assert "CPUOffloadOptimizer" in line and "estimate" in line
