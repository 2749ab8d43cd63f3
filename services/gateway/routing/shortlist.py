"""Which pods a pick scores, once a pool is too large to score every pod.

Scoring a pod builds its view (load, location, cache) and its terms: about 8 us of Python, so
18 ms of every routing decision at 1,000 pods (benchmarks/scale). Past `MAX_SCORED_PODS` the
router scores a shortlist drawn from cheap signals instead, each list small and bounded:

- the pods holding the longest cached prefixes of the prompt (the prefix index names only pods
  holding some, so this costs the holders, not the pool);
- the least loaded pods (fewest requests queued or running, this gateway's own dispatches
  included), which win on load when nobody holds the prompt;
- the least loaded pods in the client's region, which scoring keeps to when it has any;
- the pod a `prompt_cache_key` sent earlier requests to (credited in `cached`).

A pod outside all of them could still have won only by a margin in the terms not ranked here
(KV headroom, proximity within a region, round-trip time) over every listed pod; the listed
least-loaded pods bound how much load such a pod can carry.
"""

from __future__ import annotations

import heapq

from splitserve.gateway.routing.pods import Pod

# Up to this many pods, every one is scored as before.
MAX_SCORED_PODS = 48
MOST_CACHED = 16
LEAST_LOADED = 16
LEAST_LOADED_IN_REGION = 8


def shortlist(pods: list[Pod], cached: dict[str, int], region: str = "") -> list[Pod]:
    """`pods` when there are at most MAX_SCORED_PODS, else the union of the lists above (in
    `pods`' order, each pod once)."""
    if len(pods) <= MAX_SCORED_PODS:
        return pods
    chosen: set[int] = set()
    holders = [p for p in pods if cached.get(p.pod_id, 0) > 0] if cached else []
    if len(holders) > MOST_CACHED:
        holders = heapq.nlargest(MOST_CACHED, holders, key=lambda p: cached[p.pod_id])
    chosen.update(id(p) for p in holders)
    queued = [pod.num_queued for pod in pods]
    chosen.update(id(pods[i]) for i in _least(LEAST_LOADED, range(len(pods)), queued))
    if region:
        local = [i for i, pod in enumerate(pods) if pod.location.region == region]
        chosen.update(id(pods[i]) for i in _least(LEAST_LOADED_IN_REGION, local, queued))
    return [p for p in pods if id(p) in chosen]


def _least(count: int, indices, queued: list[int]) -> list[int]:
    """The `count` indices of least `queued` (ties: the earlier pod)."""
    return heapq.nsmallest(count, indices, key=queued.__getitem__)
