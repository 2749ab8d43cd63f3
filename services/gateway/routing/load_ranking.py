"""A pool's available pods and their load terms, kept up to date as pods change instead of
read pod by pod at every pick.

At a thousand pods most of a pick was passes over every pod: which are available, each one's
load term for the shortlist, the least loaded of them (benchmarks/scale/pick_alone). Now a
`Pod` tells its pool's ranking of every change to a field those depend on (`Pod.__setattr__`:
RANKED_FIELDS), and the ranking re-reads only the pods that changed since it was last asked,
plus those whose cooldown ran out meanwhile. The least loaded are then found in a numpy
array: the k-th largest term, the positions above it and, of the ties, the earliest, so the
lists are the ones shortlist.py's pass over every pod makes.

Owned by its pool's event loop, as the pods are."""

from __future__ import annotations

import heapq
import math
import time
from typing import TYPE_CHECKING

import numpy as np

from splitserve.common.registry_schema import PodRecord
from splitserve.gateway.routing.scoring import RoutingWeights

if TYPE_CHECKING:
    from splitserve.gateway.routing.pods import Pod

_UNAVAILABLE = -math.inf  # the term of a pod not to rank
# The Pod fields whose changes its ranking is told of (availability, load term, region, id,
# and the record the router's index lookup reads).
RANKED_FIELDS = frozenset(
    {"stats", "num_dispatched", "is_serving_model", "unreachable_until", "record"}
)


class LoadRanking:
    """Follows one pool's `pods` list: `catch_up(pods)` before asking anything."""

    def __init__(self) -> None:
        self._pods: list[Pod] = []
        self._pods_list: list[Pod] | None = None  # the pool's list object, as last seen
        self._position: dict[int, int] = {}  # id(pod) -> its position in `_pods`
        # Pods changed since last read, by id (Pod is a dataclass with eq: unhashable).
        self._changed: dict[int, Pod] = {}
        # Moves whenever the available pods may have changed, or what the router's grouping
        # of them for its index lookup reads of a record (router.py `_index_groups`).
        self.grouping_version = 0
        self._cooldowns: list[tuple[float, int]] = []  # (until, id(pod)): a heap
        # Each cooling pod's end as pushed, so that rereading it (a poll, a dispatch) while
        # it cools does not push the same end again.
        self._cooling_until: dict[int, float] = {}
        self._is_available: list[bool] = []  # by position
        # Derived from those, until one flips (rarely: a failed poll, a cooldown).
        self._available_pods: list[Pod] | None = None
        self._available_mask: np.ndarray | None = None
        self._terms = np.zeros(0)
        self._weights: RoutingWeights | None = None  # what `_terms` were worked out with
        self._region_codes = np.zeros(0, dtype=np.int64)
        self._code_of_region: dict[str, int] = {}
        self._pod_ids: list[str] = []
        self._positions_of_pod_id: dict[str, list[int]] | None = None  # None: to rebuild

    def forget(self) -> None:
        """The pool's list changed in place: read every pod again at the next catch-up."""
        self._pods_list = None

    def note_change(self, pod: Pod, name: str, value: object) -> None:
        """`pod`'s field `name` (one of RANKED_FIELDS) is about to become `value`."""
        if name == "record":
            old = pod.record
            new = value if isinstance(value, PodRecord) else None
            # A registry refresh brings every pod a new record (its heartbeat's load and
            # costs): only what is ranked or grouped by changes anything here.
            if old is None and new is None:  # a pod given by address, at every refresh
                return
            if old is not None and new is not None and _read_of(old) == _read_of(new):
                return
            self.grouping_version += 1
        self._changed[id(pod)] = pod

    def catch_up(self, pods: list[Pod], weights: RoutingWeights | None = None) -> None:
        """Brings the ranking to `pods` as they are now; with `weights`, ranks by them."""
        if pods is not self._pods_list or len(pods) != len(self._pods):
            self._rebuild(pods)
        if weights is not None and weights is not self._weights:
            self._weights = weights
            self._changed.update((id(pod), pod) for pod in self._pods)
        now = time.monotonic()
        while self._cooldowns and self._cooldowns[0][0] <= now:
            until, key = heapq.heappop(self._cooldowns)
            if self._cooling_until.get(key) == until:
                del self._cooling_until[key]
            if key in self._position:
                self._changed[key] = self._pods[self._position[key]]
        if self._changed:
            changed = list(self._changed.values())
            self._changed.clear()
            for pod in changed:
                self._reread(pod, now)

    def available(self) -> list[Pod]:
        """The available pods, in the pool's order (a new list: the caller's to filter)."""
        if self._available_pods is None:
            self._available_pods = [p for p, up in zip(self._pods, self._is_available) if up]
        return list(self._available_pods)

    @property
    def num_available(self) -> int:
        if self._available_pods is None:
            return sum(self._is_available)
        return len(self._available_pods)

    def pods_at(self, positions: list[int]) -> list[Pod]:
        return [self._pods[i] for i in positions]

    def most_cached(self, cached: dict[str, int], count: int) -> list[int]:
        """Positions of the `count` available pods holding most of the prompt (`cached`: pod
        id -> tokens), ties to the earlier pod."""
        by_id = self._positions_by_pod_id()
        is_available = self._is_available
        tokens_at = {
            position: tokens
            for pod_id, tokens in cached.items()
            if tokens > 0
            for position in by_id.get(pod_id, ())
            if is_available[position]
        }
        held = sorted(tokens_at)
        if len(held) <= count:
            return held
        return heapq.nlargest(count, held, key=tokens_at.__getitem__)

    def least_loaded(self, count: int, region: str = "") -> list[int]:
        """Positions of the `count` available pods of highest load term (in `region` when
        given), ties to the earlier pod. Needs a catch-up with weights."""
        assert self._weights is not None, "catch_up(pods, weights) first"
        if self._available_mask is None:
            self._available_mask = np.array(self._is_available, dtype=bool)
        mask = self._available_mask
        if region:
            code = self._code_of_region.get(region)
            if code is None:
                return []
            mask = mask & (self._region_codes == code)
        candidates = np.flatnonzero(mask)
        if len(candidates) <= count:
            return candidates.tolist()
        terms = self._terms[candidates]
        kth = np.partition(terms, len(terms) - count)[len(terms) - count]
        above = candidates[terms > kth]
        tied = candidates[terms == kth][: count - len(above)]
        return above.tolist() + tied.tolist()

    # ---- keeping up ------------------------------------------------------------------------

    def _rebuild(self, pods: list[Pod]) -> None:
        self.grouping_version += 1
        for pod in self._pods:
            if pod._ranking is self:
                pod._ranking = None
        self._pods_list, self._pods = pods, list(pods)
        count = len(pods)
        self._position = {id(pod): i for i, pod in enumerate(pods)}
        self._is_available = [False] * count
        self._terms = np.full(count, _UNAVAILABLE)
        self._region_codes = np.zeros(count, dtype=np.int64)
        self._pod_ids = [""] * count
        self._positions_of_pod_id = self._available_pods = self._available_mask = None
        self._cooldowns.clear()
        self._cooling_until.clear()
        self._changed.clear()
        for pod in pods:
            pod._ranking = self
            self._changed[id(pod)] = pod

    def _reread(self, pod: Pod, now: float) -> None:
        position = self._position.get(id(pod))
        if position is None:  # it left the pool after reporting
            return
        is_available = pod.is_available_at(now)
        until = pod.unreachable_until
        if until > now and self._cooling_until.get(id(pod)) != until:
            self._cooling_until[id(pod)] = until
            heapq.heappush(self._cooldowns, (until, id(pod)))
        if is_available != self._is_available[position]:
            self._is_available[position] = is_available
            self._available_pods = self._available_mask = None
            self.grouping_version += 1
        weights = self._weights
        if is_available and weights is not None:
            self._terms[position] = pod.load_term(weights)
        else:
            self._terms[position] = _UNAVAILABLE
        region = pod.location.region
        code = self._code_of_region.setdefault(region, len(self._code_of_region))
        self._region_codes[position] = code
        pod_id = pod.pod_id
        if pod_id != self._pod_ids[position]:
            self._pod_ids[position] = pod_id
            self._positions_of_pod_id = None

    def _positions_by_pod_id(self) -> dict[str, list[int]]:
        if self._positions_of_pod_id is None:
            by_id: dict[str, list[int]] = {}
            for position, pod_id in enumerate(self._pod_ids):
                by_id.setdefault(pod_id, []).append(position)
            self._positions_of_pod_id = by_id
        return self._positions_of_pod_id


def _read_of(record: PodRecord) -> tuple:
    """What the ranking (id, region) and the router's index grouping read of a record."""
    return (
        record.pod_id,
        record.region,
        record.generation,
        record.block_size,
        record.hash_namespace,
    )
