"""The planner's simulator against closed-form cases, and its behaviour as pods are added."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from splitserve.loadgen.stats import Slo
from splitserve.loadgen.workload import (
    LengthDistribution,
    SimRequest,
    WorkloadSpec,
    load_trace,
    poisson_requests,
    write_trace,
)
from splitserve.planner.profile import synthetic_profile
from splitserve.planner.simulate.cluster import ClusterConfig, Simulation, simulate

LOOSE = Slo(ttft_s=1e9, itl_s=1e9)


def _poisson(rate: float, n: int, inputs: str, outputs: str, seed: int = 0) -> list[SimRequest]:
    spec = WorkloadSpec(
        rate,
        n,
        LengthDistribution.parse(inputs, "inputs"),
        LengthDistribution.parse(outputs, "outputs"),
    )
    return poisson_requests(spec, seed)


@pytest.mark.parametrize(
    "cluster",
    [ClusterConfig(1, 1, local_prefill_threshold=0), ClusterConfig(0, 1)],
    ids=["prefill-pod", "colocated"],
)
def test_one_prefill_server_at_fixed_service_time_is_md1(cluster: ClusterConfig) -> None:
    # Prompts of 64 tokens under a 64-token budget: one prompt per step, each taking exactly
    # `service` seconds; one output token, so the first token ends the request. An M/D/1
    # queue: mean wait = rho * service / (2 (1 - rho)) (Pollaczek-Khinchine).
    service, rate = 0.1, 7.0
    profile = synthetic_profile(service, max_num_batched_tokens=64)
    rho = rate * service
    expected = service + rho * service / (2 * (1 - rho))
    means = []
    for seed in (1, 2):
        requests = _poisson(rate, 25_000, "64", "1", seed)
        result = simulate(profile, cluster, requests, LOOSE)
        assert result.num_finished == len(requests)
        means.append(result.ttft.mean)
    assert sum(means) / len(means) == pytest.approx(expected, rel=0.03)


def test_decode_at_a_fixed_batch_matches_the_step_time() -> None:
    # 8 requests at once: one prefill step holds all 8 prompts, then every step decodes the
    # whole batch of 8 until all have their 20 tokens.
    prefill_s, step_s, per_seq_s = 0.05, 0.01, 0.002
    profile = synthetic_profile(prefill_s, decode_step_s=step_s, decode_per_seq_s=per_seq_s)
    requests = [SimRequest(i, 0.0, 16, 20) for i in range(8)]
    result = simulate(profile, ClusterConfig(0, 1), requests, LOOSE)
    itl = step_s + 8 * per_seq_s
    assert result.ttft.p50 == pytest.approx(prefill_s)
    assert result.ttft.p99 == pytest.approx(prefill_s)
    assert result.itl.p50 == pytest.approx(itl)
    assert result.itl.p99 == pytest.approx(itl)
    finish = prefill_s + 19 * itl
    assert result.duration_s == pytest.approx(finish)
    assert result.output_throughput == pytest.approx(8 * 20 / finish)


def test_kv_transfer_time_adds_to_ttft() -> None:
    profile = synthetic_profile(
        0.2, kv_bytes_per_token=1000, transfer_bandwidth=1e6, transfer_latency_s=0.01
    )
    requests = [SimRequest(0, 0.0, 100, 1)]
    result = simulate(profile, ClusterConfig(1, 1, local_prefill_threshold=0), requests, LOOSE)
    assert result.ttft.p50 == pytest.approx(0.2 + 0.01 + 100 * 1000 / 1e6)


def test_short_prompts_prefill_on_the_decode_pod() -> None:
    # Below the local-prefill threshold no KV travels, so the transfer latency never shows.
    profile = synthetic_profile(0.2, transfer_latency_s=0.5)
    short = [SimRequest(0, 0.0, 20, 1)]
    result = simulate(profile, ClusterConfig(1, 1, local_prefill_threshold=32), short, LOOSE)
    assert result.ttft.p50 == pytest.approx(0.2)
    long = [SimRequest(0, 0.0, 40, 1)]
    result = simulate(profile, ClusterConfig(1, 1, local_prefill_threshold=32), long, LOOSE)
    assert result.ttft.p50 == pytest.approx(0.7)


def test_a_busy_prefill_pod_leaves_further_prompts_to_the_decode_pod() -> None:
    # Four 100-token prompts at once; pages take 0.5 s to travel (no per-byte cost). With room
    # for one prompt in flight at the prefill pod, the first goes there and the other three
    # are prefilled on the decode pod (no transfer); without a limit all four travel.
    profile = synthetic_profile(0.2, transfer_latency_s=0.5, max_num_batched_tokens=512)
    burst = [SimRequest(i, 0.0, 100, 1) for i in range(4)]
    limited = ClusterConfig(1, 1, max_remote_prefill_tokens=100, gateway_poll_interval_s=0)
    result = simulate(profile, limited, burst, LOOSE)
    assert result.num_finished == 4
    assert result.transfer.mean * 4 == pytest.approx(0.5)  # one request's transfer
    assert result.transfer.p50 == 0.0
    unlimited = simulate(profile, replace(limited, max_remote_prefill_tokens=0), burst, LOOSE)
    assert unlimited.transfer.p50 == pytest.approx(0.5)
    # The slot frees when the pages land: a second burst, long after, sends one prompt again.
    later = [SimRequest(4 + i, 5.0, 100, 1) for i in range(4)]
    result = simulate(profile, limited, burst + later, LOOSE)
    assert result.transfer.mean * 8 == pytest.approx(2 * 0.5)


def test_the_decode_pods_running_streams_raise_the_remote_limit() -> None:
    """The same rule as the decode pod's (services/common/conditional_prefill.py): with one
    stream running there, a second prompt in flight is still sent (limit 2 x 100), a third is
    prefilled locally."""
    profile = synthetic_profile(0.2, transfer_latency_s=0.5, max_num_batched_tokens=512)
    running = [SimRequest(0, 0.0, 10, 400)]  # short: prefilled on the decode pod, then decodes
    burst = [SimRequest(1 + i, 1.0, 100, 1) for i in range(3)]
    limited = ClusterConfig(1, 1, max_remote_prefill_tokens=100, gateway_poll_interval_s=0)
    result = simulate(profile, limited, running + burst, LOOSE)
    assert result.num_finished == 4
    assert result.transfer.mean * 4 == pytest.approx(2 * 0.5)  # two of the three travelled


def test_a_small_kv_cache_preempts_and_still_finishes_everything() -> None:
    profile = synthetic_profile(0.05, decode_step_s=0.01)
    requests = [SimRequest(i, 0.0, 32, 60) for i in range(8)]  # 6 blocks each at the end
    roomy = simulate(profile, ClusterConfig(0, 1), requests, LOOSE)
    tight = simulate(profile, ClusterConfig(0, 1, num_kv_blocks=20), requests, LOOSE)
    assert roomy.num_preemptions == 0
    assert tight.num_preemptions > 0
    assert tight.num_finished == len(requests)
    assert tight.duration_s > roomy.duration_s


def test_prefix_hits_shorten_ttft() -> None:
    profile = synthetic_profile(0.01, prefill_per_token_s=0.002)
    base = _poisson(1.0, 200, "512", "4")
    shared = [
        SimRequest(r.request_id, r.arrival_s, r.input_len, r.output_len, "system", 448)
        for r in base
    ]
    cold = simulate(profile, ClusterConfig(1, 1), base, LOOSE)
    warm = simulate(profile, ClusterConfig(1, 1), shared, LOOSE)
    # 448 of 512 tokens come from the cache after the first request: about 7x less prefill.
    assert warm.ttft.p50 < cold.ttft.p50 / 3


def test_a_request_larger_than_a_pods_cache_is_refused() -> None:
    profile = synthetic_profile(0.1, num_kv_blocks=4)
    with pytest.raises(ValueError, match="more KV blocks"):
        simulate(profile, ClusterConfig(0, 1), [SimRequest(0, 0.0, 100, 4)], LOOSE)


@pytest.mark.parametrize("seed", range(4))
def test_more_pods_are_never_worse(seed: int) -> None:
    profile = synthetic_profile(
        0.02, prefill_per_token_s=0.0015, decode_step_s=0.02, decode_per_seq_s=0.004
    )
    requests = _poisson(3.0, 300, "64-512", "16-64", seed)
    slo = Slo(ttft_s=1.0, itl_s=0.06)

    def run(p: int, d: int):
        return simulate(profile, ClusterConfig(p, d), requests, slo)

    by_prefill = [run(p, 2) for p in (1, 2, 3)]
    by_decode = [run(2, d) for d in (1, 2, 3)]
    for fewer, more in zip(by_prefill, by_prefill[1:]):
        assert more.ttft.mean <= fewer.ttft.mean * 1.01
        assert more.goodput >= fewer.goodput * 0.99
    for fewer, more in zip(by_decode, by_decode[1:]):
        assert more.itl.mean <= fewer.itl.mean * 1.01
        # TTFT is the prefill pods' here, near the 1 s SLO: when each decode pod's step ends
        # (reservations wait for it) moves a few TTFTs across the bound either way.
        assert more.goodput >= fewer.goodput * 0.97
    # And the sweep is not flat: the first prefill pod and the first decode pod were short.
    assert by_prefill[0].ttft.mean > 1.5 * by_prefill[-1].ttft.mean
    assert by_decode[0].itl.mean > 1.2 * by_decode[-1].itl.mean


def test_trace_round_trip_and_bad_lines(tmp_path) -> None:
    requests = _poisson(2.0, 20, "10-50", "1-9")
    path = tmp_path / "trace.jsonl"
    write_trace(str(path), requests)
    loaded = load_trace(str(path))
    assert [(r.input_len, r.output_len) for r in loaded] == [
        (r.input_len, r.output_len) for r in requests
    ]
    assert [r.arrival_s for r in loaded] == pytest.approx([r.arrival_s for r in requests], abs=1e-6)
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"arrival_s": 0, "input_len": 5, "output_len": 1}) + "\n{oops\n")
    with pytest.raises(ValueError, match="line 2"):
        load_trace(str(bad))
    bad.write_text(json.dumps({"arrival_s": 0, "input_len": 0, "output_len": 1}) + "\n")
    with pytest.raises(ValueError, match="input_len"):
        load_trace(str(bad))
    bad.write_text(json.dumps({"arrival_s": 0, "output_len": 1}) + "\n")
    with pytest.raises(ValueError, match="missing 'input_len'"):
        load_trace(str(bad))


def test_bad_cluster_and_workload_values_name_the_parameter() -> None:
    with pytest.raises(ValueError, match="decode pods >= 1"):
        ClusterConfig(1, 0)
    with pytest.raises(ValueError, match="max_remote_prefill_tokens"):
        ClusterConfig(1, 1, max_remote_prefill_tokens=-1)
    with pytest.raises(ValueError, match="--input-lens"):
        LengthDistribution.parse("ten", "--input-lens")
    with pytest.raises(ValueError, match="rate"):
        WorkloadSpec(0, 10, LengthDistribution(1, 2), LengthDistribution(1, 2))


def test_serving_overheads_add_to_every_step_and_request() -> None:
    bare = synthetic_profile(0.05, decode_step_s=0.01)
    served = replace(bare, step_overhead_s=0.004, request_overhead_s=0.03)
    requests = [SimRequest(0, 0.0, 16, 5)]
    before = simulate(bare, ClusterConfig(0, 1), requests, LOOSE)
    after = simulate(served, ClusterConfig(0, 1), requests, LOOSE)
    assert after.itl.p50 == pytest.approx(before.itl.p50 + 0.004)
    assert after.ttft.p50 == pytest.approx(before.ttft.p50 + 0.004 + 0.03)


def test_the_gateway_routes_from_stats_polled_every_interval() -> None:
    # Two colocated pods; each request takes one 50 ms step and ends (one output token), long
    # before the next arrives. The snapshot polled at 0 s shows both pods idle until the poll
    # at 0.5 s, so the pick goes by the requests sent since: pod 0 (tie by name), then pod 1,
    # 0, 1; the request at 0.6 s sees the fresh poll (both idle, counts reset) and gets pod 0.
    # Seeing exact loads, every request finds both pods idle and takes pod 0.
    profile = synthetic_profile(0.05)
    arrivals = (0.0, 0.1, 0.2, 0.3, 0.6)
    requests = [SimRequest(i, t, 16, 1) for i, t in enumerate(arrivals)]
    polled = [f"decode-{pod}" for pod in (0, 1, 0, 1, 0)]
    for interval, expected in ((0.5, polled), (0.0, ["decode-0"] * len(requests))):
        sim = Simulation(profile, ClusterConfig(0, 2, gateway_poll_interval_s=interval))
        result = sim.run(requests, LOOSE)
        assert result.num_finished == len(requests)
        assert [sim.decode_pod_name(r.request_id) for r in requests] == expected
    with pytest.raises(ValueError, match="gateway_poll_interval_s"):
        ClusterConfig(0, 2, gateway_poll_interval_s=-1.0)


def _alone(speculation, output_len: int = 41):
    from splitserve.planner.simulate.speculation import SpeculationModel

    profile = synthetic_profile(0.05, decode_step_s=0.01, decode_per_seq_s=0.001)
    model = SpeculationModel(3, speculation) if speculation is not None else None
    cluster = ClusterConfig(0, 1, speculation=model)
    requests = [SimRequest(0, 0.0, 16, output_len)]
    return simulate(profile, cluster, requests, LOOSE)


def test_speculation_yields_accepted_drafts_at_the_verify_steps_cost() -> None:
    # Alone on its pod: a plain step is 11 ms; verifying 3 drafts is a 4-row step, 14 ms.
    plain = _alone(None)
    assert plain.itl.p50 == pytest.approx(0.011)
    # Every draft right: 4 tokens per 14 ms step, 40 tokens after the first in 10 steps.
    every = _alone(1.0)
    assert every.itl.p50 == pytest.approx(0.014 / 4)
    assert every.duration_s == pytest.approx(0.05 + 10 * 0.014)
    # Every draft wrong: one token per 14 ms step, slower than not speculating.
    none = _alone(0.0)
    assert none.itl.p50 == pytest.approx(0.014)


def test_speculation_mean_tokens_per_step_follow_the_acceptance_rate() -> None:
    from splitserve.planner.simulate.speculation import SpeculationModel

    model = SpeculationModel(3, 0.6)
    result = _alone(0.6, output_len=20_001)
    num_steps = (result.duration_s - 0.05) / 0.014
    tokens_per_step = 20_000 / num_steps
    assert tokens_per_step == pytest.approx(model.expected_tokens_per_row, rel=0.03)
    assert model.expected_tokens_per_row == pytest.approx(1 + 0.6 + 0.36 + 0.216)
    with pytest.raises(ValueError, match="acceptance_rate"):
        SpeculationModel(3, 1.5)


def _with_failure(failure, num_requests: int = 4):
    from splitserve.planner.simulate.failures import PodFailure  # noqa: F401  (the type under test)

    profile = synthetic_profile(0.05, prefill_per_token_s=0.001, decode_step_s=0.01)
    cluster = ClusterConfig(0, 2, gateway_poll_interval_s=0, failures=(failure,))
    requests = [SimRequest(i, 0.0, 64, 100) for i in range(num_requests)]
    simulation = Simulation(profile, cluster)
    return simulation, simulation.run(requests, LOOSE), profile


def test_a_dead_decode_pods_streams_move_and_pay_a_re_prefill() -> None:
    from splitserve.planner.simulate.failures import PodFailure

    simulation, result, profile = _with_failure(PodFailure(at_s=0.5, decode_pod=0))
    records = [flight.record for flight in simulation._flights.values()]
    moved = [r for r in records if r.num_moves]
    assert len(moved) == 2 and result.num_moved == 2  # the gateway spread 4 over 2 pods
    assert result.num_finished == 4  # nothing lost: every stream completes on decode-1
    assert all(simulation.decode_pod_name(r.request.request_id) == "decode-1" for r in records)
    # Each moved stream has one long gap: its prompt and delivered tokens prefilled again.
    delivered_before = 1 + int((0.5 - 0.05 - 0.064) / 0.01)  # ~ tokens by the failure
    re_prefill_s = profile.prefill_s(64 + delivered_before)
    for record in moved:
        assert max(record.itls_s) >= re_prefill_s * 0.9
    unmoved = [r for r in records if not r.num_moves]
    assert max(max(r.itls_s) for r in unmoved) < re_prefill_s * 3  # they only share steps
    # A wedged pod is noticed after the stall timeout: the gap grows by it.
    wedged, _, _ = _with_failure(PodFailure(at_s=0.5, decode_pod=0, detect_s=2.0))
    longest = max(max(flight.record.itls_s) for flight in wedged._flights.values())
    assert longest >= 2.0 + re_prefill_s * 0.9
    assert max(max(r.itls_s) for r in moved) < 2.0


def test_streams_past_the_replay_limit_end_instead_of_moving() -> None:
    from splitserve.planner.simulate.failures import PodFailure

    _, result, _ = _with_failure(PodFailure(at_s=0.5, decode_pod=0, max_replay_tokens=70))
    assert result.num_finished == 2  # the two on decode-0 had > 70 tokens to replay
    with pytest.raises(ValueError, match="decode pod past"):
        ClusterConfig(0, 1, failures=(PodFailure(1.0, decode_pod=1),))
    with pytest.raises(ValueError, match=">= 0 seconds"):
        PodFailure(-1.0, 0)


def test_an_arrival_at_the_instant_of_a_poll_or_a_pod_failure_is_handled_first() -> None:
    """Ties at one instant go by event id, and arrivals take theirs before any poll or failure
    the run queues (arrivals wait outside the heap, in their own queue, and keep that order):
    the arrival is routed on the view before the poll, and to the pod about to die."""
    from splitserve.planner.simulate.failures import PodFailure

    profile = synthetic_profile(0.05, prefill_per_token_s=0.001, decode_step_s=0.01)

    def second_pod(arrival_s: float) -> str:
        # Request 0 finishes long before 0.5 s; only a poll tells the gateway so.
        simulation = Simulation(profile, ClusterConfig(0, 2, gateway_poll_interval_s=0.5))
        simulation.run([SimRequest(0, 0.0, 16, 4), SimRequest(1, arrival_s, 16, 4)], LOOSE)
        assert simulation.decode_pod_name(0) == "decode-0"
        return simulation.decode_pod_name(1)

    assert second_pod(0.5) == "decode-1"  # before the poll: decode-0 still has what it sent
    assert second_pod(0.5 + 1e-9) == "decode-0"  # after it: both idle, the first pod

    def moves(failure_s: float) -> int:
        failure = PodFailure(at_s=failure_s, decode_pod=0)
        cluster = ClusterConfig(0, 2, gateway_poll_interval_s=0, failures=(failure,))
        simulation = Simulation(profile, cluster)
        result = simulation.run([SimRequest(0, 1.0, 16, 4)], LOOSE)
        assert result.num_finished == 1 and simulation.decode_pod_name(0) == "decode-1"
        return simulation._flights[0].record.num_moves

    assert moves(1.0) == 1  # routed to decode-0 as it dies, then moved
    assert moves(1.0 - 1e-9) == 0  # decode-0 left the gateway's view before


def _tiered_run(tier_sizes, disk_bytes_per_s: float = 1e8):
    from splitserve.planner.profile import TierLoadModel

    # 100 blocks (1600 tokens) per pod: two of twelve 512-token prefixes fit beside the
    # running requests; prefill costs 1 ms a token, so a prefix hit saves about 0.5 s.
    profile = replace(
        synthetic_profile(
            0.01, prefill_per_token_s=0.001, num_kv_blocks=100, kv_bytes_per_token=1000
        ),
        tier_loads=TierLoadModel(1e9, disk_bytes_per_s),
    )
    spec = WorkloadSpec(
        1.0,
        300,
        LengthDistribution(544, 560),
        LengthDistribution(4, 4),
        num_prefix_groups=12,
        prefix_len=512,
    )
    cluster = ClusterConfig(0, 1, tier_sizes=tier_sizes)
    return simulate(profile, cluster, poisson_requests(spec, 3), LOOSE)


def test_offload_tiers_turn_evicted_prefixes_into_loads() -> None:
    from splitserve.planner.simulate.prefix_cache import TierSizes

    off = _tiered_run(TierSizes())
    host = _tiered_run(TierSizes(host_blocks=1000))
    assert off.cached_tokens_by_tier.get("host", 0) == 0
    assert host.cached_tokens_by_tier["host"] > 10 * 512  # evicted prefixes come back
    assert host.ttft.mean < 0.7 * off.ttft.mean
    # The same hits from a disk that takes 5 s per prefix cost more than computing them.
    slow_disk = _tiered_run(TierSizes(disk_blocks=1000), disk_bytes_per_s=1e5)
    assert slow_disk.cached_tokens_by_tier["disk"] > 10 * 512
    assert slow_disk.ttft.mean > off.ttft.mean
    with pytest.raises(ValueError, match="tier loads"):
        simulate(
            synthetic_profile(0.01),
            ClusterConfig(0, 1, tier_sizes=TierSizes(host_blocks=10)),
            [SimRequest(0, 0.0, 16, 2)],
            LOOSE,
        )


def test_prefix_cache_pushes_least_recent_groups_down_the_tiers() -> None:
    from splitserve.planner.simulate.prefix_cache import SimPrefixCache, TierSizes

    cache = SimPrefixCache(TierSizes(host_blocks=10, disk_blocks=4))
    for group in "abcd":
        cache.add(group, 4)
    cache.count_hit("a", 64)  # a is now the most recent
    cache.fit(8)  # room for two groups on the device: b and c go down, in that order
    assert [cache.tier_of(g) for g in "abcd"] == ["device", "host", "host", "device"]
    # d then a go down; the host holds 10 blocks, so b then c (oldest first) go on to the
    # disk, which holds one group: b falls out of it.
    cache.fit(0)
    assert [cache.tier_of(g) for g in "abcd"] == ["host", None, "disk", "host"]
    assert cache.num_blocks == {"device": 0, "host": 8, "disk": 4}
    cache.add("e", 20)  # too big for the host and the disk tiers: when evicted it is gone
    cache.fit(0)
    assert cache.tier_of("e") is None
    cache.add("c", 4)  # loaded back: on the device, off the disk
    assert cache.tier_of("c") == "device" and cache.num_blocks["disk"] == 0
    assert cache.hit_tokens["device"] == 64


def test_pages_landing_mid_step_join_and_answer_at_the_steps_end() -> None:
    # A (16 tokens, under the local-prefill threshold) keeps the decode pod stepping every
    # 100 ms from t = 50 ms. B's pages land at t = 60 ms, mid-step: the engine thread takes
    # them, and B's first token goes out, only when that step ends at t = 150 ms.
    profile = synthetic_profile(0.05, decode_step_s=0.1)
    cluster = ClusterConfig(1, 1, local_prefill_threshold=32, gateway_poll_interval_s=0)
    requests = [SimRequest(0, 0.0, 16, 20), SimRequest(1, 0.01, 64, 2)]
    simulation = Simulation(profile, cluster)
    simulation.run(requests, LOOSE)
    records = {f.record.request.request_id: f.record for f in simulation._flights.values()}
    assert records[0].ttft_s == pytest.approx(0.05)
    assert records[1].ttft_s == pytest.approx(0.15 - 0.01)
    # Its second token comes with the next step of the batch it joined.
    assert records[1].itls_s == pytest.approx([0.1])


def test_pages_parked_on_a_pod_that_dies_mid_step_still_move() -> None:
    from splitserve.planner.simulate.failures import PodFailure

    # A and C keep both decode pods stepping every 100 ms from t = 50 ms; B's pages land on
    # decode-0 at t = 60 ms, mid-step, and wait for its end; decode-0 dies at t = 100 ms.
    profile = synthetic_profile(0.05, decode_step_s=0.1)
    failure = PodFailure(at_s=0.1, decode_pod=0)
    cluster = ClusterConfig(
        1, 2, local_prefill_threshold=32, gateway_poll_interval_s=0, failures=(failure,)
    )
    requests = [SimRequest(0, 0.0, 16, 20), SimRequest(1, 0.0, 16, 20), SimRequest(2, 0.01, 64, 2)]
    simulation = Simulation(profile, cluster)
    result = simulation.run(requests, LOOSE)
    assert result.num_finished == 3
    assert {simulation.decode_pod_name(i) for i in range(3)} == {"decode-1"}
    assert result.num_moved == 2  # the stream that had output, and the parked one
    assert set(result.utilization) == {"prefill", "decode"}
    assert len(simulation.decode_pods) == 2  # the dead pod still counts in the results


def test_a_reservation_on_a_busy_decode_pod_waits_for_its_step_end() -> None:
    # A keeps the decode pod stepping every 100 ms from t = 50 ms. B arrives at 60 ms: its
    # blocks are reserved at the step's end (150 ms), the prefill pod computes it by 200 ms,
    # and the pages, landing mid-step, join at 250 ms.
    profile = synthetic_profile(0.05, decode_step_s=0.1)
    cluster = ClusterConfig(1, 1, local_prefill_threshold=32, gateway_poll_interval_s=0)
    requests = [SimRequest(0, 0.0, 16, 20), SimRequest(1, 0.06, 64, 2)]
    simulation = Simulation(profile, cluster)
    simulation.run(requests, LOOSE)
    record = next(f.record for f in simulation._flights.values() if f.record.request.request_id)
    assert record.ttft_s == pytest.approx(0.25 - 0.06)


def test_serving_costs_per_prompt_token_add_to_ttft() -> None:
    from splitserve.planner.profile import ServingCosts

    costs = ServingCosts(request_s=0.02, token_s=0.001)
    profile = replace(synthetic_profile(0.1), serving={"disaggregated": costs})
    cluster = ClusterConfig(1, 1, local_prefill_threshold=0)
    requests = [SimRequest(0, 0.0, 100, 1), SimRequest(1, 100.0, 400, 1)]
    simulation = Simulation(profile, cluster)
    simulation.run(requests, LOOSE)
    ttfts = sorted(flight.record.ttft_s for flight in simulation._flights.values())
    # 0.1 s of prefill each, then 20 ms + 1 ms per prompt token.
    assert ttfts == pytest.approx([0.1 + 0.02 + 0.1, 0.1 + 0.02 + 0.4])


def test_a_measured_gap_spread_widens_the_simulated_itl_around_the_same_median() -> None:
    from splitserve.planner.profile import ServingCosts

    # One request alone at 20 ms a step: every bare gap is 20 ms. The stack's gaps spread
    # 4 ms below to 12 ms above (median 0): the simulated p50 stays, the p90 moves up, and
    # TTFT, which no token gap is part of, does not move.
    spread = (-0.004, -0.002, 0.0, 0.0, 0.0, 0.001, 0.002, 0.004, 0.008, 0.012)
    bare = synthetic_profile(0.05, decode_step_s=0.02)
    spread_out = replace(bare, serving={"colocated": ServingCosts(itl_spread_s=spread)})
    requests = [SimRequest(0, 0.0, 64, 400)]
    cluster = ClusterConfig(0, 1)
    plain = simulate(bare, cluster, requests, LOOSE)
    widened = simulate(spread_out, cluster, requests, LOOSE)
    assert plain.itl.p90 == pytest.approx(0.02) and plain.itl.p50 == pytest.approx(0.02)
    assert widened.itl.p50 == pytest.approx(0.02, abs=0.0011)
    assert widened.itl.p90 == pytest.approx(0.02 + 0.008, abs=0.0041)
    assert widened.ttft.p50 == pytest.approx(plain.ttft.p50)
    assert simulate(spread_out, cluster, requests, LOOSE) == widened  # seeded: reproducible


def test_pods_on_one_machine_slow_each_others_steps_by_the_neighbor_slowdowns() -> None:
    from splitserve.planner.profile import NeighborSlowdown

    # Two colocated pods, one request each, decoding side by side at 20 ms a step alone. On
    # one machine with decodes 50% slower beside decodes, each step that starts while the
    # other pod's runs takes 30 ms; on separate machines (or with no slowdowns measured)
    # nothing changes.
    base = synthetic_profile(0.01, decode_step_s=0.02)
    slowed = replace(base, neighbor=NeighborSlowdown(decode_beside_decode=0.5))
    requests = [SimRequest(0, 0.0, 16, 200), SimRequest(1, 0.0, 16, 200)]

    def mean_itls(profile, pods_per_host):
        cluster = ClusterConfig(0, 2, gateway_poll_interval_s=0, pods_per_host=pods_per_host)
        simulation = Simulation(profile, cluster)
        simulation.run(requests, LOOSE)
        assert {f.decode_pod.name for f in simulation._flights.values()} == {
            "decode-0",
            "decode-1",
        }
        return [f.record.mean_itl_s for f in simulation._flights.values()]

    assert mean_itls(slowed, 1) == pytest.approx([0.02, 0.02])
    assert mean_itls(base, 2) == pytest.approx([0.02, 0.02])
    shared = mean_itls(slowed, 2)
    assert all(0.028 <= itl <= 0.0301 for itl in shared)
    with pytest.raises(ValueError, match="pods_per_host"):
        ClusterConfig(0, 2, pods_per_host=0)


def test_a_step_with_a_prompt_chunk_is_a_prefill_step() -> None:
    from splitserve.planner.simulate.pod import ScheduledStep, SimSeq

    decoding = SimSeq(SimRequest(0, 0.0, 16, 8), num_tokens=17, num_computed=16)
    prefilling = SimSeq(SimRequest(1, 0.0, 64, 8), num_tokens=64, num_computed=0)
    assert ScheduledStep([(decoding, 1)], 0.02).kind == "decode"
    assert ScheduledStep([(decoding, 1), (prefilling, 64)], 0.1).kind == "prefill"


def test_a_simulated_pod_caps_prompt_tokens_beside_decodes_as_the_engine_does() -> None:
    from splitserve.planner.simulate.pod import SimPod, SimSeq

    profile = synthetic_profile(0.01)
    cluster = ClusterConfig(0, 1, max_num_batched_tokens=64, max_prefill_tokens_while_decoding=8)
    pod = SimPod("decode-0", cluster.limits(profile), profile)
    first = SimSeq(SimRequest(0, 0.0, 16, 8), num_tokens=16)
    pod.add(first)
    assert [n for _, n in pod.schedule().chunks] == [16]  # nothing decodes: the whole budget
    first.num_computed = 16
    first.num_tokens = 17  # its first token sampled: it decodes from now on
    for i in (1, 2):
        pod.add(SimSeq(SimRequest(i, 0.0, 40, 8), num_tokens=40))
    step = pod.schedule()
    assert [(seq.request.request_id, n) for seq, n in step.chunks] == [(0, 1), (1, 8)]
    with pytest.raises(ValueError, match="max_prefill_tokens_while_decoding"):
        ClusterConfig(0, 1, max_prefill_tokens_while_decoding=0)


def test_admission_refuses_what_would_miss_its_ttft_and_keeps_the_rest_on_time() -> None:
    # One colocated pod at 4 req/s of 64-512-token prompts at 1 ms a token: about twice what
    # it can prefill. Let everyone in and the queue grows without end, so nobody meets a 1 s
    # TTFT; refuse on arrival what the queue ahead would make late, and the admitted ones do.
    profile = synthetic_profile(0.05, prefill_per_token_s=1e-3, decode_step_s=0.02)
    requests = _poisson(4.0, 300, "64-512", "16-32")
    slo = Slo(ttft_s=1.0, itl_s=0.2)
    everyone = simulate(profile, ClusterConfig(0, 1), requests, slo)
    admitted = simulate(profile, ClusterConfig(0, 1, admission_ttft_s=1.0), requests, slo)
    assert everyone.num_refused == 0 and everyone.goodput < 0.1
    assert 0 < admitted.num_refused < len(requests)
    assert admitted.num_finished == len(requests) - admitted.num_refused
    assert admitted.goodput > 2.0
    # The prediction counts every queued prompt token: what it admits starts within the SLO
    # but for the decode step of the rows it joins.
    assert admitted.ttft.p90 <= 1.0 + 0.02 * 5
    # At a trickle, with room for a prompt queued ahead, nothing is refused: the same run.
    trickle = _poisson(0.2, 50, "64-512", "16-32")
    relaxed = simulate(profile, ClusterConfig(0, 1, admission_ttft_s=2.0), trickle, slo)
    plain = simulate(profile, ClusterConfig(0, 1), trickle, slo)
    assert relaxed.num_refused == 0 and relaxed.ttft == plain.ttft
    with pytest.raises(ValueError, match="admission_ttft_s must be > 0"):
        ClusterConfig(0, 1, admission_ttft_s=0.0)


def test_admission_predicts_an_idle_pods_ttft_from_the_profile() -> None:
    from splitserve.planner.simulate.admission import predicted_ttft_s
    from splitserve.planner.simulate.pod import PodLimits, SimPod, SimSeq

    profile = synthetic_profile(0.05, prefill_per_token_s=1e-3, decode_step_s=0.02)
    pod = SimPod("decode-0", PodLimits(512, 64, 1000, 16), profile)
    assert predicted_ttft_s(pod, pod, 100) == pytest.approx(0.05 + 0.1 + 0.02)
    # 1,100 tokens ahead in a 512-token budget: two full steps and one of 76 (+ 100 own).
    pod.add(SimSeq(SimRequest(0, 0.0, 1100, 8), num_tokens=1100))
    expected = 2 * (0.05 + 0.512) + (0.05 + 0.176) + 0.02
    assert predicted_ttft_s(pod, pod, 100) == pytest.approx(expected)


def _runs_and_steps(profile, cluster: ClusterConfig, requests: list[SimRequest]):
    """The same simulation with decode runs (decode_runs.py) and with every step an event."""
    outcomes = []
    for decode_runs in (True, False):
        simulation = Simulation(profile, replace(cluster, decode_runs=decode_runs))
        result = simulation.run(requests, LOOSE)
        records = sorted((f.record for f in simulation._flights.values()),
                         key=lambda r: r.request.request_id)  # fmt: skip
        outcomes.append((simulation, result, records))
    return outcomes


def _spread_profile(**kwargs):
    from splitserve.planner.profile import ServingCosts

    spread = (-0.002, 0.0, 0.0, 0.001, 0.004)
    costs = ServingCosts(itl_spread_s=spread)
    return replace(synthetic_profile(0.02, **kwargs),
                   serving={"colocated": costs, "disaggregated": costs})  # fmt: skip


def _shared_prefix_requests(rate: float, n: int, seed: int) -> list[SimRequest]:
    spec = WorkloadSpec(rate, n, LengthDistribution(300, 700), LengthDistribution(5, 90),
                        num_prefix_groups=6, prefix_len=256)  # fmt: skip
    return poisson_requests(spec, seed)


@pytest.mark.parametrize(
    ("cluster", "kv_blocks", "event_share"),
    [
        (ClusterConfig(2, 5), 4096, 0.5),
        (ClusterConfig(0, 3), 4096, 0.5),  # colocated: arrivals land on pods mid-run
        # A small cache: runs cut short by blocks, preemptions, evicted prefixes.
        (ClusterConfig(0, 2), 120, 1.0),
        (ClusterConfig(1, 4, gateway_poll_interval_s=0), 4096, 0.5),  # exact loads per arrival
        (ClusterConfig(1, 3, admission_ttft_s=0.4), 4096, 0.5),
    ],
    ids=["disaggregated", "colocated", "small-cache", "exact-polls", "admission"],
)
def test_decode_runs_change_nothing_a_step_by_step_simulation_gives(
    cluster, kv_blocks, event_share
) -> None:
    """Every request's first token, token gaps (their measured spread drawn too) and end,
    and every pod's busy time and blocks, exactly as when each step is an event of its own,
    in fewer events (under `event_share` of them)."""
    profile = _spread_profile(prefill_per_token_s=0.0004, decode_step_s=0.01,
                              num_kv_blocks=kv_blocks)  # fmt: skip
    requests = _shared_prefix_requests(6.0, 150, seed=5)
    (runs, run_result, run_records), (steps, step_result, step_records) = _runs_and_steps(
        profile, cluster, requests)  # fmt: skip

    assert [(r.ttft_s, r.itls_s, r.finish_s, r.is_dropped, r.is_refused) for r in run_records] \
        == [(r.ttft_s, r.itls_s, r.finish_s, r.is_dropped, r.is_refused) for r in step_records]
    assert run_result.num_finished == step_result.num_finished > 0
    for run_pod, step_pod in zip(runs.decode_pods, steps.decode_pods, strict=True):
        assert run_pod.busy_s == pytest.approx(step_pod.busy_s, rel=1e-9)
        assert (run_pod.min_free_blocks, run_pod.num_preemptions) == (
            step_pod.min_free_blocks, step_pod.num_preemptions)  # fmt: skip
    assert runs.num_events < steps.num_events * event_share


def test_rows_one_token_short_of_their_prompt_do_not_run_ahead_of_their_first_token() -> None:
    """A cached prefix covering all but the last prompt token leaves a row that counts as
    decoding before its first token (its TTFT, and the prefix it caches): it must not join a
    run. 257-token prompts over 256-token shared prefixes, colocated."""
    profile = _spread_profile(prefill_per_token_s=0.0004, decode_step_s=0.01)
    spec = WorkloadSpec(4.0, 60, LengthDistribution(257, 257), LengthDistribution(10, 40),
                        num_prefix_groups=2, prefix_len=256)  # fmt: skip
    (runs, _, run_records), (_, _, step_records) = _runs_and_steps(
        profile, ClusterConfig(0, 2), poisson_requests(spec, 1))  # fmt: skip
    assert all(r.ttft_s is not None for r in run_records)
    assert [(r.ttft_s, r.itls_s, r.finish_s) for r in run_records] == [
        (r.ttft_s, r.itls_s, r.finish_s) for r in step_records
    ]


def test_decode_runs_with_offload_tiers_change_nothing() -> None:
    """Prefixes evicted to the host tier and loaded back while pods run ahead: the loads
    change a pod's cache, which ends its run first."""
    from splitserve.planner.profile import TierLoadModel
    from splitserve.planner.simulate.prefix_cache import TierSizes

    profile = replace(_spread_profile(prefill_per_token_s=0.0004, decode_step_s=0.01,
                                      num_kv_blocks=160, kv_bytes_per_token=1000),
                      tier_loads=TierLoadModel(1e9, 1e8))  # fmt: skip
    cluster = ClusterConfig(0, 2, tier_sizes=TierSizes(host_blocks=400))
    requests = _shared_prefix_requests(5.0, 120, seed=9)
    (runs, _, run_records), (_, _, step_records) = _runs_and_steps(profile, cluster, requests)
    assert [(r.ttft_s, r.itls_s, r.finish_s) for r in run_records] == [
        (r.ttft_s, r.itls_s, r.finish_s) for r in step_records
    ]
    assert sum(pod.cache.hit_tokens["host"] for pod in runs.decode_pods) > 0


def test_a_decode_pod_that_dies_mid_run_gives_the_tokens_of_its_steps_until_then() -> None:
    from splitserve.planner.simulate.failures import PodFailure

    profile = _spread_profile(prefill_per_token_s=0.0004, decode_step_s=0.01)
    cluster = ClusterConfig(1, 3, failures=(PodFailure(at_s=4.0, decode_pod=1),))
    requests = _shared_prefix_requests(4.0, 60, seed=8)
    (runs, _, run_records), (steps, _, step_records) = _runs_and_steps(profile, cluster, requests)
    assert [(r.ttft_s, r.itls_s, r.finish_s, r.num_moves) for r in run_records] == [
        (r.ttft_s, r.itls_s, r.finish_s, r.num_moves) for r in step_records
    ]
    assert sum(r.num_moves for r in run_records) > 0  # streams were mid-run on the dead pod


def test_decode_step_costs_are_the_profiles_steps_remembered_per_run_start() -> None:
    """A run's following steps are the profile's decode steps a token longer each; a shorter
    run from the same start takes the head of the remembered one; the tables start afresh
    past their bound, with the same answers."""
    from splitserve.planner.simulate.decode_runs import MAX_RUN_STEPS, DecodeStepCosts

    profile = synthetic_profile(0.02)
    costs = DecodeStepCosts(max_remembered=2 * (MAX_RUN_STEPS - 1))  # two run starts
    expected = tuple(profile.step_s([], 3, 300 + 3 * step) for step in range(1, MAX_RUN_STEPS))
    assert costs.following_steps_s(profile, 3, 300, MAX_RUN_STEPS - 1) == expected
    assert costs.following_steps_s(profile, 3, 300, 5) == expected[:5]
    for context_sum in (10, 20, 30):  # past the bound of two run starts
        costs.following_steps_s(profile, 1, context_sum, 4)
    assert costs.following_steps_s(profile, 3, 300, 7) == expected[:7]
    assert len(costs._runs[id(profile)]) <= 2
    with pytest.raises(ValueError, match="at most 63 following steps"):
        costs.following_steps_s(profile, 3, 300, MAX_RUN_STEPS)
