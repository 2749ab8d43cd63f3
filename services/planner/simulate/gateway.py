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

It scores from numbers rather than through `decide`'s views and term dicts (at 1,000 pods those
were a third of a simulation): `_best` computes `choose`'s score for each candidate with the
same float operations in the same order, so the choice is the same to the bit
(tests/test_planner_sim_gateway.py holds it to `decide`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from splitserve.common.pod_load import PodLoad
from splitserve.gateway.routing.scoring import (
    UNKNOWN_PLACE,
    RoutingWeights,
    load_term,
)
from splitserve.gateway.routing.shortlist import (
    LEAST_LOADED,
    MAX_SCORED_PODS,
    shortlist_positions,
)
from splitserve.loadgen.workload import SimRequest
from splitserve.planner.simulate.load_ranking import LoadRanking
from splitserve.planner.simulate.pod import SimPod

DEFAULT_WEIGHTS = RoutingWeights()  # what RoutingContext scores with here
# `score_terms`' proximity term for pods, clients and prefill pods in no region (rtt unknown):
# w.proximity * near_client + w.pair * near_prefill, without and with a chosen prefill pod.
NEAR_CLIENT = DEFAULT_WEIGHTS.proximity * (UNKNOWN_PLACE * 1.0) + DEFAULT_WEIGHTS.pair * 0.0
NEAR_CLIENT_AND_PREFILL = (
    DEFAULT_WEIGHTS.proximity * (UNKNOWN_PLACE * 1.0) + DEFAULT_WEIGHTS.pair * UNKNOWN_PLACE
)


@dataclass
class SimGateway:
    prefill_pods: list[SimPod]
    decode_pods: list[SimPod]
    # 0 = a fresh snapshot at every arrival (the exact view).
    poll_interval_s: float
    _snapshots: dict[str, PodLoad] = field(default_factory=dict)  # pod name -> last poll
    _num_dispatched: dict[str, int] = field(default_factory=dict)  # pod name -> since the poll
    # Each pool's load terms (from the snapshot and the dispatch count), in the pool's order:
    # the shortlist ranks every pod by them at each arrival, so they are kept up to date (at a
    # poll, and for the pod a dispatch changes) rather than computed there.
    _rankings: dict[str, LoadRanking] = field(default_factory=dict)  # pool -> its terms
    _positions: dict[str, tuple[str, int]] = field(default_factory=dict)  # pod -> (pool, index)
    _is_saturated: dict[str, bool] = field(default_factory=dict)  # pod name -> as scoring says

    def __post_init__(self) -> None:
        self._index_pools()

    def remove_decode_pod(self, pod: SimPod) -> None:
        """The registry drops a dead pod: no new arrivals go there."""
        self.decode_pods.remove(pod)
        self._index_pools()

    def poll(self) -> None:
        """Every pod's stats now; the dispatch counts restart, as the poll answers count them."""
        for pod in (*self.prefill_pods, *self.decode_pods):
            self._snapshots[pod.name] = pod.load
            self._num_dispatched[pod.name] = 0
        self._rank_pools()

    def _pools(self) -> tuple[tuple[str, list[SimPod]], ...]:
        return ("prefill", self.prefill_pods), ("decode", self.decode_pods)

    def _index_pools(self) -> None:
        for pool, pods in self._pools():
            for index, pod in enumerate(pods):
                self._positions[pod.name] = (pool, index)
            self._rankings[pool] = LoadRanking(len(pods))
        if self._snapshots:
            self._rank_pools()

    def _rank_pools(self) -> None:
        for pool, pods in self._pools():
            self._rankings[pool].set_all([self._refresh(pod.name) for pod in pods])

    def _update_load_term(self, name: str) -> None:
        pool, index = self._positions[name]
        self._rankings[pool].update(index, self._refresh(name))

    def pick(self, request: SimRequest) -> tuple[SimPod | None, SimPod]:
        """(prefill pod or None without prefill pods, decode pod) for one arrival, both counted
        as dispatched to: the real gateway counts its prefill pick even when the decode pod
        then prefills locally."""
        if self.poll_interval_s == 0 or not self._snapshots:
            self.poll()
        # P first, then D beside the chosen P (`decide`). No regions or nodes: every pod is as
        # near the client and each other, so the proximity terms are the same for every pod.
        prefill_pod = None
        if self.prefill_pods:
            prefill_pod = self._best("prefill", self.prefill_pods, request, NEAR_CLIENT)
        near = NEAR_CLIENT if prefill_pod is None else NEAR_CLIENT_AND_PREFILL
        decode_pod = self._best("decode", self.decode_pods, request, near)
        self._dispatch(decode_pod)
        if prefill_pod is not None:
            self._dispatch(prefill_pod)
        return prefill_pod, decode_pod

    def undo(self, prefill_pod: SimPod | None, decode_pod: SimPod) -> None:
        """A pick that admission refused: the real gateway refuses before it dispatches."""
        for pod in (decode_pod, prefill_pod):
            if pod is not None:
                self._num_dispatched[pod.name] -= 1
                self._update_load_term(pod.name)

    def _best(
        self, pool: str, pods: list[SimPod], request: SimRequest, proximity_term: float
    ) -> SimPod:
        """`scoring.choose` over the pods the real router would score (every pod's view, or
        its shortlist's): the unsaturated ones if any, highest rounded score, ties by name."""
        cached = None
        if request.prefix_group is not None:
            # The prefix index is written as pods compute blocks: close to exact, so no
            # staleness. No pod caches a prompt that shares no prefix.
            cached = [pod.num_cached_tokens(request) for pod in pods]
        terms = self._rankings[pool].terms
        positions: Iterable[int] = range(len(pods))
        if len(pods) > MAX_SCORED_PODS:
            least_loaded = self._rankings[pool].least_loaded(LEAST_LOADED)
            if cached is None:  # no pod holds the prompt: the least loaded alone
                return self._best_least_loaded(pods, least_loaded, terms, proximity_term)
            positions = shortlist_positions(cached, terms, least_loaded=least_loaded)
        num_prompt_tokens = max(request.input_len, 1)
        best_key: tuple[bool, float, str] | None = None
        best = pods[0]
        for i in positions:
            pod = pods[i]
            prefix = 0.0
            if cached is not None:
                prefix = DEFAULT_WEIGHTS.prefix * min(cached[i] / num_prompt_tokens, 1.0)
            # score_terms' sum: 0 + prefix_cache + load + proximity, rounded as `choose` does.
            score = round(prefix + terms[i] + proximity_term, 6)
            key = (self._is_saturated[pod.name], -score, pod.name)
            if best_key is None or key < best_key:
                best_key, best = key, pod
        return best

    def _best_least_loaded(
        self, pods: list[SimPod], ranked: list[int], terms: list[float], proximity_term: float
    ) -> SimPod:
        """`_best` over the least loaded pods when no prefix term adds to their scores: they
        come highest term first, so the scores only fall along `ranked`, and the search stops
        past the first unsaturated pod's score (ties by name)."""
        saturated = self._is_saturated
        best: SimPod | None = None  # the best unsaturated pod so far
        # The best saturated one: chosen only if every pod is saturated.
        best_saturated: SimPod | None = None
        best_score = best_saturated_score = 0.0
        last_term = float("nan")  # equals no term: the first pod's score is rounded
        score: float
        for i in ranked:
            if terms[i] != last_term:  # idle pods tie: one rounding serves a run of them
                last_term = terms[i]
                score = round(0.0 + last_term + proximity_term, 6)
            pod = pods[i]
            if not saturated[pod.name]:
                if _outranks(pod, score, best, best_score):
                    best, best_score = pod, score
            elif best is None and _outranks(pod, score, best_saturated, best_saturated_score):
                best_saturated, best_saturated_score = pod, score
            if best is not None and score < best_score:
                break  # every later pod scores lower than the unsaturated best
        chosen = best if best is not None else best_saturated
        if chosen is None:
            raise ValueError("no pods to choose from")
        return chosen

    def _refresh(self, name: str) -> float:
        """The pod's load term (`scoring.load_term` of its view), with whether the view is
        saturated (`scoring.is_saturated`) noted beside it: both change only at a poll or a
        dispatch."""
        snapshot = self._snapshots[name]
        queued = snapshot.num_queued + self._num_dispatched[name]
        kv_usage = snapshot.kv_usage
        weights = DEFAULT_WEIGHTS
        self._is_saturated[name] = (
            queued >= weights.max_queue or kv_usage >= weights.saturation_kv_usage
        )
        return load_term(queued, kv_usage, weights)

    def _dispatch(self, pod: SimPod) -> None:
        self._num_dispatched[pod.name] += 1
        self._update_load_term(pod.name)


def _outranks(pod: SimPod, score: float, best: SimPod | None, best_score: float) -> bool:
    """`choose`'s order within one saturation class: the higher score, then the earlier name."""
    return best is None or score > best_score or (score == best_score and pod.name < best.name)
