"""A frozen SwiGLU MLP under autocast (LoRA) in the reserved replay: ``silu`` saves the gate output, and
the product ``silu * up`` its own inputs, in op order (``layers._swiglu``).

transformers 5.24 ``models/llama/modeling_llama.py`` ``LlamaMLP.forward``:
``down_proj(act_fn(gate_proj(x)) * up_proj(x))``. Python evaluates ``act_fn(gate_proj(x))`` before
``up_proj(x)``, so the gate output and silu's output exist before up_proj casts its weight. The recipe
saved all three (gate, silu, up outputs) after up_proj, so for a frozen MLP, whose linears save no input
casts between them, the replay made up_proj's weight copy before the gate and silu outputs. Trace,
Qwen2.5-1.5B LoRA r16 bf16-amp b4 s2048 (H200): the gate copy (26.25 MiB), the gate output (140 MiB),
silu's (140 MiB), then up_proj's input cast and copy. The replay's peak reserved against the real run
-0.94 -> -0.89 %.
"""
from __future__ import annotations

import pytest

import trainmem
from trainmem import allocator
from trainmem.trace.api import trace

H, F, S = 2048, 5632, 768
LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": H, "intermediate_size": F,
         "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "num_hidden_layers": 2,
         "vocab_size": 32000, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
         "hidden_act": "silu", "rope_theta": 500000.0}
KW = dict(batch_size=1, seq_len=S, precision="bf16-amp", lora_rank=16)
COPY, OUT = F * H * 2, S * F * 2          # gate/up/down's bf16 weight copy (f, h); gate/silu/up outputs (1, s, f) bf16


def _requests(run) -> list[int]:
    """The sizes of every request the run makes of the simulated caching allocator, in order."""
    cls, log = allocator.CachingAllocator, []
    alloc = cls.allocate

    def spy(self, nbytes, tag=None, stream=None):
        log.append(nbytes)
        return alloc(self, nbytes, tag, stream)
    cls.allocate = spy
    try:
        run()
    finally:
        cls.allocate = alloc
    return log


def _between_gate_and_up(log: list[int]) -> int:
    """(1, s, f) requests between the second layer's gate_proj and up_proj weight copies."""
    copies = [i for i, n in enumerate(log) if n == COPY]
    return sum(n == OUT for n in log[copies[3]:copies[4]])      # layer 0: gate, up, down; layer 1: gate, up


@pytest.mark.slow
def test_frozen_swiglu_saves_gate_and_silu_before_up(one_torch_thread):
    """Trace makes the gate output and silu's output between the two copies; so does the replay
    (none before: both were made after up_proj's copy)."""
    t = _between_gate_and_up(_requests(lambda: trace(LLAMA, **KW)))
    e = _between_gate_and_up(_requests(lambda: trainmem.estimate(LLAMA, **KW)))
    assert t == 2
    assert e == t
