"""The admission controller's count of asks and finishes (issue 35): its finish rate, and
overload judged on the asks that had time to finish, so that the first seconds of traffic
below saturation are not taken for an overload."""

from __future__ import annotations

import pytest

from splitserve.gateway.admission.load_window import (
    MAX_LAG_SECONDS,
    OVERLOAD_DEMAND,
    OVERLOAD_EXCESS,
    WINDOW_SECONDS,
    LoadWindow,
)


def _replay(window: LoadWindow, asks: list[float], service_s: list[float], until: float) -> None:
    """Notes every ask and every finish up to `until`, in time order."""
    events = [(at, 1, at) for at in asks if at <= until]
    events += [(at + s, 0, at) for at, s in zip(asks, service_s) if at + s <= until]
    for time, is_ask, asked_at in sorted(events):
        if is_ask:
            window.note_ask(time)
        else:
            window.note_finish(time, asked_at)


def _counted_without_lag(asks: list[float], service_s: list[float], now: float) -> bool:
    """Every ask in the window against the finishes in it: the rule before the lag."""
    asked = sum(1 for at in asks if now - WINDOW_SECONDS <= at <= now)
    finished = sum(1 for at, s in zip(asks, service_s) if now - WINDOW_SECONDS <= at + s <= now)
    return asked > OVERLOAD_DEMAND * finished and asked - finished >= OVERLOAD_EXCESS


def test_the_first_seconds_of_a_burst_the_pool_keeps_up_with_are_not_overload():
    """Eleven asks 0.5 s apart, each served in 3 s: all that had 3 s have finished. Every ask
    counted against the finishes, the eleventh looks like overload (11 asked, 5 finished)."""
    asks = [0.5 * i for i in range(11)]
    service_s = [3.0] * len(asks)
    window = LoadWindow()
    _replay(window, asks, service_s, until=asks[-1])
    assert _counted_without_lag(asks, service_s, asks[-1])
    assert window.lag_s() == 3.0
    assert not window.is_overloaded(asks[-1])


def test_asks_at_twice_what_the_pool_finishes_are_overload():
    """Four asks a second; the pool finishes two, so each waits longer than the last."""
    asks = [0.25 * i for i in range(81)]
    service_s = [3.0 + 0.5 * i - at for i, at in enumerate(asks)]
    window = LoadWindow()
    _replay(window, asks, service_s, until=asks[-1])
    assert window.completion_rate(asks[-1]) == pytest.approx(2.0, rel=0.1)
    assert window.is_overloaded(asks[-1])


def test_a_flood_before_anything_finished_is_overload():
    window = LoadWindow()
    for i in range(OVERLOAD_EXCESS):
        window.note_ask(0.1 * i)
    assert window.lag_s() == 0.0
    assert window.is_overloaded(0.1 * OVERLOAD_EXCESS)
    calm = LoadWindow()
    for i in range(OVERLOAD_EXCESS - 1):
        calm.note_ask(0.1 * i)
    assert not calm.is_overloaded(0.1 * OVERLOAD_EXCESS)


def test_the_finish_rate_needs_a_few_finishes_in_the_window():
    window = LoadWindow()
    window.note_finish(1.0, asked_at=0.0)
    window.note_finish(2.0, asked_at=0.0)
    assert window.completion_rate(2.0) == 0.0
    window.note_finish(3.0, asked_at=0.0)
    assert window.completion_rate(3.0) == 3 / 2.0
    assert window.completion_rate(3.0 + WINDOW_SECONDS + 1.0) == 0.0  # all out of the window


def test_the_lag_is_capped_and_old_asks_are_not_kept():
    window = LoadWindow()
    window.note_finish(200.0, asked_at=0.0)  # a request that took 200 s
    assert window.lag_s() == MAX_LAG_SECONDS
    rate = 10
    for i in range(1000 * rate):
        window.note_ask(i / rate)
    kept = window._asks_between(0.0, 1000.0)
    assert kept <= (WINDOW_SECONDS + MAX_LAG_SECONDS) * rate + 1
    assert len(window._asked_at) <= 2 * kept + 1  # compacted, not only skipped


def test_the_lag_is_how_soon_requests_finish_not_how_long_the_queued_ones_took():
    """In an overload the service times grow with the queue: a lag at their middle would hold
    back the very asks that show it."""
    window = LoadWindow()
    for i, service_s in enumerate([3.0] * 4 + [20.0] * 16):
        window.note_finish(100.0 + i, asked_at=100.0 + i - service_s)
    assert window.lag_s() == 3.0
