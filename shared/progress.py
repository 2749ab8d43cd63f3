"""Progress reporting for long loads: a callback type, and a one-line console bar for the CLI.

Loaders take `progress: ProgressFn | None` and call it as `progress(done, total, what)` after each
unit of work (a tensor), so the engine stays free of any terminal handling and a service can log
or ignore the same calls.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TextIO

# progress(done, total, what): `done` of `total` units finished, `what` names the last one.
ProgressFn = Callable[[int, int, str], None]


class ConsoleProgress:
    """Draws `label [#####.....]  45%  123/272  2.1s` on one line of stderr.

    A call redraws the line in place with a carriage return, but only when the shown percentage
    changed (a log file gets ~100 redraws, not one per tensor); the call that reports
    `done == total` ends the line with a newline, so later output starts on a fresh line.
    Elapsed time counts from construction (the CLI builds it right before loading, so the time
    spent reading file metadata before the first tensor is included), then from the first call
    after a finished bar.
    """

    def __init__(
        self,
        label: str = "loading",
        stream: TextIO | None = None,
        width: int = 30,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if width < 1:
            raise ValueError(f"width must be >= 1, got {width}")
        self.label = label
        self.stream = stream if stream is not None else sys.stderr
        self.width = width
        self._clock = clock
        self._start: float | None = clock()
        self._drawn_percent: int | None = None
        # Longest line drawn so far: a shorter redraw pads to it so no stale characters remain.
        self._drawn_len = 0

    def __call__(self, done: int, total: int, what: str = "") -> None:
        if self._start is None:
            self._start = self._clock()
        is_last = total <= 0 or done >= total
        percent = _percent(done, total)
        if percent == self._drawn_percent and not is_last:
            return
        self._drawn_percent = percent
        line = self.format_line(done, total, self._clock() - self._start)
        self.stream.write("\r" + line.ljust(self._drawn_len))
        self._drawn_len = max(self._drawn_len, len(line))
        if is_last:
            self.stream.write("\n")
            self._start, self._drawn_percent, self._drawn_len = None, None, 0
        self.stream.flush()

    def format_line(self, done: int, total: int, elapsed_s: float) -> str:
        percent = _percent(done, total)
        filled = percent * self.width // 100
        bar = "#" * filled + "." * (self.width - filled)
        return f"{self.label} [{bar}] {percent:3d}%  {done}/{total}  {elapsed_s:.1f}s"


def _percent(done: int, total: int) -> int:
    # Rounded down, so 100% shows only when everything is done.
    return 100 if total <= 0 else min(max(done * 100 // total, 0), 100)
