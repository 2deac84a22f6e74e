"""The event codes of a layer recipe's forward and backward groups, in one place: the small language in which
``layers.Recipe.forward_group`` / ``group_ahead`` (and eager attention's ``Recipe.attn_events``) and
``Recipe.backward_group`` write a layer's tensors in op order, and which the reserved replay reads
(``reserved.layer_forward._group_allocs``, ``reserved.layer_backward._run_group``). An event is a one-letter
code, and for an indexed code the index K it acts on (``at``): "f3" frees temporary 3. A letter means one
thing in a forward group (``Fwd``) and another in a backward group (``Bwd``). The strings are what
``LayerCoefs.fwd_groups``, ``bwd_groups`` and ``attn_events`` hold (docs/design.md, "Group event codes").

Other recorded sequences have languages of their own, not these: a checkpointed first forward's
(``nograd.py``, ``reserved.layer_forward._nograd_forward``), a derived layer's forward and backward
(``trace/derive.py``, ``reserved.layer_forward._sequence_forward``, ``reserved.layer_backward._recorded_free``)."""
from __future__ import annotations


def at(code: str, k: int) -> str:
    """The indexed event ``code`` acting on the K-th tensor (temporary, block, saved tensor or linear)."""
    return f"{code}{k}"


def index(e: str) -> int:
    """The K of an indexed event (``at``); may be negative (``Bwd.RELEASE`` of a tensor saved before the group)."""
    return int(e[1:])


class Fwd:
    """A forward group's events: each temporary and saved tensor in op order (``Recipe.forward_group``'s
    ``temps`` and ``saved``), replayed by ``reserved.layer_forward._group_allocs``."""

    TEMP = "t"          # make the next temporary
    SAVED = "s"         # make the next saved tensor
    INPUT = "i"         # the layer's input as the next saved tensor: the layer below's output (``_LayerCarry.resid``)
    INPUT_TEMP = "j"    # the layer's input as the next temporary, unsaved: freed once the layer's hooks have run
    WORKSPACE = "w"     # the forward thread's cuBLAS workspace, made here (after the first matmul's output)
    DROP_HELD = "H"     # free what the layer's earlier groups held ("hK")
    FREE = "f"          # fK: free temporary K
    AFTER = "g"         # gK: temporary K freed once the caller has made the group's output
    END = "e"           # eK: temporary K freed at the layer's end (once the next layer's input exists)
    NEXT_SAVED = "n"    # nK: temporary K freed once the next saved tensor after the group exists
    OUT_REF = "c"       # cK: temporary K referenced by the model output (the KV cache), freed with it
    HOLD = "h"          # hK: temporary K held past the group, until a later "H"

    @staticmethod
    def free(k: int) -> str:
        return at(Fwd.FREE, k)

    @staticmethod
    def after(k: int) -> str:
        return at(Fwd.AFTER, k)

    @staticmethod
    def end(k: int) -> str:
        return at(Fwd.END, k)

    @staticmethod
    def next_saved(k: int) -> str:
        return at(Fwd.NEXT_SAVED, k)

    @staticmethod
    def out_ref(k: int) -> str:
        return at(Fwd.OUT_REF, k)

    @staticmethod
    def hold(k: int) -> str:
        return at(Fwd.HOLD, k)


class Bwd:
    """A backward group's events: one op's backward tensors in op order (``Recipe.backward_group``'s
    ``temps``; K of "fK", "cK", "kK" counts the group's blocks as made), replayed by
    ``reserved.layer_backward._run_group``."""

    TEMP = "t"          # make the next block
    TAKE = "u"          # the next block: the one an earlier group carried ("cK"), else made
    TAKE_STREAM = "r"   # the next block: the residual stream's gradient an earlier group kept ("kK"), else made
    FREE = "f"          # fK: free block K
    RELEASE = "s"       # sK: release the layer's saved tensor base + K (its node has run)
    WEIGHT_GRAD = "w"   # wK: make linear K's weight gradient (its ``.grad``)
    HALF_GRAD = "h"     # hK: linear K's half weight gradient under autocast, as the next block
    DROP_COPY = "x"     # xK: free linear K's half weight copy (autocast's)
    CARRY = "c"         # cK: keep block K past the group, for a later group's "u"
    KEEP_STREAM = "k"   # kK: keep block K past the group as the residual stream's gradient, for a later "r"

    @staticmethod
    def free(k: int) -> str:
        return at(Bwd.FREE, k)

    @staticmethod
    def release(k: int) -> str:
        return at(Bwd.RELEASE, k)

    @staticmethod
    def weight_grad(k: int) -> str:
        return at(Bwd.WEIGHT_GRAD, k)

    @staticmethod
    def half_grad(k: int) -> str:
        return at(Bwd.HALF_GRAD, k)

    @staticmethod
    def drop_copy(k: int) -> str:
        return at(Bwd.DROP_COPY, k)

    @staticmethod
    def carry(k: int) -> str:
        return at(Bwd.CARRY, k)

    @staticmethod
    def keep_stream(k: int) -> str:
        return at(Bwd.KEEP_STREAM, k)
