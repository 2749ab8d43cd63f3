"""The simulated gateway scores pods from numbers (services/planner/simulate/gateway.py `_best`);
every pick it makes must be the one the real router's `decide` makes over the same views: the
shortlist drawn afresh with `heapq.nlargest` (not the gateway's kept ranking), the terms and
rounding of `score_terms`/`choose`, saturation, ties by name."""

from __future__ import annotations

import pytest

from splitserve.gateway.routing.scoring import (
    Location,
    PodView,
    RoutingContext,
    RoutingWeights,
    decide,
    load_term,
)
from splitserve.gateway.routing.shortlist import MAX_SCORED_PODS, shortlist_positions
from splitserve.loadgen.stats import Slo
from splitserve.loadgen.workload import (
    LengthDistribution,
    SimRequest,
    WorkloadSpec,
    poisson_requests,
)
from splitserve.planner.profile import synthetic_profile
from splitserve.planner.simulate.cluster import ClusterConfig, Simulation
from splitserve.planner.simulate.gateway import SimGateway
from splitserve.planner.simulate.pod import SimPod


def _views(gateway: SimGateway, pods: list[SimPod], request: SimRequest) -> list[PodView]:
    """What the real router would score: every pod's view, or its shortlist's."""
    views = [
        PodView(
            pod.name,
            pod.name,
            Location(),
            gateway._snapshots[pod.name],
            gateway._num_dispatched[pod.name],
            pod.num_cached_tokens(request),
        )
        for pod in pods
    ]
    if len(views) <= MAX_SCORED_PODS:
        return views
    cached = [view.cached_tokens for view in views]
    weights = RoutingWeights()
    loads = [load_term(view.num_queued, view.kv_usage, weights) for view in views]
    return [views[i] for i in shortlist_positions(cached, loads)]


def _run_checked(cluster: ClusterConfig, requests: list[SimRequest]) -> tuple[int, set[str]]:
    """Runs the simulation with every pick compared to `decide`; (picks, decode pods chosen)."""
    # A small cache, so that KV usage saturates pods too, not only their queues.
    profile = synthetic_profile(
        0.02,
        prefill_per_token_s=2e-4,
        decode_step_s=0.01,
        decode_per_seq_s=0.002,
        num_kv_blocks=400,
        max_num_batched_tokens=256,
    )
    simulation = Simulation(profile, cluster)
    gateway = simulation.gateway
    real_pick = gateway.pick
    chosen: set[str] = set()
    num_picks = 0

    def checked_pick(request: SimRequest) -> tuple[SimPod | None, SimPod]:
        nonlocal num_picks
        if gateway.poll_interval_s == 0 or not gateway._snapshots:
            gateway.poll()
        ctx = RoutingContext(num_prompt_tokens=request.input_len, client=Location())
        expected = decide(
            _views(gateway, gateway.prefill_pods, request),
            _views(gateway, gateway.decode_pods, request),
            ctx,
        )
        prefill_pod, decode_pod = real_pick(request)
        assert decode_pod.name == expected.decode_pod_id
        assert (prefill_pod.name if prefill_pod else None) == expected.prefill_pod_id
        chosen.add(decode_pod.name)
        num_picks += 1
        return prefill_pod, decode_pod

    gateway.pick = checked_pick  # type: ignore[method-assign]
    simulation.run(requests, Slo(ttft_s=1e9, itl_s=1e9))
    return num_picks, chosen


def _requests(rate: float, count: int, shared_prefixes: bool) -> list[SimRequest]:
    spec = WorkloadSpec(
        rate,
        count,
        LengthDistribution.parse("32-400", "inputs"),
        LengthDistribution.parse("4-40", "outputs"),
    )
    requests = poisson_requests(spec, seed=7)
    if not shared_prefixes:
        return requests
    # Four system prompts of 96 tokens shared by turns of every length: pods hold them.
    return [
        SimRequest(
            r.request_id,
            r.arrival_s,
            max(r.input_len, 97),
            r.output_len,
            prefix_group=f"system-{r.request_id % 4}",
            prefix_len=96,
        )
        for r in requests
    ]


@pytest.mark.parametrize("shared_prefixes", [False, True], ids=["no-prefix", "shared-prefixes"])
@pytest.mark.parametrize(
    "num_prefill,num_decode", [(0, 6), (3, 9), (30, 70)], ids=["colocated", "small", "shortlist"]
)
def test_every_pick_is_the_real_routers(
    num_prefill: int, num_decode: int, shared_prefixes: bool
) -> None:
    # Past saturation (rate well over what the pods serve) so that saturated pods, full
    # queues and stale polls all occur; ties between idle pods are broken by name.
    pods = num_prefill + num_decode
    requests = _requests(rate=20.0 * pods, count=600, shared_prefixes=shared_prefixes)
    cluster = ClusterConfig(num_prefill, num_decode, local_prefill_threshold=0)
    num_picks, chosen = _run_checked(cluster, requests)
    assert num_picks == len(requests)
    assert len(chosen) == num_decode  # the load spread over every decode pod
