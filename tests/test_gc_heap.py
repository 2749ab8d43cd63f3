"""The services freeze their startup heap: what startup keeps is left out of every later full
collection, and what startup threw away is collected first, not frozen. Batch computations pause
the collector and give it back as they found it."""

from __future__ import annotations

import gc
import weakref

import pytest

from splitserve.engine.gc_heap import collector_paused, freeze_startup_heap


class _Node:
    def __init__(self) -> None:
        self.partner: _Node | None = None


@pytest.fixture
def unfrozen_after():
    yield
    gc.unfreeze()  # the rest of this worker's tests run with the collector as before


def test_what_startup_keeps_is_left_out_of_later_collections(unfrozen_after):
    kept = [_Node() for _ in range(100)]
    assert freeze_startup_heap() >= len(kept)
    tracked = {id(obj) for obj in gc.get_objects()}
    assert not any(id(node) in tracked for node in kept)
    made_after = _Node()
    assert any(obj is made_after for obj in gc.get_objects())


def test_startup_garbage_is_collected_before_the_freeze(unfrozen_after):
    first, second = _Node(), _Node()
    first.partner, second.partner = second, first  # a cycle: only a collection frees it
    alive = weakref.ref(first)
    del first, second
    freeze_startup_heap()
    assert alive() is None


def test_the_collector_is_paused_inside_and_runs_again_after() -> None:
    assert gc.isenabled()
    with collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()


def test_a_paused_collector_stays_off_after_when_it_was_off_before() -> None:
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_the_collector_runs_again_after_an_error_inside() -> None:
    with pytest.raises(RuntimeError), collector_paused():
        raise RuntimeError("boom")
    assert gc.isenabled()
