"""Which pods a pick scores, once a pool is too large to score every pod.

Scoring a pod builds its view (load, location, cache) and its terms: about 8 us of Python, so
18 ms of every routing decision at 1,000 pods (benchmarks/scale). Past `MAX_SCORED_PODS` the
router scores a shortlist drawn from cheap signals instead, each list small and bounded:

- the pods holding the longest cached prefixes of the prompt (the prefix index names only pods
  holding some, so this costs the holders, not the pool);
- the least loaded pods by the score's own load term (requests queued or running, this
  gateway's own dispatches included, and KV in use), which win when nobody holds the prompt;
- the least loaded pods in the client's region, which scoring keeps to when it has any;
- the pod a `prompt_cache_key` sent earlier requests to (credited in `cached`).

A pod outside all of them could still have won only by a margin in the terms not ranked here
(proximity within a region, round-trip time) over every listed pod. Ranking by the queue alone
left out the idle pods with the most KV free that scoring prefers among equal queues: the
planner's simulation at 200 pods put TTFT p99 15% higher than scoring every pod.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable

from splitserve.gateway.routing.load_ranking import LoadRanking
from splitserve.gateway.routing.pods import Pod
from splitserve.gateway.routing.scoring import RoutingWeights

# Up to this many pods, every one is scored as before.
MAX_SCORED_PODS = 48
MOST_CACHED = 16
LEAST_LOADED = 16
LEAST_LOADED_IN_REGION = 8


def shortlist(
    pods: list[Pod],
    cached: dict[str, int],
    weights: RoutingWeights,
    region: str = "",
    ranking: LoadRanking | None = None,
) -> list[Pod]:
    """`pods` when there are at most MAX_SCORED_PODS, else the union of the lists above (in
    `pods`' order, each pod once). `ranking`: the pool's, caught up with `weights`, when
    `pods` are all its available pods (nothing filtered out): the lists then come from it
    without a pass over every pod."""
    if len(pods) <= MAX_SCORED_PODS:
        return pods
    if ranking is not None:
        return _ranked_shortlist(ranking, cached, region)
    tokens = [cached.get(p.pod_id, 0) for p in pods] if cached else [0] * len(pods)
    loads = [p.load_term(weights) for p in pods]
    local = [p.location.region == region for p in pods] if region else None
    return [pods[i] for i in shortlist_positions(tokens, loads, local)]


def _ranked_shortlist(ranking: LoadRanking, cached: dict[str, int], region: str) -> list[Pod]:
    chosen = set(ranking.most_cached(cached, MOST_CACHED))
    chosen.update(ranking.least_loaded(LEAST_LOADED))
    if region:
        chosen.update(ranking.least_loaded(LEAST_LOADED_IN_REGION, region))
    return ranking.pods_at(sorted(chosen))


def shortlist_positions(
    cached_tokens: list[int] | None,
    load_terms: list[float],
    is_local: list[bool] | None = None,
    least_loaded: list[int] | None = None,
) -> list[int]:
    """The shortlist as positions among n pods (ascending), from each pod's cached tokens of
    the prompt (None: no pod holds any), its load term (`scoring.load_term`: higher is less
    loaded) and whether it is in the client's region (None: no region).
    The planner's simulated gateway (services/planner/simulate/gateway.py) shortlists the same
    way from its own view of the pods, passing `least_loaded`: the LEAST_LOADED positions of
    highest load term, which it keeps ranked as terms change. Ties go to the earlier pod."""
    count = len(load_terms)
    if count <= MAX_SCORED_PODS:
        return list(range(count))
    held: list[int] = []
    if cached_tokens is not None:
        held = [i for i in range(count) if cached_tokens[i] > 0]
        if len(held) > MOST_CACHED:  # from the ascending list: ties to the earlier pod
            held = heapq.nlargest(MOST_CACHED, held, key=cached_tokens.__getitem__)
    chosen = set(held)
    if least_loaded is None:
        least_loaded = _least_loaded(LEAST_LOADED, range(count), load_terms)
    chosen.update(least_loaded)
    if is_local is not None:
        local = [i for i in range(count) if is_local[i]]
        chosen.update(_least_loaded(LEAST_LOADED_IN_REGION, local, load_terms))
    return sorted(chosen)


def _least_loaded(count: int, positions: Iterable[int], load_terms: list[float]) -> list[int]:
    """The `count` positions of highest load term (ties: the one met first)."""
    return heapq.nlargest(count, positions, key=load_terms.__getitem__)
