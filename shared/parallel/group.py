"""Rank 0's handle on a parallel engine: starts the other ranks, sends them each step, stops
them, and turns a dead or hung rank into an exception out of the engine's step.

The engine process is rank 0: it schedules once, broadcasts what to compute, runs its own part
of the forward, and alone computes the logits and samples. Who holds what: shared/parallel/
layout.py (tensor parallel, by heads), pipeline.py (by layers), grid.py (both: stages of
tensor-parallel ranks); docs/parallelism.md.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, TypeVar

import torch.multiprocessing as mp

from splitserve.engine.config import EngineConfig
from splitserve.engine.parallel.comm import Communicator, make_store
from splitserve.engine.parallel.ops import Opcode, send
from splitserve.engine.parallel.worker import WorkerSpec, run_worker

if TYPE_CHECKING:
    import torch

    from splitserve.engine.parallel.rank import RankLayout
    from splitserve.engine.runner import ModelInputs, ModelRunner

logger = logging.getLogger(__name__)

T = TypeVar("T")

# A collective that waits longer than this fails the step: every rank does the same work, so
# a rank this far behind is hung (or its machine is hopelessly oversubscribed).
COLLECTIVE_TIMEOUT_S = 120.0
# The other ranks load the checkpoint before joining; a slow disk may take this long.
START_TIMEOUT_S = 600.0
_READY_POLL_S = 0.05


class ParallelError(RuntimeError):
    """A rank died or hung: this engine cannot run another step."""


def threads_per_rank(config: EngineConfig) -> int:
    """num_threads applies to every rank; by default the cores are shared out."""
    if config.num_threads:
        return config.num_threads
    return max(1, (os.cpu_count() or 1) // config.parallel.world_size)


class ParallelGroup:
    def __init__(self, layout: RankLayout, processes: list, comm: Communicator) -> None:
        self.layout = layout
        self.processes = processes
        self.comm = comm
        self.failure: ParallelError | None = None
        self._finalizer = weakref.finalize(self, _stop, comm, processes)

    @classmethod
    def start(
        cls,
        config: EngineConfig,
        layout: RankLayout,
        num_blocks: int,
        max_model_len: int,
        build_rank0: Callable[[], T],
    ) -> tuple[ParallelGroup, T]:
        """Spawns ranks 1..n-1 (they load their parts meanwhile), calls `build_rank0` (rank
        0's own model and cache), then waits for every rank to join the group."""
        world_size = layout.world_size
        store = make_store(world_size, START_TIMEOUT_S)
        processes = _spawn(config, world_size, store.port, num_blocks, max_model_len)
        try:
            built = build_rank0()
            _wait_until_ready(store, processes)
            comm = Communicator(store, 0, world_size, COLLECTIVE_TIMEOUT_S)
        except BaseException:
            _terminate(processes)
            raise
        return cls(layout, processes, comm), built

    def run_step(self, runner: ModelRunner, inputs: ModelInputs) -> torch.Tensor:
        """One forward over every rank: rank 0 sends the step and runs its part through
        `runner`; the logits [num_logits, vocab]."""
        return self.guard(lambda: self.layout.run_first_rank(self.comm, runner, inputs))

    def guard(self, action: Callable[[], T]) -> T:
        """Runs a collective `action`; a failure (now or before) is a ParallelError."""
        if self.failure is not None:
            raise self.failure
        try:
            return action()
        except Exception as exc:
            # Whatever failed mid-step, the ranks are out of step now: none can be trusted.
            self.failure = ParallelError(self._describe_failure(exc))
            raise self.failure from exc

    def _describe_failure(self, exc: Exception) -> str:
        dead = [
            f"rank {rank} (exit code {process.exitcode})"
            for rank, process in enumerate(self.processes, start=1)
            if not process.is_alive()
        ]
        if dead:
            return f"parallel engine {', '.join(dead)} died"
        return f"parallel engine step failed: {type(exc).__name__}: {str(exc)[:300]}"

    def close(self) -> None:
        """Stops the other ranks (idempotent)."""
        self._finalizer()


def _spawn(
    config: EngineConfig, world_size: int, port: int, num_blocks: int, max_model_len: int
) -> list:
    context = mp.get_context("spawn")
    processes = []
    for rank in range(1, world_size):
        spec = WorkerSpec(
            rank,
            world_size,
            port,
            config,
            num_blocks,
            max_model_len,
            os.getpid(),
            COLLECTIVE_TIMEOUT_S,
            START_TIMEOUT_S,
            threads_per_rank(config),
        )
        process = context.Process(target=run_worker, args=(spec,), name=f"rank-{rank}", daemon=True)
        process.start()
        processes.append(process)
    return processes


def _wait_until_ready(store, processes: list) -> None:
    """Waits for each rank's "loaded" key, failing at once if one exits instead."""
    keys = [f"loaded/{rank}" for rank in range(1, len(processes) + 1)]
    deadline = time.monotonic() + START_TIMEOUT_S
    while not store.check(keys):
        for rank, process in enumerate(processes, start=1):
            if not process.is_alive():
                raise RuntimeError(
                    f"parallel engine rank {rank} exited with code {process.exitcode} "
                    "while starting (its error is in this process's stderr)"
                )
        if time.monotonic() > deadline:
            raise RuntimeError(f"parallel engine ranks not ready after {START_TIMEOUT_S:.0f} s")
        time.sleep(_READY_POLL_S)


def _stop(comm: Communicator, processes: list) -> None:
    if any(process.is_alive() for process in processes):
        # A rank already gone fails the send: the others end when their sockets close.
        with contextlib.suppress(RuntimeError):
            send(comm, Opcode.STOP, None)
    _terminate(processes, grace_s=5.0)


def _terminate(processes: list, grace_s: float = 0.0) -> None:
    for process in processes:
        process.join(grace_s)
        if process.is_alive():
            process.terminate()
            process.join(5.0)
        if process.is_alive():
            process.kill()
            process.join()
