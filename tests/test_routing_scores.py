"""Routing scores (services/gateway/routing/scoring.py) with exact expectations: proximity tiers and
the latency matrix, the round-trip refinement, load imbalance, cached prefixes, spill-over out
of a saturated client region, and the P-D pair preference."""

from __future__ import annotations

import pytest

from splitserve.common.pod_load import PodLoad
from splitserve.gateway.routing.scoring import (
    LatencyMatrix,
    Location,
    PodView,
    RoutingContext,
    RoutingWeights,
    choose,
    decide,
    proximity,
    rtt_factor,
    score_terms,
)

EAST_A = Location("us-east", "us-east-a", "node-1")
EAST_A2 = Location("us-east", "us-east-a", "node-2")
EAST_B = Location("us-east", "us-east-b", "node-3")
WEST = Location("us-west", "us-west-a", "node-4")
MATRIX = LatencyMatrix({"us-east": {"us-west": 60.0}})


def pod(pod_id, location=EAST_A, queued=0, kv=0.0, cached=0, rtt=None) -> PodView:
    # kv: the fraction of 100 blocks in use
    load = PodLoad(num_waiting=queued, kv_blocks_total=100, kv_blocks_free=round(100 * (1 - kv)))
    return PodView(pod_id, f"{pod_id}:1", location, load, cached_tokens=cached, rtt_ms=rtt)


def ctx(**overrides) -> RoutingContext:
    values = {"num_prompt_tokens": 100, "client": Location("us-east", "us-east-a")}
    return RoutingContext(**{**values, **overrides})


def test_proximity_tiers_and_latency_matrix():
    assert proximity(EAST_A, EAST_A, MATRIX) == 1.0  # same node
    assert proximity(EAST_A, EAST_A2, MATRIX) == 0.8  # same zone
    assert proximity(EAST_A, EAST_B, MATRIX) == 0.6  # same region
    assert proximity(EAST_A, WEST, MATRIX) == pytest.approx(0.4 * 100 / 160)  # 60 ms apart
    assert proximity(WEST, EAST_A, MATRIX) == pytest.approx(0.25)  # symmetric
    assert proximity(EAST_A, Location("eu"), MATRIX) == pytest.approx(0.2)  # unlisted: 100 ms
    assert proximity(Location(), EAST_A, MATRIX) == 0.5  # unknown region
    assert rtt_factor(None) == 1.0
    assert rtt_factor(20.0) == 0.5


def test_score_terms_add_up_as_documented():
    weights = RoutingWeights(prefix=4, load=1, kv=0.5, proximity=0.5, pair=0.5)
    terms = score_terms(pod("p", EAST_B, queued=3, kv=0.5, cached=50, rtt=20), ctx(weights=weights))
    assert terms == pytest.approx(
        {"prefix_cache": 2.0, "load": 0.25 + 0.25, "proximity": 0.5 * 0.6 * 0.5}
    )


def test_the_pod_holding_the_prefix_wins_over_a_lighter_one():
    holder = pod("a", queued=2, cached=96)
    idle = pod("b", queued=0)
    choice = choose([holder, idle], ctx())
    assert choice.pod is holder
    assert choice.reason == "prefix_cache"
    # a: 4 * 0.96 + 1/3 + 0.5 + 0.5 * 0.8 ; b: 0 + 1 + 0.5 + 0.5 * 0.8 (client has no node)
    assert choice.scores == {"a": pytest.approx(3.84 + 1 / 3 + 0.9), "b": pytest.approx(1.9)}


def test_load_imbalance_sends_work_to_the_lighter_pod():
    busy, light = pod("a", queued=5, kv=0.8), pod("b", queued=1, kv=0.2)
    choice = choose([busy, light], ctx())
    assert choice.pod is light
    assert choice.reason == "load"
    assert choice.scores["b"] - choice.scores["a"] == pytest.approx(1 / 2 - 1 / 6 + 0.5 * 0.6)


def test_least_load_ignores_cache_and_place():
    holder = pod("a", queued=1, cached=100)
    far_idle = pod("b", WEST, queued=0)
    choice = choose([holder, far_idle], ctx(policy="least_load"))
    assert choice.pod is far_idle
    assert choice.reason == "load"


def test_proximity_decides_between_equal_pods():
    near, far = pod("near", EAST_A), pod("far", EAST_B)
    choice = choose([far, near], ctx(latency=MATRIX))
    assert choice.pod is near
    assert choice.reason == "proximity"


def test_measured_round_trip_refines_proximity():
    slow, fast = pod("slow", EAST_A2, rtt=20.0), pod("fast", EAST_A2, rtt=0.0)
    assert choose([slow, fast], ctx()).pod is fast


def test_client_region_is_preferred_then_spills_over_when_saturated():
    weights = RoutingWeights(max_queue=4)
    west_client = ctx(client=Location("us-west"), weights=weights, latency=MATRIX)
    east_idle = pod("east", EAST_A, cached=100)
    west_busy = pod("west", WEST, queued=3)
    # The client's region wins even against a cached prefix elsewhere, while it has room.
    assert choose([east_idle, west_busy], west_client).pod is west_busy
    saturated = pod("west", WEST, queued=4)
    choice = choose([east_idle, saturated], west_client)
    assert choice.pod is east_idle
    assert choice.reason == "spill_over"
    kv_full = pod("west", WEST, kv=0.95)
    assert choose([east_idle, kv_full], west_client).reason == "spill_over"
    # A region with no pods at all is no spill-over: proximity simply ranks the others.
    assert choose([east_idle], ctx(client=Location("eu"))).reason == "only_candidate"


def test_every_pod_saturated_still_routes_to_the_best():
    weights = RoutingWeights(max_queue=2)
    a, b = pod("a", queued=5), pod("b", queued=2)
    assert choose([a, b], ctx(weights=weights)).pod is b


def test_decode_pod_near_the_prefill_pod_is_preferred():
    prefill = [pod("p", EAST_A)]
    decode = [pod("d-far", WEST), pod("d-near", EAST_A2)]
    decision = decide(prefill, decode, ctx(client=Location(), latency=MATRIX))
    assert decision.prefill_pod_id == "p"
    assert decision.decode_pod_id == "d-near"
    assert decision.decode_address == "d-near:1"
    assert decision.reason == "only_candidate"  # P's reason
    # d-near: load 1.5 + 0.5 * 0.5 (client unknown) + 0.5 * 0.8 (same zone as P)
    assert decision.scores["d-near"] == pytest.approx(1.5 + 0.25 + 0.4)
    assert decision.scores["d-far"] == pytest.approx(1.5 + 0.25 + 0.5 * 0.25)


def test_decide_without_prefill_pods_and_round_robin():
    decode = [pod("d1", cached=32), pod("d0")]
    decision = decide([], decode, ctx())
    assert (decision.prefill_pod_id, decision.prefill_address) == (None, None)
    assert decision.decode_pod_id == "d1"
    assert decision.cached_prefix_tokens == 32
    turns = [decide([], decode, ctx(policy="round_robin", round_robin_turn=t)) for t in range(3)]
    assert [d.decode_pod_id for d in turns] == ["d0", "d1", "d0"]
    assert {d.reason for d in turns} == {"round_robin"}


def test_redis_down_is_the_reason_while_the_index_is_unavailable():
    choice = choose([pod("a"), pod("b", queued=1)], ctx(is_index_available=False))
    assert choice.pod.pod_id == "a"
    assert choice.reason == "redis_down"


def test_bad_weights_and_latency_files_are_value_errors():
    with pytest.raises(ValueError, match="weight prefix"):
        RoutingWeights(prefix=-1)
    with pytest.raises(ValueError, match="max_queue"):
        RoutingWeights(max_queue=0)
    with pytest.raises(ValueError, match="not JSON"):
        LatencyMatrix.from_json("{")
    with pytest.raises(ValueError, match="numbers"):
        LatencyMatrix.from_json('{"a": {"b": "x"}}')
    assert LatencyMatrix.from_json('{"a": {"b": 30}}').between("b", "a") == 30.0
