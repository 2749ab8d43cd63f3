"""Which prompts count as important in a step: those at the best priority a pod was sent lately.

A step is one forward pass and cannot be interrupted, so a prompt that arrives while a step of
512 other prompt tokens runs waits for it to end: on a CPU (SmolLM2-135M, one AVX2 core) that
step takes 1.8 s, longer than the prompt's own. When a pod is sent prompts of different
priorities (the gateway's admission control sends a tenant within its share at a better one
than a tenant over it), the scheduler keeps the steps that hold only less important prompts
short (SchedulerConfig.max_background_prefill_tokens), and a step that computes an important
prompt takes no less important prompt beside it. "Lately" is a window: once nothing at the
best priority has come for that long, the best seen within it takes over, and once nothing at
all has, every prompt is alike again and steps take the whole budget.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class RecentBestPriority:
    """The best (lowest) priority seen within the last `window_s` seconds, or None. Every
    priority seen in the window is kept with when it was last seen, so that when the best
    one expires the next best still counts (the gateway sends several: twice the client's
    priority, plus one unless favoured)."""

    window_s: float
    clock: Callable[[], float] = time.monotonic
    _last_seen: dict[int, float] = field(default_factory=dict, init=False)

    def note(self, priority: int) -> None:
        now = self.clock()
        self._forget_expired(now)
        self._last_seen[priority] = now

    def current(self) -> int | None:
        """The priority whose prompts are important now; None when none was seen lately."""
        self._forget_expired(self.clock())
        return min(self._last_seen, default=None)

    def _forget_expired(self, now: float) -> None:
        expired = [p for p, seen in self._last_seen.items() if now - seen > self.window_s]
        for priority in expired:
            del self._last_seen[priority]
