"""FSDP2's reduce-scatter input before PyTorch 2.5: made on the reduce-scatter stream, freed when the
reduce returns (``spec.releases.fsdp2_rs_on_default_stream``, pytorch/pytorch PR #129721).

The caching allocator reuses a block only on the stream that allocated it, so before 2.5 the
reduce-scatter inputs sit in a pool of their own: one segment sized for a layer's input, which every
later layer reuses, and one for the root's larger input. The replay (``estimate/reserved/``
``_Fsdp.reduce``) is checked on that rule against sizes computed here from the model's shapes;
trace runs the installed FSDP2 only and refuses another release.
"""
from __future__ import annotations

import collections
import subprocess
import sys

import pytest

import trainmem
from trainmem.allocator import CachingAllocator
from trainmem.allocator_rules import round_size, segment_size
from trainmem.errors import TrainmemError
from trainmem.estimate.reserved.replay import GRAD_STREAM
from trainmem.spec.resolve import resolve

H, F, V, LAYERS = 1024, 2816, 32000, 4
SMALL_LLAMA = dict(set=[f"hidden_size={H}", f"intermediate_size={F}", f"num_hidden_layers={LAYERS}",
                        "num_attention_heads=8", "num_key_value_heads=8", f"vocab_size={V}",
                        "tie_word_embeddings=false"],
                   batch_size=2, seq_len=256, dp=2, fsdp="full", precision="bf16-mp", fsdp_version=2)


def _replayed(monkeypatch: pytest.MonkeyPatch, torch_version: str | None) -> tuple:
    """The estimate and the allocator its reserved-memory replay ran on."""
    made: list[CachingAllocator] = []
    init = CachingAllocator.__init__

    def record(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(self)

    monkeypatch.setattr(CachingAllocator, "__init__", record)
    report = trainmem.estimate("llama-2-7b", torch_version=torch_version, **SMALL_LLAMA)
    assert len(made) == 1
    return report, made[0]


def _segments(a: CachingAllocator, stream: int) -> collections.Counter:
    return collections.Counter(s["total_size"] for s in a.segments() if s["stream"] == stream)


def test_before_2_5_the_reduce_scatter_inputs_have_a_pool_of_their_own(monkeypatch):
    """torch 2.4 against the current release, same setup: the reduce-scatter stream's pool gains
    exactly two segments, one layer's input (its parameters in the fp32 reduce dtype, reused by
    every layer below) and the root's (embedding, head and final norm, fp32), and loses none; the
    allocated peak does not grow (the input is held for less time, not more), reserved memory does."""
    old, a_old = _replayed(monkeypatch, "2.4")
    new, a_new = _replayed(monkeypatch, None)
    layer = (4 * H * H + 3 * H * F + 2 * H) * 4        # q, k, v, o, gate, up, down, two norms; fp32
    root = (2 * V * H + H) * 4                          # embedding, untied head, final norm; fp32
    gained = _segments(a_old, GRAD_STREAM) - _segments(a_new, GRAD_STREAM)
    lost = _segments(a_new, GRAD_STREAM) - _segments(a_old, GRAD_STREAM)
    assert gained == collections.Counter([segment_size(round_size(layer)), segment_size(round_size(root))])
    assert not lost
    assert old.peak_allocated <= new.peak_allocated
    assert old.peak_reserved > new.peak_reserved


def test_the_release_sets_where_the_input_lives():
    assert resolve("llama-2-7b", torch_version="2.4", fsdp="full", dp=2).training.fsdp2_rs_on_default_stream is False
    assert resolve("llama-2-7b", torch_version="2.5", fsdp="full", dp=2).training.fsdp2_rs_on_default_stream
    assert resolve("llama-2-7b", fsdp="full", dp=2).training.fsdp2_rs_on_default_stream


def test_fsdp2_is_accepted_from_2_3_and_refused_before():
    """2.3.0 ships fully_shard (torch.distributed._composable.fsdp, cut from main on 2024-03-15);
    --fsdp alone still means FSDP1 before 2.4."""
    assert resolve("gpt2", torch_version="2.3", fsdp="full", dp=2, fsdp_version=2).training.fsdp_version == 2
    assert resolve("gpt2", torch_version="2.3", fsdp="full", dp=2).training.fsdp_version == 1
    out = subprocess.run([sys.executable, "-m", "trainmem", "estimate", "gpt2", "--torch-version", "2.2",
                          "--dp", "2", "--fsdp", "full", "--fsdp-version", "2"], capture_output=True, text=True)
    assert out.returncode == 2
    assert out.stderr.strip().count("\n") == 0 and "--fsdp-version 2" in out.stderr


def test_trace_refuses_an_older_fsdp2():
    with pytest.raises(TrainmemError, match="trace runs the installed PyTorch"):
        trainmem.trace("gpt2", set=["n_layer=1"], torch_version="2.4", seq_len=64, dp=2, fsdp="full")
