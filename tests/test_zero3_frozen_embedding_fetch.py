"""DeepSpeed ZeRO-3's recorded module order in the reserved replay has no backward use of a frozen
word embedding (``zero3_replay.without_backward``, ``quantities.zero3_gather._frozen_embedding``): the
engine fetches a module for backward from its output's gradient (v0.19.8
``runtime/zero/parameter_offload.py`` L455-485: ``_pre_backward_module_hook`` -> ``PreBackwardFunctionForModule``),
and under LoRA without recomputation the table's output over integer ids needs none. The replay had
the tied table gathered again for the embedding's backward in the first step, and kept gathered to the
end of every later backward; trace's coordinator releases it after the head's backward. Found on the
agreement grid's Llama-3.2-1B LoRA ZeRO-3 row (-13.4 %, which this does not move: the rest of that
row's difference is where LoRA's activations sit in the first 502 MiB segment).
"""
from __future__ import annotations

import trainmem
from trainmem.estimate.quantities.build import quantities
from trainmem.spec import TrainingSpec, resolve_model
from trainmem.trace.api import trace

LLAMA = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 256,
         "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2,
         "vocab_size": 32000, "max_position_embeddings": 512, "rms_norm_eps": 1e-5,
         "tie_word_embeddings": True, "hidden_act": "silu"}
KW = dict(batch_size=1, seq_len=64, precision="bf16", dp=2, zero=3, lora_rank=8, use_cache=False)


def test_trace_never_fetches_the_frozen_embedding_for_backward(monkeypatch, one_torch_thread):
    """What the replay now assumes, on the real coordinator: the Embedding module is fetched for
    forward only."""
    import deepspeed.runtime.zero.partitioned_param_coordinator as coord
    seen: list[tuple[str, bool]] = []
    orig = coord.PartitionedParameterCoordinator.fetch_sub_module

    def spy(self, module, forward):
        seen.append((type(module).__name__, forward))
        return orig(self, module, forward)
    monkeypatch.setattr(coord.PartitionedParameterCoordinator, "fetch_sub_module", spy)
    trace(LLAMA, **KW)
    assert ("Embedding", True) in seen
    assert ("Embedding", False) not in seen


def test_replay_releases_the_table_after_the_heads_backward():
    """The recorded order's backward: the tied table (parameter 0) is released at the head's backward
    use, before the layers' backward, and no later use fetches or releases it (before: released at
    the embedding's backward, the last use, and fetched there in the first step)."""
    q = quantities(resolve_model(LLAMA), TrainingSpec(**KW))
    for first in (0, 1):
        uses = q.ds_events[first]
        touched = [i for i, u in enumerate(uses) if not u[0] and any(k == 0 for _s, k, _n in u[3] + u[4])]
        assert touched, "the head's backward use fetches or releases the table"
        last = touched[-1]
        layers_backward = min(i for i, u in enumerate(uses) if not u[0] and u[1] is not None)
        assert last < layers_backward                            # the head's, before the layers' backward
        assert any(s < 0 and k == 0 for s, k, _n in uses[last][4])


def test_full_training_keeps_the_embeddings_backward():
    """Without LoRA the table is trained: its backward use stays, the table released there."""
    q = quantities(resolve_model(LLAMA), TrainingSpec(**{k: v for k, v in KW.items() if k != "lora_rank"}))
    uses = q.ds_events[1]
    assert any(s < 0 and k == 0 for s, k, _n in uses[-1][4])
