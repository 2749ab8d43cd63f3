"""Which prompts count as important in a step: those at the best priority a pod was sent lately.

A step is one forward pass and cannot be interrupted, so a prompt that arrives while a step of
512 other prompt tokens runs waits for it to end: on a CPU (SmolLM2-135M, one AVX2 core) that
step takes 1.8 s, longer than the prompt's own. When a pod is sent prompts of different
priorities (the gateway's admission control sends a tenant within its share at a better one
than a tenant over it), the scheduler keeps the steps that hold only less important prompts
short (SchedulerConfig.max_background_prefill_tokens), and a step that computes an important
prompt takes no less important prompt beside it. "Lately" is a window: once nothing at the
best priority has come for that long, every prompt is alike again and steps take the whole
budget.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class RecentBestPriority:
    """The best (lowest) priority seen within the last `window_s` seconds, or None."""

    window_s: float
    clock: Callable[[], float] = time.monotonic
    _best: int | None = field(default=None, init=False)
    _seen_at: float = field(default=float("-inf"), init=False)

    def note(self, priority: int) -> None:
        now = self.clock()
        if self._best is None or self._expired(now) or priority < self._best:
            self._best = priority
        if priority == self._best:
            self._seen_at = now

    def current(self) -> int | None:
        """The priority whose prompts are important now; None when none was seen lately."""
        if self._best is None or self._expired(self.clock()):
            return None
        return self._best

    def _expired(self, now: float) -> bool:
        return now - self._seen_at > self.window_s
