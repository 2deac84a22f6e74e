"""APOLLO (the HF Trainer's ``apollo_adamw``, apollo_torch's APOLLOAdamW): the random projector, the
projected states and the step's allocations, against a real CPU run of apollo_torch where it is
installed (its ``__init__`` imports an 8-bit class that needs bitsandbytes: stood in for when missing,
never built here); options and refusals always."""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from trainmem.estimate.galore import GTensor, galore_state_bytes, step_order, step_peak  # noqa: E402
from bnb_stub import import_without_bitsandbytes  # noqa: E402
from test_cli import assert_one_error_line, run_cli  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")
LLAMA = dict(vocab_size=256, hidden_size=64, intermediate_size=160, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2)


def _apollo_torch():
    return import_without_bitsandbytes("apollo_torch")


def _states(opt) -> int:
    seen = {}
    for st in opt.state.values():
        ts = [v for v in st.values() if torch.is_tensor(v)]
        if "projector" in st and st["projector"].ortho_matrix is not None:
            ts.append(st["projector"].ortho_matrix)
        for v in ts:
            seen[v.untyped_storage().data_ptr()] = v.untyped_storage().nbytes()
    return sum(seen.values())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_states_and_step_match_real_apollo_torch(dtype):
    """States (random projectors, projected Adam states, the scaled-gradient norm) and each step's
    peak: steady steps (2, 4) and projector updates (3: update_proj_gap 3), with gradients growing
    1.5x a step so that the norm limiter is a tensor (the larger path, which the estimate counts)."""
    ap = _apollo_torch()
    from transformers import LlamaConfig, LlamaForCausalLM
    from trainmem.measure import LiveBytes
    torch.manual_seed(0)
    m = LlamaForCausalLM(LlamaConfig(**LLAMA)).to(dtype)
    names = {n + ".weight" for n, mod in m.named_modules()
             if isinstance(mod, torch.nn.Linear) and any(k in n for k in ("attn", "mlp"))}
    named = list(m.named_parameters())
    kw = dict(rank=8, proj="random", scale_type="channel", update_proj_gap=3, scale=1.0, proj_type="std")
    opt = ap.APOLLOAdamW([{"params": [p for n, p in named if n not in names]},
                          {"params": [p for n, p in named if n in names], **kw}], lr=1e-3)
    base = {p: torch.randn(p.shape).to(dtype) for _, p in named}
    peaks = []
    for step in range(5):
        for p in base:
            p.grad = base[p] * 1.5 ** step
        with LiveBytes() as lb:  # (the projectors tracked, the list not kept: it would keep the replaced ones)
            lb.track(m, opt, [st["projector"].ortho_matrix for st in opt.state.values()
                              if "projector" in st and st["projector"].ortho_matrix is not None])
            before = lb.mark("before")
            opt.step()
            peaks.append(lb.mark("step").peak - before.current)
    w = 4 if dtype == torch.float32 else 2
    tensors = [GTensor(tuple(p.shape), n in names) for n, p in named]
    assert _states(opt) == sum(sum(galore_state_bytes("apollo-adamw", x.shape, x.target, w, 8, "std"))
                               for x in tensors)
    steady, update = (step_peak(step_order(tensors), "apollo-adamw", w, 8, "std", svd) for svd in (False, True))
    assert peaks[2] == peaks[4] == steady and peaks[3] == update, (peaks, steady, update)


@pytest.mark.parametrize("args, word", [
    (["--optimizer", "apollo_adamw", "--optim-target-modules", "attn", "--optim-args", "proj=svd"], "proj=random"),
    (["--optimizer", "apollo_adamw", "--optim-target-modules", "attn", "--optim-args", "proj_type=left"], "proj_type"),
    (["--optimizer", "apollo_adamw", "--optim-target-modules", "attn", "--optim-args", "scale_type=tensor"],
     "scale_type=channel"),
])
def test_refusals_are_one_line(capsys, args, word):
    line = assert_one_error_line(*run_cli(capsys, "estimate", "llama-3.2-1b", "--seq-len", "64", *args))
    assert word in line, line


@pytest.mark.parametrize("precision", ["bf16", "bf16-amp"])
@pytest.mark.parametrize("gap", [1, 1000])
def test_trace_step_is_the_replayed_step(precision, gap):
    """trace runs galore_optim's APOLLOAdamW (the limiter taken as a tensor) in the HF Trainer's groups;
    its second optimizer step (gap 1: a projector update; 1000: steady) rises by exactly the replay."""
    import trainmem
    from trainmem.estimate.states import block_bytes
    from trainmem.spec import TrainingSpec, resolve_model
    from trainmem.spec.resolve import framework_names
    from trainmem.spec.training import galore_target
    kw = dict(optimizer="apollo_adamw", precision=precision, optim_target_modules="attn,mlp",
              optim_args=f"rank=8,update_proj_gap={gap}", batch_size=2, seq_len=32)
    ph = trainmem.trace("llama-3.2-1b", set=SET, **kw).phase("optimizer_step", 2)
    m, t = resolve_model("llama-3.2-1b", SET), TrainingSpec(**framework_names(kw))
    tensors = step_order([GTensor(p.shape, galore_target(t, p)) for p in m.parameter_tensors()])
    assert ph.peak - ph.allocated == step_peak(tensors, t.optimizer, t.weight_bytes, 8, "std", gap == 1, block_bytes)


SET = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2,
       "num_attention_heads": 4, "num_key_value_heads": 2}
