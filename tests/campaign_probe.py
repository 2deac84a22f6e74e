"""Probes for campaign tests: a CPU probe that answers like a CUDA device (the campaign's children
load it through TRAINMEM_CAMPAIGN_PROBE), optionally slow to start (to test the time budget)."""
import os
import time

from trainmem.measure.probes import CpuProbe

CONTEXT = 300 * 2**20


class PretendGpu(CpuProbe):
    """Reserved in 2 MiB segments never released, a driver figure CONTEXT above reserved, 1 GiB
    in total; real LiveBytes counting underneath. ``CAMPAIGN_TEST_SLEEP_S`` seconds of sleep on
    entering (a run that a budget must cut)."""

    kind = "cuda"

    def __init__(self, limit=None):
        super().__init__(limit)
        self.total = 2**30
        self.top_reserved = 0

    def __enter__(self):
        time.sleep(float(os.environ.get("CAMPAIGN_TEST_SLEEP_S", "0")))
        return super().__enter__()

    def reserved(self):
        self.top_reserved = max(self.top_reserved, (self.lb.current + 2**21 - 1) // 2**21 * 2**21)
        return self.top_reserved

    def peak_reserved(self):
        return max(self.reserved(), (self.lb.peak_since_mark + 2**21 - 1) // 2**21 * 2**21)

    def driver(self):
        return {"used": self.reserved() + CONTEXT, "process": None, "baseline": None, "source": "pretend"}

    def stats(self):
        return {"num_alloc_retries": 0, "num_ooms": 0, "limit": self.limit, "total": self.total}

    def describe(self):
        return {"gpu": "Pretend GPU", "driver": "0.0"}
