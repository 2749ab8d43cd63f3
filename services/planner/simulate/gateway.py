"""The simulated gateway: it routes from the same information the real one has.

The real gateway (services/gateway/routing/pods.py) polls each pod's stats every
`POLL_INTERVAL_SECONDS` and, between polls, adds the requests it dispatched since; it never sees
a pod's exact load at an arrival. Routing on exact loads would send long prompts to a pod that is
already prefilling less often than the real gateway does (its ITL tail would come out too low),
so this keeps a per-pod snapshot, refreshed by the simulation's POLL events, plus dispatch counts,
and scores them with the real policy (services/gateway/routing/scoring.py `decide`, cache_aware:
prefix, then 1 / (1 + queued) and KV headroom, ties by pod name). Past the real router's
MAX_SCORED_PODS it scores the same shortlist (services/gateway/routing/shortlist.py): the
best-cached and least-loaded pods.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from splitserve.common.pod_load import PodLoad
from splitserve.gateway.routing.scoring import (
    Location,
    PodView,
    RoutingContext,
    RoutingWeights,
    decide,
    load_term,
)
from splitserve.gateway.routing.shortlist import MAX_SCORED_PODS, shortlist_positions
from splitserve.loadgen.workload import SimRequest
from splitserve.planner.simulate.pod import SimPod

DEFAULT_WEIGHTS = RoutingWeights()  # what RoutingContext scores with here


@dataclass
class SimGateway:
    prefill_pods: list[SimPod]
    decode_pods: list[SimPod]
    # 0 = a fresh snapshot at every arrival (the exact view).
    poll_interval_s: float
    _snapshots: dict[str, PodLoad] = field(default_factory=dict)  # pod name -> last poll
    _num_dispatched: dict[str, int] = field(default_factory=dict)  # pod name -> since the poll
    # Pod name -> its load term from the snapshot and the dispatch count: the shortlist ranks
    # every pod by it at each arrival, so it is kept up to date rather than computed there.
    _load_terms: dict[str, float] = field(default_factory=dict)

    def poll(self) -> None:
        """Every pod's stats now; the dispatch counts restart, as the poll answers count them."""
        for pod in (*self.prefill_pods, *self.decode_pods):
            self._snapshots[pod.name] = pod.load
            self._num_dispatched[pod.name] = 0
            self._load_terms[pod.name] = self._load_term(pod.name)

    def pick(self, request: SimRequest) -> tuple[SimPod | None, SimPod]:
        """(prefill pod or None without prefill pods, decode pod) for one arrival, both counted
        as dispatched to: the real gateway counts its prefill pick even when the decode pod
        then prefills locally."""
        if self.poll_interval_s == 0 or not self._snapshots:
            self.poll()
        # No regions or nodes: every pod is equally near the client and each other.
        ctx = RoutingContext(num_prompt_tokens=request.input_len, client=Location())
        decision = decide(
            self._views(self.prefill_pods, request), self._views(self.decode_pods, request), ctx
        )
        decode_pod = self._dispatch(self.decode_pods, decision.decode_pod_id)
        prefill_pod = None
        if decision.prefill_pod_id is not None:
            prefill_pod = self._dispatch(self.prefill_pods, decision.prefill_pod_id)
        return prefill_pod, decode_pod

    def undo(self, prefill_pod: SimPod | None, decode_pod: SimPod) -> None:
        """A pick that admission refused: the real gateway refuses before it dispatches."""
        for pod in (decode_pod, prefill_pod):
            if pod is not None:
                self._num_dispatched[pod.name] -= 1
                self._load_terms[pod.name] = self._load_term(pod.name)

    def _views(self, pods: list[SimPod], request: SimRequest) -> list[PodView]:
        """The views the real router would score: every pod's, or its shortlist's."""
        # The prefix index is written as pods compute blocks: close to exact, so no staleness.
        if request.prefix_group is None:
            cached = [0] * len(pods)  # no pod caches a prompt that shares no prefix
        else:
            cached = [pod.num_cached_tokens(request) for pod in pods]
        if len(pods) <= MAX_SCORED_PODS:
            return [self._view(pod, tokens) for pod, tokens in zip(pods, cached)]
        loads = [self._load_terms[pod.name] for pod in pods]
        return [self._view(pods[i], cached[i]) for i in shortlist_positions(cached, loads)]

    def _load_term(self, name: str) -> float:
        snapshot = self._snapshots[name]
        queued = snapshot.num_queued + self._num_dispatched[name]
        return load_term(queued, snapshot.kv_usage, DEFAULT_WEIGHTS)

    def _view(self, pod: SimPod, cached_tokens: int) -> PodView:
        load, num_dispatched = self._snapshots[pod.name], self._num_dispatched[pod.name]
        return PodView(pod.name, pod.name, Location(), load, num_dispatched, cached_tokens)

    def _dispatch(self, pods: list[SimPod], name: str) -> SimPod:
        self._num_dispatched[name] += 1
        self._load_terms[name] = self._load_term(name)
        return next(pod for pod in pods if pod.name == name)
