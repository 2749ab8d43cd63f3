"""This process's own counters: the limiter's store while Redis is away, or without one. The
same rules as the lease script (lease_script.py): every limit read, the first over refuses
(requests, then concurrent requests, then tokens) and nothing is charged, else all charged."""

from __future__ import annotations

from dataclasses import dataclass, field

from splitserve.gateway.auth.windows import Admission, Ask, admission, previous_weight, window_index

_MAX_WINDOWS = 4096  # past this many counters, those older than the previous minute go


@dataclass
class LocalCounters:
    windows: dict[tuple[str, str, int], int] = field(default_factory=dict)
    running: dict[str, dict[str, float]] = field(default_factory=dict)

    def admit(self, tenant: str, request_id: str, ask: Ask, now: float) -> Admission:
        index = window_index(now)
        weight = previous_weight(now)
        counts = (
            self.windows.get((tenant, "requests", index), 0),
            self.windows.get((tenant, "requests", index - 1), 0),
            self.windows.get((tenant, "tokens", index), 0),
            self.windows.get((tenant, "tokens", index - 1), 0),
        )
        running = self.running.setdefault(tenant, {})
        refused = None
        limit = ask.requests_per_minute
        if limit is not None and counts[0] + counts[1] * weight + 1 > limit:
            refused = "requests"
        elif ask.concurrent_requests is not None and len(running) >= ask.concurrent_requests:
            refused = "concurrent_requests"
        elif (limit := ask.tokens_per_minute) is not None and (
            counts[2] + counts[3] * weight + ask.num_tokens > limit
        ):
            refused = "tokens"
        num_running = len(running)  # before this request's slot
        if refused is None:
            self._charge(tenant, request_id, ask, index, now)
        return admission(ask, refused, counts, now, False, num_running)

    def _charge(self, tenant: str, request_id: str, ask: Ask, index: int, now: float) -> None:
        if ask.requests_per_minute is not None:
            key = (tenant, "requests", index)
            self.windows[key] = self.windows.get(key, 0) + 1
        if ask.tokens_per_minute is not None:
            key = (tenant, "tokens", index)
            self.windows[key] = self.windows.get(key, 0) + ask.num_tokens
        if ask.concurrent_requests is not None and ask.takes_slot:
            self.running[tenant][request_id] = now
        self._forget_before(index - 1)

    def leave(self, tenant: str, request_id: str) -> None:
        self.running.get(tenant, {}).pop(request_id, None)

    def _forget_before(self, index: int) -> None:
        if len(self.windows) > _MAX_WINDOWS:
            self.windows = {k: v for k, v in self.windows.items() if k[2] >= index}
