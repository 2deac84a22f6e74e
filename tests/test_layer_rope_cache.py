"""``--layer-rope-cache N``: torchtune's Llama-2 builder up to v0.5.0 deep-copies the decoder layer
with its ``RotaryPositionalEmbeddings``, so every layer holds an fp32 ``theta`` [head_dim/2] and
``cache`` [N, head_dim/2, 2] (torchtune ff594c231 ``position_embeddings.py`` L38, L57-73). The
estimate counts them with the buffers (``states._layer_rope_cache``); trace registers them on each
layer's attention of the transformers model (``workload.add_layer_rope_cache``)."""
from __future__ import annotations

import pytest

from trainmem.errors import TrainmemError

pytest.importorskip("torch")
pytest.importorskip("transformers")

from trainmem import estimate, trace  # noqa: E402

OPTS = dict(batch_size=2, seq_len=512, precision="bf16", lora_rank=8, lora_targets="q_proj,v_proj", lora_dtype="half",
            recompute="full", loss="upcast", cast_output=True, hold_output="step", gpu="rtx-4090",
            set={"num_hidden_layers": 4})


def _buffers(rep) -> int:
    return sum(c.bytes for c in rep.components if c.category == "buffers")


def test_estimate_and_trace_add_the_same_buffers():
    """Four Llama-2-7B layers in torchtune's LoRA setup, N = 4096: each layer's 2 MiB cache and 256 B
    theta are in both reports' buffers (the estimate charges theta its 512-byte block), and both
    allocated peaks rise by the same bytes."""
    e0, t0 = estimate("llama-2-7b", **OPTS), trace("llama-2-7b", **OPTS)
    e1, t1 = estimate("llama-2-7b", layer_rope_cache=4096, **OPTS), trace("llama-2-7b", layer_rope_cache=4096, **OPTS)
    cache = 4096 * 64 * 2 * 4                 # [4096, 64, 2] fp32
    assert _buffers(e1) - _buffers(e0) == 4 * (cache + 512)
    assert _buffers(t1) - _buffers(t0) == 4 * (cache + 64 * 4)
    assert e1.peak_allocated - e0.peak_allocated == t1.peak_allocated - t0.peak_allocated == 4 * (cache + 512)


def test_refused_for_a_model_without_llama_layers():
    with pytest.raises(TrainmemError) as err:
        estimate("gpt2", layer_rope_cache=1024)
    assert "\n" not in str(err.value) and "--layer-rope-cache 1024" in str(err.value)
