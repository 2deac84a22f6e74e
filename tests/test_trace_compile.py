"""``trace --compile``: the step with the model's forward and backward as AOTAutograd partitions them
for inductor (``trainmem.trace.compiled``), run op by op under the tracker, on a tiny Llama.

Each test checks the compiled run against something it could disagree with: the partitioner's own
graphs (what the forward saves), the eager trace of the same step, and the compiled run with its
fusion model or its checkpoint tags taken away."""
import pytest
import torch

import trainmem.trace.compiled as compiled
from trainmem.errors import TrainmemError
from trainmem.trace.api import trace
from compile_graphs import saved_bases

TINY = ["num_hidden_layers=2", "hidden_size=64", "num_attention_heads=4", "num_key_value_heads=2",
        "intermediate_size=128", "vocab_size=1000", "head_dim=16"]
BASE = {"batch_size": 2, "seq_len": 64, "precision": "bf16-amp"}


class _Catch:
    """Collect the CompiledModel a trace builds (its graphs) and optionally turn fusion off."""

    def __init__(self, monkeypatch, fuse=True):
        self.models = []
        orig = compiled.CompiledModel.__init__

        def init(model, module, tracker, fuse_=True):
            orig(model, module, tracker, fuse)
            self.models.append(model)
        monkeypatch.setattr(compiled.CompiledModel, "__init__", init)

    def graph(self, kind):
        return next(gm for k, gm in self.models[0].graphs if k == kind)


def _bytes(node):
    v = node.meta.get("val")
    return v.untyped_storage().nbytes() if isinstance(v, torch.Tensor) else 0


def _saved_storages(fw, user_outputs):
    """(shape, dtype, bytes) of the distinct storages the partitioned forward returns for the
    backward (``saved_bases``), sorted."""
    return sorted((tuple(v.shape), str(v.dtype), _bytes(base)) for base, v in saved_bases(fw, user_outputs))


def _saved_storage_bytes(fw, user_outputs):
    return sum(b for _, _, b in _saved_storages(fw, user_outputs))


@pytest.fixture(scope="module")
def eager():
    return trace("llama-3.2-1b", set=TINY, **BASE)


def test_compiled_forward_saves_what_the_partitioner_chose(monkeypatch):
    """The storages autograd packs for the backward while the compiled step runs (the tracker's
    saved-tensor hook, under AOTAutograd's ``CompiledFunction.save_for_backward``) are the ones the
    partitioned forward graph returns for its backward (parameters and the batch aside, which are
    graph inputs), byte for byte, and they are alive when the forward ends."""
    from trainmem.trace import tracker as tracker_mod
    catch = _Catch(monkeypatch)
    trackers = []
    orig = tracker_mod.Tracker.__init__

    def init(self, *a, **k):
        orig(self, *a, **k)
        trackers.append(self)
    monkeypatch.setattr(tracker_mod.Tracker, "__init__", init)
    r = trace("llama-3.2-1b", set=TINY, compile=True, **BASE)
    # the user's outputs: loss, logits and the KV cache's keys and values of the two layers
    expected = _saved_storage_bytes(catch.graph("forward"), user_outputs=2 + 2 * 2)
    fwd_end = next(m.end_event for m in trackers[0].phase_marks if (m.name, m.step) == ("forward", 2))
    saved = [rec for rec in trackers[0].records if rec.saved and rec.step == 2 and rec.phase == "forward"]
    assert expected > 0
    assert sum(rec.nbytes for rec in saved) == expected
    assert all(rec.free_event is None or rec.free_event > fwd_end for rec in saved)
    assert r.peak_allocated > 0
    # the loss's own backward is in the graph: its incoming gradient (the first tangent) is read
    # (on meta tensors nll_loss once lost its autograd formula and the backward started at the logits)
    bw = catch.graph("backward")
    tangents = [n for n in bw.graph.nodes if n.op == "placeholder" and n.name.startswith("tangents")]
    assert tangents and tangents[0].users


def test_compile_peak_below_eager_and_same_model_states(monkeypatch, eager):
    """Inductor's fused loss and elementwise chains hold less than the eager step; the model states
    after backward, step and zero_grad do not depend on how the forward ran."""
    r = trace("llama-3.2-1b", set=TINY, compile=True, **BASE)
    assert r.peak_allocated < eager.peak_allocated
    for name in ("backward", "optimizer_step", "zero_grad"):
        assert r.phase(name, 2).allocated == eager.phase(name, 2).allocated, name
    assert "compile" not in " ".join(r.warnings)


def test_fusion_only_removes_allocations(monkeypatch):
    """The fusion model runs the inlined pointwise ops uncounted: with it off (every node's output
    allocated, freed after its last use) the same graphs peak higher, never lower, and the phases'
    end points (what lives across them) are the same."""
    fused = trace("llama-3.2-1b", set=TINY, compile=True, **BASE)
    orig = compiled.fused_away
    monkeypatch.setattr(compiled, "fused_away", lambda gm: set())
    plain = trace("llama-3.2-1b", set=TINY, compile=True, **BASE)
    monkeypatch.setattr(compiled, "fused_away", orig)
    assert plain.peak_allocated > fused.peak_allocated
    assert [p.allocated for p in plain.phases] == [p.allocated for p in fused.phases]


def test_checkpointed_layers_save_only_their_inputs(monkeypatch):
    """--recompute full under --compile: the checkpointed decoder layers' nodes are tagged
    PREFER_RECOMPUTE, so the partitioned forward saves less than without recompute, and less than
    the same run with the tags removed (where the partitioner is free to save them)."""
    catch = _Catch(monkeypatch)
    full = trace("llama-3.2-1b", set=TINY, compile=True, recompute="full", **BASE)
    none = trace("llama-3.2-1b", set=TINY, compile=True, **BASE)
    saved_full = _saved_storage_bytes(catch.graph("forward"), 2)
    saved_none = _saved_storage_bytes(next(gm for k, gm in catch.models[1].graphs if k == "forward"), 6)
    assert saved_full < saved_none
    assert full.phase("forward", 2).allocated < none.phase("forward", 2).allocated


@pytest.mark.parametrize("options, names", [
    ({"dp": 2}, "--dp"), ({"loss": "half", "loss_chunks": 4}, "--loss-chunks 4"),
    ({"recompute": "op"}, "--recompute op"),
])
def test_compile_refusals_name_the_option(options, names):
    with pytest.raises(TrainmemError, match="--compile") as e:
        trace("llama-3.2-1b", set=TINY, compile=True, **{**BASE, **options})
    assert names in str(e.value) and "\n" not in str(e.value)


def test_compile_on_the_cpu_is_refused():
    with pytest.raises(TrainmemError, match="--compile"):
        trace("llama-3.2-1b", set=TINY, compile=True, device="cpu", **BASE)


def test_capture_partitions_as_dynamo_does(monkeypatch):
    """trace captures the model call with ``aot_function`` on the emulated GPU, not with dynamo
    (trace/compiled.py says why). On a setup where the CPU and the emulated GPU run the same ops
    (fp32, eager attention, no dropout), the real ``torch.compile`` path -- dynamo, then
    AOTAutograd with inductor's decompositions and partition -- on the CPU saves the same tensors
    (shape and dtype, views of parameters aside) as trace's capture."""
    import transformers
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.decomposition import select_decomp_table
    from functorch.compile import make_boxed_func
    catch = _Catch(monkeypatch)
    trace("llama-3.2-1b", set=TINY, compile=True, batch_size=2, seq_len=64, precision="fp32", attention="eager")
    mine = _saved_storages(catch.graph("forward"), 2 + 2 * 2)

    graphs = []

    def keep(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=keep, bw_compiler=keep, partition_fn=compiled._partition,
                           decompositions=select_decomp_table())
    cfg = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
                                   intermediate_size=128, vocab_size=1000, head_dim=16)
    model = transformers.LlamaForCausalLM._from_config(cfg, attn_implementation="eager").train()
    ids = torch.randint(0, 1000, (2, 64))
    torch.compile(model, backend=backend)(input_ids=ids, labels=ids).loss.backward()
    torch._dynamo.reset()
    assert len(graphs) == 2  # one forward, one backward: no graph break
    assert _saved_storages(graphs[0], 2 + 2 * 2) == mine
    assert mine
