"""The reserved replay remembered per setup (``estimate.engine.replayed_gap``): a setup estimated again,
after others that share its quantities, reads what a fresh replay gives."""
import dataclasses

import trainmem
from trainmem.estimate import engine

SETUPS = [dict(grad_accum=1, batch_size=2), dict(grad_accum=4, batch_size=2), dict(grad_accum=4, batch_size=1),
          dict(grad_accum=2, batch_size=2, recompute="full")]


def _run(kw):
    r = trainmem.estimate("gpt2", gpu="a10g", seq_len=256, **kw)
    return r.peak_reserved, r.extra["replay_peak_allocated"], [dataclasses.astuple(p) for p in r.phases]


def test_a_remembered_replay_equals_a_fresh_one():
    first = [_run(kw) for kw in SETUPS]
    again = [_run(kw) for kw in reversed(SETUPS)][::-1]         # every one remembered, in another order
    fresh = []
    for kw in SETUPS:                                            # each replayed anew
        engine._GAPS.clear()
        fresh.append(_run(kw))
    assert first == again == fresh
    assert len({f[0] for f in fresh}) > 1                        # the setups' replays differ: a key too coarse fails


def test_the_setups_share_quantities_so_the_key_must_tell_them_apart():
    engine._GAPS.clear()
    for kw in SETUPS[:2]:
        _run(kw)
    assert len(engine._GAPS) == 1 and len(next(iter(engine._GAPS.values()))) == 2
