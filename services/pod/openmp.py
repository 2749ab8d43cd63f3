"""How long an engine pod's OpenMP threads spin while they wait for work, set before torch loads.

torch's CPU kernels run on libgomp, whose idle threads spin for about 300,000 iterations before
they sleep. On a core that another process also wants (the gateway, Redis, a sidecar, a load
generator) that spinning takes the time the descheduled thread needs to finish its share, and
every parallel region waits for the slowest thread: a colocated pod collapsed to a few requests
a minute that way. 10,000 iterations (tens of microseconds) still bridge the gaps between one
step's kernels, so a quiet machine loses nothing (`python -m benchmarks.step_breakdown` with
GOMP_SPINCOUNT=10000 vs unset: within noise at batch 1, 4 and 16; 0, sleeping at once, cost
up to 64% more), while a contended core is handed back quickly (`python -m benchmarks.contention`).
A value already in the environment wins.
"""

from __future__ import annotations

import os
import sys

SPIN_COUNT = "10000"


def bound_spin_waiting() -> None:
    """Sets GOMP_SPINCOUNT unless it is set; only effective before torch (libgomp) loads."""
    if "torch" in sys.modules:
        return  # too late for this process: libgomp read its environment when it loaded
    os.environ.setdefault("GOMP_SPINCOUNT", SPIN_COUNT)
