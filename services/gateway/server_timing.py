"""Where a request's time went before its response started: the gateway's own, or the pods'.

A client's time to first byte is the gateway's work (reading the body, the key and the tenant's
limits, tokenizing, routing, waiting on the event loop, formatting the first chunk) plus the
pods' (prefill, the KV hand-over, the first decode step). From outside the two cannot be told
apart, and on a shared machine the pods' part swings by more than the gateway's whole share
(docs/benchmarks.md, issue 34). So each HTTP request carries a `RequestClock`:

- `arrived`: the outermost middleware saw the request;
- `pods_called`: the first sequence's call to its pod was started (`Generation`);
- `first_output` / `last_output`: the pods' first and latest response in hand (the stream's
  reader, before any queue or the event loop's turn to the handler).

At the response's start the gateway's time is what elapsed since `arrived` less the pods'
interval: up to the first output for a stream (its headers go out with the first chunk), up to
the last for a whole response. `--server-timing` sends both in a `Server-Timing` header
(W3C Server Timing: `gateway;dur=0.41, pods;dur=50.2`, milliseconds), which browsers' and
clients' tools show; the gateway's part is always observed in a histogram.
"""

from __future__ import annotations

import time
from contextvars import ContextVar
from dataclasses import dataclass

HEADER = b"server-timing"
_STREAM_TYPE = b"text/event-stream"

_current: ContextVar[RequestClock | None] = ContextVar("splitserve_request_clock", default=None)


@dataclass
class RequestClock:
    """time.monotonic() readings of one request (None: not reached)."""

    arrived: float
    pods_called: float | None = None
    first_output: float | None = None
    last_output: float | None = None

    def note_pods_called(self) -> None:
        if self.pods_called is None:  # a resend or a migration is still the pods' time
            self.pods_called = time.monotonic()

    def note_output(self, now: float) -> None:
        if self.first_output is None:
            self.first_output = now
        self.last_output = now


@dataclass(frozen=True)
class TimeSplit:
    """Seconds from arrival to the response's start: the gateway's and the pods'."""

    gateway_s: float
    pods_s: float

    def header_value(self) -> bytes:
        return f"gateway;dur={self.gateway_s * 1e3:.3f}, pods;dur={self.pods_s * 1e3:.3f}".encode()


def start_clock() -> RequestClock:
    """A fresh clock, current for the rest of this request's task (and the tasks it starts)."""
    clock = RequestClock(arrived=time.monotonic())
    _current.set(clock)
    return clock


def current_clock() -> RequestClock | None:
    return _current.get()


def split_at_start(clock: RequestClock, is_stream: bool, now: float) -> TimeSplit:
    """The split when the response starts at `now` (`is_stream`: it starts with the first
    chunk, so the pods' interval ends at the first output; else at the last)."""
    answered = clock.first_output if is_stream else clock.last_output
    pods_s = 0.0
    if clock.pods_called is not None and answered is not None:
        pods_s = max(0.0, answered - clock.pods_called)
    return TimeSplit(gateway_s=max(0.0, now - clock.arrived - pods_s), pods_s=pods_s)


def is_event_stream(headers: list[tuple[bytes, bytes]]) -> bool:
    return any(
        name == b"content-type" and value.startswith(_STREAM_TYPE) for name, value in headers
    )
