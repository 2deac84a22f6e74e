"""The reserved replay requests an optimizer state at its own bytes and charges it its block
(``reserved.replay._Replay.alloc``'s ``charge``, ``reserved.optimizer._state_requests``)."""
from __future__ import annotations

from trainmem.allocator_rules import block_bytes
from trainmem.estimate.quantities.build import quantities
from trainmem.estimate.reserved.optimizer import _state_requests
from trainmem.estimate.reserved.replay import _Replay
from trainmem.spec.resolve import resolve

MiB = 1 << 20
#: a Llama whose 8000 x 1024 bf16 embedding and head are 15.625 MiB each: blocks of 16 MiB alone
WIDE = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 1024,
        "intermediate_size": 2816, "num_attention_heads": 16, "num_key_value_heads": 16, "num_hidden_layers": 2,
        "vocab_size": 8000, "max_position_embeddings": 1024, "rms_norm_eps": 1e-5,
        "tie_word_embeddings": False, "hidden_act": "silu"}


def test_charged_request_is_split_to_its_own_size():
    """Two 31.25 MiB tensors charged 32 MiB each fit in one cached 64 MiB segment with 1.5 MiB to
    spare (a block is split when more than 1 MiB remains), and the net peak still counts 64 MiB."""
    R = _Replay()
    R.mark("model_loaded", 0)
    R.free(R.alloc(64 * MiB))                          # one cached 64 MiB segment, free
    own, charge = 31.25 * MiB, block_bytes(int(31.25 * MiB))
    assert charge == 32 * MiB
    a, b = R.alloc(own, charge=charge), R.alloc(own, charge=charge)
    assert R.a.block_size(a) == R.a.block_size(b) == own   # each split to its own size
    assert R.a.reserved == 64 * MiB and R.a.allocated == 62.5 * MiB
    assert R.net_peak == 64 * MiB                        # the charges, as the estimate counts them
    R.free(a)
    assert R.over == -0.75 * MiB                         # b's block netted up to its charge


def test_states_requested_at_their_own_bytes():
    """Each state's request is the tensor's bytes, of which its charged block is ``block_bytes``;
    the embedding's and the head's differ (15.625 MiB, charged 16 MiB)."""
    r = resolve(WIDE, batch_size=4, seq_len=512, precision="bf16", use_cache=False, recompute="full")
    st = quantities(r.model, r.training).detail.states
    R = _Replay()
    asked = [(x, b) for j in range(len(st.trainables)) for x, b in zip(_state_requests(R, st, j), st.trainables[j][3])]
    assert asked and all(block_bytes(x) == b for x, b in asked)
    assert sorted(x for x, b in asked if x != b) == [int(15.625 * MiB)] * 4   # two AdamW states each
