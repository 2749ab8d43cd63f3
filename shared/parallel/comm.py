"""The collectives the ranks of a parallel engine run: a gloo process group of their own on
loopback.

No `torch.distributed.init_process_group`: the group is a `ProcessGroupGloo` object held here,
so an engine leaves no global state behind and a process may hold several engines (tests,
a prefill and a decode engine side by side).

Every collective has the group's timeout, so a rank that hangs fails the others after it
rather than never; a rank that dies fails them at once (its sockets close). The exception
is waiting for the next step: rank 0 may be idle for hours, so that wait has no limit (a
dead rank 0 still ends it at once).
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Sequence
from typing import Protocol, cast

import torch
import torch.distributed as dist

_HOST = "127.0.0.1"
_IDLE_WAIT = datetime.timedelta(days=365)


class _GlooCollectives(Protocol):
    """The collectives of `dist.ProcessGroupGloo` used here, as its runtime signatures give
    them: torch's stubs (torch/_C/_distributed_c10d.pyi) declare none of them on the backend
    classes, only on `ProcessGroup`."""

    def allreduce(self, tensors: Sequence[torch.Tensor]) -> dist.Work: ...

    def allgather(
        self,
        output_tensors: Sequence[Sequence[torch.Tensor]],
        input_tensors: Sequence[torch.Tensor],
    ) -> dist.Work: ...

    def alltoall_base(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: dist.AllToAllOptions,
    ) -> dist.Work: ...

    def broadcast(
        self, tensor: torch.Tensor, root: int, timeout: datetime.timedelta | None = None
    ) -> dist.Work: ...

    def send(self, tensors: Sequence[torch.Tensor], dst_rank: int, tag: int) -> dist.Work: ...

    def recv(self, tensors: Sequence[torch.Tensor], src_rank: int, tag: int) -> dist.Work: ...

    def gather(
        self,
        output_tensors: Sequence[Sequence[torch.Tensor]],
        input_tensors: Sequence[torch.Tensor],
        opts: dist.GatherOptions,
    ) -> dist.Work: ...

    def scatter(
        self,
        output_tensors: Sequence[torch.Tensor],
        input_tensors: Sequence[Sequence[torch.Tensor]],
        opts: dist.ScatterOptions,
    ) -> dist.Work: ...


def make_store(world_size: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0's rendezvous store on a free loopback port (the OS picks it: no race)."""
    return dist.TCPStore(
        _HOST,
        0,
        world_size,
        is_master=True,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def connect_store(port: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    """A rank other than 0 joins rank 0's store at `port`."""
    return dist.TCPStore(
        _HOST, port, world_size, is_master=False, timeout=datetime.timedelta(seconds=timeout_s)
    )


class Communicator:
    """One rank's end of the group. `comm_seconds` sums the time spent in collectives (the
    communication share of a step, for benchmarks/parallel.py); `all_to_all_seconds` the part
    of it in expert parallelism's dispatch and combine (benchmarks/moe_parallel.py)."""

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world_size: int,
        timeout_s: float,
        parent: Communicator | None = None,
    ) -> None:
        # torch's stubs lack `_Options` and the constructor that takes it.
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        options._timeout = datetime.timedelta(seconds=timeout_s)
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=_HOST)]
        group = dist.ProcessGroupGloo(store, rank, world_size, options)
        self.group = cast(_GlooCollectives, group)
        self.store = store  # kept alive with the group
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        self.comm_seconds = 0.0
        self.all_to_all_seconds = 0.0
        # A subgroup's time counts in its parent's too: benchmarks read the pod group's.
        self._parent = parent

    def subgroup(self, name: str, rank: int, world_size: int) -> Communicator:
        """A group of some of this group's ranks (a pipeline stage's tensor-parallel ranks),
        over this group's store under its own prefix. Every member calls it with the same
        `name`; it returns once all have (gloo connects them to one another)."""
        store = dist.PrefixStore(f"{name}/", self.store)
        return Communicator(store, rank, world_size, self.timeout_s, parent=self)

    def all_reduce(self, tensor: torch.Tensor) -> None:
        """Sums `tensor` over the ranks, in place."""
        start = time.perf_counter()
        self.group.allreduce([tensor]).wait()
        self._spent(time.perf_counter() - start)

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Every rank's `tensor` (same shape everywhere) stacked in rank order: [world, ...]."""
        start = time.perf_counter()
        outputs = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self.group.allgather([outputs], [tensor]).wait()
        self._count_all_to_all(start)
        return torch.stack(outputs)

    def all_to_all(
        self, rows: torch.Tensor, send_counts: list[int], receive_counts: list[int]
    ) -> torch.Tensor:
        """Rank r sends rows[sum(send_counts[:d]) : ...][send_counts[d] rows] to rank d and gets
        receive_counts[s] rows from each rank s, concatenated in rank order. rows: [N, ...]."""
        start = time.perf_counter()
        out = rows.new_empty((sum(receive_counts), *rows.shape[1:]))
        rows = rows.contiguous()
        options = dist.AllToAllOptions()
        self.group.alltoall_base(out, rows, receive_counts, send_counts, options).wait()
        self._count_all_to_all(start)
        return out

    def _count_all_to_all(self, start: float) -> None:
        elapsed = time.perf_counter() - start
        self._spent(elapsed)
        self.all_to_all_seconds += elapsed

    def _spent(self, seconds: float) -> None:
        self.comm_seconds += seconds
        if self._parent is not None:
            self._parent._spent(seconds)

    def broadcast(self, tensor: torch.Tensor, idle: bool = False) -> None:
        """Rank 0's `tensor` into every rank's (in place). `idle`: a wait with no time limit."""
        start = time.perf_counter()
        if idle:
            self.group.broadcast(tensor, 0, _IDLE_WAIT).wait()
        else:
            self.group.broadcast(tensor, 0).wait()
        self._spent(time.perf_counter() - start)

    def send(self, tensor: torch.Tensor, dst: int) -> None:
        """Point to point (pipeline stages); `tensor` contiguous."""
        start = time.perf_counter()
        self.group.send([tensor], dst, 0).wait()
        self._spent(time.perf_counter() - start)

    def isend(self, tensor: torch.Tensor, dst: int) -> dist.Work:
        """Starts a send; the caller keeps `tensor` alive and waits for the returned work. It
        completes only once `dst` has posted the matching receive."""
        return self.group.send([tensor], dst, 0)

    def recv(self, tensor: torch.Tensor, src: int) -> None:
        """Into `tensor` (contiguous, the sent shape and dtype)."""
        start = time.perf_counter()
        self.group.recv([tensor], src, 0).wait()
        self._spent(time.perf_counter() - start)

    def gather_to_first(self, tensor: torch.Tensor) -> list[torch.Tensor] | None:
        """Every rank's `tensor` (same shape) on rank 0, in rank order; None elsewhere."""
        if self.rank == 0:
            outputs = [[torch.empty_like(tensor) for _ in range(self.world_size)]]
            self.group.gather(outputs, [tensor], dist.GatherOptions()).wait()
            return outputs[0]
        self.group.gather([], [tensor], dist.GatherOptions()).wait()
        return None

    def scatter_from_first(self, parts: list[torch.Tensor] | None, out: torch.Tensor) -> None:
        """Rank 0's `parts[r]` into rank r's `out`."""
        inputs: list[list[torch.Tensor]] = []
        if self.rank == 0:
            assert parts is not None, "rank 0 scatters its parts"
            inputs.append(parts)
        self.group.scatter([out], inputs, dist.ScatterOptions()).wait()
