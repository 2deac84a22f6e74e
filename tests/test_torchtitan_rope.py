"""Under ``--framework torchtitan`` a transformers Llama rotates q and k as torchtitan's
``apply_rotary_emb`` does (``trainmem.torchtitan_modules``): an fp32 copy and a complex64 product per
q and k, the same saved tensors. Elsewhere transformers' own rotation runs."""
from __future__ import annotations

import contextlib

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402
from transformers import LlamaConfig, LlamaForCausalLM  # noqa: E402
from transformers.models.llama import modeling_llama  # noqa: E402

from trainmem import torchtitan_modules, trace  # noqa: E402
from trainmem.spec.resolve import resolve  # noqa: E402

CFG = dict(num_hidden_layers=1, hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
           intermediate_size=128, vocab_size=96, max_position_embeddings=64)


class _Dtypes(TorchDispatchMode):
    """The dtypes and shapes of every op's tensor outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[torch.dtype, tuple]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for o in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(o, torch.Tensor):
                self.seen.append((o.dtype, tuple(o.shape)))
        return out


def _forward(framework: str | None) -> tuple[_Dtypes, LlamaForCausalLM]:
    model = LlamaForCausalLM(LlamaConfig(**CFG)).to(torch.bfloat16)
    t = resolve("llama-3.2-1b", **({"framework": framework} if framework else {})).training
    ids = torch.randint(0, CFG["vocab_size"], (2, 16))
    rec = _Dtypes()
    with torchtitan_modules.rope(model, t):
        with rec:
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
    return rec, model


def test_torchtitan_rotates_q_and_k_as_complex_numbers():
    before = modeling_llama.apply_rotary_pos_emb
    rec, model = _forward("torchtitan")
    assert modeling_llama.apply_rotary_pos_emb is before                   # restored after the step
    q = (2, CFG["num_attention_heads"], 16, CFG["hidden_size"] // CFG["num_attention_heads"])
    complex_ = [s for d, s in rec.seen if d == torch.complex64 and s == q[:-1] + (q[-1] // 2,)]
    fp32_q = [s for d, s in rec.seen if d == torch.float32 and s == q]
    assert len(complex_) >= 2                                               # q's and k's products
    assert len(fp32_q) >= 2                                                 # q's and k's fp32 copies
    assert model.model.layers[0].self_attn.q_proj.weight.grad is not None   # gradients flow through


class _Ops(TorchDispatchMode):
    """Each op's name and its first output's dtype, in call order."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[tuple[str, torch.dtype]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        first = out[0] if isinstance(out, (tuple, list)) else out
        self.seen.append((str(func), getattr(first, "dtype", None)))
        return out


def test_torchtitan_rotation_copies_q_and_k_before_either_product():
    """``apply_rotary_emb``'s order (``xq.float()``, ``xk.float()``, then ``xq_ * freqs_cis``, ``xk_ *
    freqs_cis``, then the two ``type_as``): both fp32 copies before the first complex product, and
    both products before the first cast back to bf16."""
    f = torchtitan_modules.rotary({})
    q, k = (torch.randn(2, 4, 16, 16, dtype=torch.bfloat16) for _ in range(2))
    cos, sin = torch.ones(2, 16, 16), torch.zeros(2, 16, 16)
    rec = _Ops()
    with rec:
        f(q, k, cos, sin)
    ops = [(n, d) for n, d in rec.seen if n in ("aten._to_copy.default", "aten.mul.Tensor")]
    kinds = ["fp32" if d == torch.float32 else "c64" if d == torch.complex64 else "bf16" for _n, d in ops]
    assert kinds[-6:] == ["fp32", "fp32", "c64", "c64", "bf16", "bf16"], kinds


def test_other_frameworks_keep_transformers_rotation():
    rec, _model = _forward(None)
    assert not any(d == torch.complex64 for d, _s in rec.seen)


@pytest.mark.slow
def test_torchtitan_rotation_saves_what_transformers_saves(monkeypatch):
    """The swap changes the forward's temporaries, not what autograd keeps: the tensors alive at the
    allocated peak differ by no more than the complex frequencies the layers share ((s, head_dim / 2)
    complex64). The allocator's rounding of the blocks it did not split (``allocator_overhead``)
    depends on which cached blocks the temporaries left, so it is not part of the comparison (with
    the rotation in torchtitan's order it is 1.5 MiB more here)."""
    setup = dict(batch_size=2, seq_len=512, dp=8, fsdp="full", fsdp_version=2, precision="bf16-mp",
                 recompute="op", optimizer_impl="foreach", loss="half", gpu="h100", expandable_segments=False,
                 hold_output="loss")
    cut = {"num_hidden_layers": 2}
    titan = trace("llama-2-7b", framework="torchtitan", overrides=cut, **setup)
    monkeypatch.setattr(torchtitan_modules, "rope", lambda model, t: contextlib.nullcontext())
    plain = trace("llama-2-7b", framework="torchtitan", overrides=cut, **setup)  # transformers' rotation
    freqs = 512 * 64 * 8

    def tensors(r) -> int:                                                  # the peak less block rounding
        return r.peak_allocated - sum(c.bytes for c in r.components if c.category == "allocator_overhead")
    assert sum(c.bytes for c in titan.components) == titan.peak_allocated
    assert abs(tensors(titan) - tensors(plain)) <= freqs + 512


def test_the_layers_share_one_complex_frequency_tensor_per_forward():
    """torchtitan's layers multiply by views of one ``freqs_cis`` buffer: one complex tensor of
    (s, head_dim / 2) is made per forward, however many layers, and none outlives the step."""
    cfg = dict(CFG, num_hidden_layers=3)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).to(torch.bfloat16)
    t = resolve("llama-3.2-1b", framework="torchtitan").training
    ids = torch.randint(0, cfg["vocab_size"], (2, 16))
    freqs = (16, cfg["hidden_size"] // cfg["num_attention_heads"] // 2)
    rec = _Dtypes()
    with torchtitan_modules.rope(model, t):
        with rec:
            model(input_ids=ids)
    assert [s for d, s in rec.seen if d == torch.complex64 and s == freqs] == [freqs]


@pytest.mark.slow
def test_compiled_trace_runs_torchtitans_rotation():
    """Under ``--compile`` the complex frequencies are made inside the captured graph (a tensor kept
    from outside it would be a constant the fake-tensor capture refuses)."""
    r = trace("llama-3.2-1b", framework="torchtitan", overrides={"num_hidden_layers": 2}, batch_size=1,
              seq_len=256, compile=True)
    assert r.peak_allocated > 0
