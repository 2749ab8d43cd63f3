"""The split of a request's wait into the gateway's time and the pods' (server_timing.py).
End to end, with a real gateway and pod: tests/test_gateway_http.py (with --server-timing) and
tests/test_gateway_auth.py (without it)."""

from __future__ import annotations

from splitserve.gateway.server_timing import (
    RequestClock,
    TimeSplit,
    current_clock,
    is_event_stream,
    request_clock,
    split_at_start,
)


def _clock_with_outputs() -> RequestClock:
    clock = RequestClock(arrived=10.0)
    clock.pods_called = 10.002
    for at in (10.052, 10.102, 10.152):
        clock.note_output(at)
    return clock


def test_a_stream_is_the_pods_until_its_first_output():
    split = split_at_start(_clock_with_outputs(), is_stream=True, now=10.053)
    assert abs(split.pods_s - 0.050) < 1e-9
    assert abs(split.gateway_s - 0.003) < 1e-9


def test_a_whole_response_is_the_pods_until_its_last_output():
    split = split_at_start(_clock_with_outputs(), is_stream=False, now=10.155)
    assert abs(split.pods_s - 0.150) < 1e-9
    assert abs(split.gateway_s - 0.005) < 1e-9


def test_a_request_answered_before_any_pod_is_all_gateway():
    clock = RequestClock(arrived=5.0)  # e.g. a 400 or a 429 from the gate
    split = split_at_start(clock, is_stream=False, now=5.004)
    assert split == TimeSplit(gateway_s=split.gateway_s, pods_s=0.0)
    assert abs(split.gateway_s - 0.004) < 1e-9


def test_a_call_that_ended_without_output_is_the_pods_time():
    # A pod that refused the prompt (or failed, or stalled) 80 ms after the call.
    clock = RequestClock(arrived=3.0)
    clock.pods_called = 3.001
    clock.note_heard(3.081)
    for is_stream in (True, False):
        split = split_at_start(clock, is_stream, now=3.083)
        assert abs(split.pods_s - 0.080) < 1e-9
        assert abs(split.gateway_s - 0.003) < 1e-9


def test_the_clock_is_the_requests_only_while_it_runs():
    assert current_clock() is None
    with request_clock() as clock:
        assert current_clock() is clock
    assert current_clock() is None


def test_a_resend_keeps_the_first_calls_start():
    clock = RequestClock(arrived=1.0)
    clock.note_pods_called()
    first = clock.pods_called
    clock.note_pods_called()
    assert clock.pods_called == first


def test_the_header_is_w3c_server_timing_in_milliseconds():
    value = TimeSplit(gateway_s=0.00041, pods_s=0.0502).header_value()
    assert value == b"gateway;dur=0.410, pods;dur=50.200"


def test_event_streams_are_told_by_their_content_type():
    assert is_event_stream([(b"content-type", b"text/event-stream; charset=utf-8")])
    assert not is_event_stream([(b"content-type", b"application/json")])
