"""Worker processes for the planner's simulations: each seeded workload is a separate,
single-threaded simulation, so a search spreads them over the machine's cores."""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator
from concurrent.futures import Executor, ProcessPoolExecutor
from contextlib import contextmanager


@contextmanager
def simulation_pool(jobs: int) -> Iterator[Executor | None]:
    """`jobs` simulations at a time in worker processes; None (run in this process) for 1."""
    if jobs <= 1:
        yield None
        return
    # forkserver, not fork: forking a process that runs threads (a test runner, a gRPC
    # client) can copy a held lock into the child
    context = multiprocessing.get_context("forkserver")
    with ProcessPoolExecutor(jobs, mp_context=context) as pool:
        yield pool
