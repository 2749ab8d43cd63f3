"""Worker processes for the planner's simulations: each seeded workload is a separate,
single-threaded simulation, so a search spreads them over the machine's cores.

A library caller asking for more than one job must guard its script's top level with
`if __name__ == "__main__":`, as any program starting worker processes by forkserver must.
"""

from __future__ import annotations

import multiprocessing
from collections import deque
from collections.abc import Callable, Generator, Iterable, Iterator
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import islice
from typing import Any


@dataclass(frozen=True)
class Workers:
    executor: Executor
    count: int  # processes: at most this many of one caller's tasks are in flight

    def in_order(
        self, task: Callable[..., Any], arguments: Iterable[tuple]
    ) -> Generator[Any, None, None]:
        """`task`'s results for each argument tuple, in order, with at most `count` in flight
        ahead of the reader: a reader that stops early (a verdict already decided) leaves
        at most `count - 1` tasks running and none queued."""
        upcoming = iter(arguments)
        in_flight: deque[Future] = deque(
            self.executor.submit(task, *args) for args in islice(upcoming, self.count)
        )
        try:
            while in_flight:
                result = in_flight.popleft().result()
                following = next(upcoming, None)
                if following is not None:
                    in_flight.append(self.executor.submit(task, *following))
                yield result
        finally:
            for future in in_flight:
                future.cancel()


def in_order(
    workers: Workers | None, task: Callable[..., Any], arguments: Iterable[tuple]
) -> Generator[Any, None, None]:
    """`task`'s results for each argument tuple, in order: in `workers` (see
    `Workers.in_order`), or one after another in this process when there are none."""
    if workers is None:
        return (task(*args) for args in arguments)
    return workers.in_order(task, arguments)


@contextmanager
def simulation_pool(jobs: int) -> Iterator[Workers | None]:
    """`jobs` simulations at a time in worker processes; None (run in this process) for 1."""
    if jobs <= 1:
        yield None
        return
    # forkserver, not fork: forking a process that runs threads (a test runner, a gRPC
    # client) can copy a held lock into the child
    context = multiprocessing.get_context("forkserver")
    with ProcessPoolExecutor(jobs, mp_context=context) as executor:
        yield Workers(executor, jobs)
