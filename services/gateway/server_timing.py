"""Where a request's time went before its response started: the gateway's own, or the pods'.

A client's time to first byte is the gateway's work (reading the body, the key and the tenant's
limits, tokenizing, routing, waiting on the event loop, formatting the output) plus the pods'
(prefill, the KV hand-over, the first decode step). From outside the two cannot be told
apart, and on a shared machine the pods' part swings by more than the gateway's whole share
(docs/benchmarks.md, issue 34). So each HTTP request carries a `RequestClock`:

- `arrived`: the outermost middleware saw the request;
- `pods_called`: the first sequence's call to its pod was started (`Generation`);
- `first_output`: the pods' first response in hand (the stream's reader, before any queue or
  the event loop's turn to the handler);
- `last_heard`: the latest a pod was heard from: a response, or a call's end (a refusal, an
  error, a stall's timeout), so a request the pods failed is not charged to the gateway.

At the response's start the gateway's time is what elapsed since `arrived` less the pods'
interval: up to the first output for a stream (its headers go out once that is in hand; the
first chunk is formatted and sent after them), up to the last heard for anything else.
`--server-timing` sends both in a `Server-Timing` header (W3C Server Timing:
`gateway;dur=0.41, pods;dur=50.2`, milliseconds), which browsers' and clients' tools show; the
gateway's part is always observed in a histogram. What a pod's answer waits in the gateway's
gRPC queue before the reader takes it is counted as the pods': a busy gateway's event loop
lengthens that part too, so the gateway's figure is a lower bound on what it adds.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
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
    last_heard: float | None = None

    def note_pods_called(self) -> None:
        if self.pods_called is None:  # a resend or a migration is still the pods' time
            self.pods_called = time.monotonic()

    def note_output(self, now: float) -> None:
        if self.first_output is None:
            self.first_output = now
        self.note_heard(now)

    def note_heard(self, now: float) -> None:
        """A pod answered or its call ended at `now`."""
        if self.last_heard is None or now > self.last_heard:
            self.last_heard = now


@dataclass(frozen=True)
class TimeSplit:
    """Seconds from arrival to the response's start: the gateway's and the pods'."""

    gateway_s: float
    pods_s: float

    def header_value(self) -> bytes:
        return f"gateway;dur={self.gateway_s * 1e3:.3f}, pods;dur={self.pods_s * 1e3:.3f}".encode()


def parse_header(value: str) -> dict[str, float]:
    """A Server-Timing value's durations by name (`header_value`'s reader, for clients):
    "gateway;dur=0.41, pods;dur=50.2" -> {"gateway": 0.41, "pods": 50.2}."""
    durations = {}
    for metric in value.split(","):
        name, _, duration = metric.strip().partition(";dur=")
        if duration:
            durations[name] = float(duration)
    return durations


@contextmanager
def request_clock() -> Iterator[RequestClock]:
    """A fresh clock, current in this block (and in the tasks started in it): a request's."""
    clock = RequestClock(arrived=time.monotonic())
    token = _current.set(clock)
    try:
        yield clock
    finally:
        _current.reset(token)


def current_clock() -> RequestClock | None:
    return _current.get()


def split_at_start(clock: RequestClock, is_stream: bool, now: float) -> TimeSplit:
    """The split when the response starts at `now` (`is_stream`: it starts once the first
    output is in hand, so the pods' interval ends there; else, or when no output came, at the
    last time a pod was heard from)."""
    answered = clock.last_heard
    if is_stream and clock.first_output is not None:
        answered = clock.first_output
    pods_s = 0.0
    if clock.pods_called is not None and answered is not None:
        pods_s = max(0.0, answered - clock.pods_called)
    return TimeSplit(gateway_s=max(0.0, now - clock.arrived - pods_s), pods_s=pods_s)


def is_event_stream(headers: list[tuple[bytes, bytes]]) -> bool:
    return any(
        name == b"content-type" and value.startswith(_STREAM_TYPE) for name, value in headers
    )
