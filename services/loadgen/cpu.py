"""How much CPU other processes took while we measured. This machine is shared (and has two
cores); a stranger's busy core can slow a two-thread engine many times over, so every figure
is printed with the load that was not ours."""

from __future__ import annotations

import os
import time
from collections.abc import Callable


def _machine_jiffies() -> tuple[int, int]:
    """(busy, total) clock ticks of all CPUs since boot."""
    with open("/proc/stat") as stat:
        fields = [int(value) for value in stat.readline().split()[1:]]
    idle = fields[3] + fields[4]  # idle + iowait
    return sum(fields) - idle, sum(fields)


def _process_jiffies(pid: int) -> int:
    """utime + stime of one process (all its threads), in the same ticks; 0 once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            text = stat.read()
    except OSError:
        return 0
    fields = text.rsplit(")", 1)[1].split()  # after "pid (comm)", which may hold spaces
    return int(fields[11]) + int(fields[12])  # fields 14 and 15 of proc(5)


class ForeignLoad:
    """`start()` ... `cores()`: the cores other processes kept busy in between, on average;
    `our_pids()` names ours (this process and the stack's), read at both ends."""

    def __init__(self, our_pids: Callable[[], list[int]]) -> None:
        self._our_pids = our_pids
        self._start: tuple[int, int, int] | None = None

    def _sample(self) -> tuple[int, int, int]:
        busy, total = _machine_jiffies()
        ours = sum(_process_jiffies(pid) for pid in self._our_pids())
        return busy, total, ours

    def start(self) -> None:
        self._start = self._sample()

    def cores(self) -> float:
        assert self._start is not None, "start() first"
        busy_0, total_0, ours_0 = self._start
        busy_1, total_1, ours_1 = self._sample()
        foreign = max((busy_1 - busy_0) - (ours_1 - ours_0), 0)
        return foreign / max(total_1 - total_0, 1) * (os.cpu_count() or 1)


def idle_foreign_load(interval_s: float = 1.0) -> float:
    """Cores busy over `interval_s` besides this process (while no stack of ours runs)."""
    monitor = ForeignLoad(lambda: [os.getpid()])
    monitor.start()
    time.sleep(interval_s)
    return monitor.cores()
