"""Picking the pods for a prompt: follows the Redis registry, asks the prefix index how much of
a prompt each pod holds, and hands the rest to services/gateway/routing/scoring.py.

    pick(prompt) ─▶ hash the prompt's full blocks (per block size and namespace the pods use)
                 ─▶ the gateway's prefix index (prefix_index.py, fed by the pods' block-event
                    stream: index_follower.py), no Redis round trip; until the index is
                    synced, one round trip (LOOKUP_SCRIPT over every pod) ─▶ cached tokens
                 ─▶ routing.decide(prefill views, decode views)   ─▶ RoutingDecision

Without --redis-url the pods are the static addresses and no index exists (load and proximity
only). While Redis is unreachable the registry is kept as last seen, lookups are skipped
(reason "redis_down") and a background refresh notices when Redis is back.

A sequence whose decode pod could not be reached before it streamed anything is picked again
without that pod (`pick(..., exclude=...)`; services/gateway/generation.py retries it), and
away from the prefill pod of that attempt when another is available (`avoid_prefill`).
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import operator
from collections.abc import Collection
from dataclasses import dataclass, field

from redis.exceptions import RedisError

from splitserve.common.registry_schema import (
    PodRecord,
    RegistryKeys,
    cached_prefixes,
    connect,
    read_pods,
)
from splitserve.engine.gc_heap import freeze_startup_heap
from splitserve.engine.kv.block_hash import BlockHash, cache_salt_keys, hash_full_blocks
from splitserve.engine.lora.request import lora_hash_keys
from splitserve.gateway.routing.index_follower import IndexFollower
from splitserve.gateway.routing.pods import Pod, PodPool
from splitserve.gateway.routing.scoring import (
    LatencyMatrix,
    Location,
    RoutingContext,
    RoutingDecision,
    RoutingWeights,
    decide,
)
from splitserve.gateway.routing.shortlist import shortlist
from splitserve.gateway.routing.tier_credit import credited_tokens

logger = logging.getLogger(__name__)

REGISTRY_REFRESH_SECONDS = 0.5
# The index follower's own client waits this long for a reply: it runs beside the requests,
# never in their way, and a snapshot's SETs at a thousand pods (a busy Redis, tens of thousands
# of hashes per reply) took longer than the requests' 0.5 s, so it resynced again and again.
FOLLOWER_TIMEOUT_S = 5.0
# The registry refresh (in the background too) reads every pod's record: at a thousand pods on
# a Redis busy with their heartbeats it passed 0.5 s now and then, and the router took Redis
# for down and routed by load alone until the next refresh (benchmarks/scale).
REGISTRY_TIMEOUT_S = 5.0
# prompt_cache_key -> the decode pod that served it last; the oldest keys are forgotten.
MAX_CACHE_KEYS = 65536
# (block size, hash namespace) -> the generations of the pods hashing that way, and the pods
# (whose records, as they are at the lookup, credit their offload tiers).
IndexGroups = dict[tuple[int, str], tuple[dict[str, int], dict[str, Pod]]]
_RECORD_OF = operator.attrgetter("record")


@dataclass(frozen=True)
class RouterSettings:
    policy: str = "cache_aware"
    weights: RoutingWeights = field(default_factory=RoutingWeights)
    latency: LatencyMatrix = field(default_factory=LatencyMatrix)
    place: Location = field(default_factory=Location)  # the gateway's region and zone
    redis_url: str | None = None
    # Look prefixes up in the gateway's event-fed index (else always by the Redis script).
    use_local_index: bool = True
    # Freeze the process's heap once the index's first snapshot is in (the gateway's main):
    # at a thousand pods the index is a million hashes in sets and dicts, and each full
    # collection walked all of them, stalling routing and streams for up to 0.6 s
    # (benchmarks/scale). Off for routers inside other programs (tests): process-wide.
    freeze_heap_after_index_sync: bool = False


@dataclass(frozen=True)
class PickedPods:
    decision: RoutingDecision
    decode: Pod
    prefill: Pod | None


class Router:
    """Owned by the gateway's event loop: `start()` there, `pick()` from handlers."""

    def __init__(
        self,
        decode_pool: PodPool,
        prefill_pool: PodPool | None,
        settings: RouterSettings | None = None,
        keys: RegistryKeys | None = None,
    ) -> None:
        self.decode_pool = decode_pool
        self.prefill_pool = prefill_pool
        self.settings = settings or RouterSettings()
        self.keys = keys or RegistryKeys()
        url = self.settings.redis_url
        self.redis = connect(url) if url else None
        self._registry_redis = connect(url, REGISTRY_TIMEOUT_S) if url else None
        self.is_redis_up = False
        self._turns = itertools.count()
        self._refresher: asyncio.Task | None = None
        self.index_follower = (
            IndexFollower(
                connect(self.settings.redis_url, FOLLOWER_TIMEOUT_S),
                self.keys,
                after_first_sync=(
                    freeze_startup_heap if self.settings.freeze_heap_after_index_sync else None
                ),
            )
            if self.settings.redis_url and self.settings.use_local_index
            else None
        )
        self._follower_task: asyncio.Task | None = None
        self._cache_key_pods: collections.OrderedDict[str, str] = collections.OrderedDict()
        # The records' ids `_index_groups` was given, or the pools' version they were read at.
        self._index_groups_key: list[int] | tuple = []
        # Those records, held so that no id in the key can be another record's meanwhile.
        self._index_groups_records: list[PodRecord | None] = []
        self._index_groups_kept: IndexGroups = {}
        # The policy's weights, once: `for_policy` builds new ones for some policies, and the
        # pods keep their load term per weights object (`Pod.load_term`).
        self._policy_weights = self.settings.weights.for_policy(self.settings.policy)

    async def start(self) -> None:
        if self.redis is None:
            return
        await self.refresh_registry()
        self._refresher = asyncio.create_task(self._refresh_forever(), name="registry")
        if self.index_follower is not None:
            self._follower_task = asyncio.create_task(
                self.index_follower.run_forever(), name="prefix-index"
            )

    async def close(self) -> None:
        for task in (self._refresher, self._follower_task):
            if task is not None:
                task.cancel()
        if self.index_follower is not None:
            await self.index_follower.client.aclose()
        for client in (self.redis, self._registry_redis):
            if client is not None:
                await client.aclose()

    @property
    def is_index_synced(self) -> bool:
        return self.index_follower is not None and self.index_follower.is_synced

    # ---- registry ---------------------------------------------------------------------------

    async def refresh_registry(self) -> None:
        assert self._registry_redis is not None, "only with --redis-url"
        try:
            records = await read_pods(self._registry_redis, self.keys)
        except (RedisError, OSError) as error:
            self._redis_failed(error)
            return
        if not self.is_redis_up:
            logger.info("Redis registry reachable: %d pod(s)", len(records))
        self.is_redis_up = True
        for pool in (self.decode_pool, self.prefill_pool):
            if pool is not None:
                await pool.apply_records(records)
        if self.index_follower is not None:
            self.index_follower.sync_pods(records)

    async def _refresh_forever(self) -> None:
        while True:
            await asyncio.sleep(REGISTRY_REFRESH_SECONDS)
            await self.refresh_registry()

    def _redis_failed(self, error: Exception) -> None:
        if self.is_redis_up:
            logger.warning("Redis is unreachable (%s): routing by load and proximity", error)
        self.is_redis_up = False

    # ---- picking ----------------------------------------------------------------------------

    async def pick(
        self,
        prompt_token_ids: list[int],
        client_region: str = "",
        exclude: Collection[str] = (),
        avoid_prefill: Collection[str] = (),
        cache_salt: str | None = None,
        cache_key: str | None = None,
        lora_name: str | None = None,
    ) -> PickedPods | None:
        """The pods for one prompt (counted as dispatched to), or None without a decode pod.
        `exclude`: addresses of decode pods not to choose (a retry leaves out the pods the
        sequence already failed on). `avoid_prefill`: addresses of prefill pods to choose only
        when no other is available (the ones a retry's failed attempts named). `cache_salt`:
        the request's tenant salt, which its cached blocks' hashes include. `cache_key`
        (OpenAI's prompt_cache_key): requests sharing it go where the last one went, as if
        that pod held their whole prompt (load and saturation still count). `lora_name`: the
        request's LoRA adapter: only pods holding it are candidates (without a prefill pod that
        does, the decode pod prefills), scored by its residency, and its blocks are hashed
        with it."""
        decode_pods = self.decode_pool.available()
        # Whether a pool's candidates are all its available pods: its ranking then shortlists.
        is_every_decode_pod = not exclude and lora_name is None
        if not is_every_decode_pod:  # most picks filter nothing: no second pass
            decode_pods = [
                p for p in decode_pods if p.address not in exclude and _holds(p, lora_name)
            ]
        if not decode_pods:
            return None
        prefill_pods = self._prefill_candidates(avoid_prefill)
        is_every_prefill_pod = (
            self.prefill_pool is not None
            and lora_name is None
            and (len(prefill_pods) == self.prefill_pool.ranking.num_available)
        )
        if lora_name is not None:
            prefill_pods = [p for p in prefill_pods if _holds(p, lora_name)]
        hash_keys = cache_salt_keys(cache_salt) + lora_hash_keys(lora_name)
        pods_version = None
        if is_every_decode_pod and (self.prefill_pool is None or is_every_prefill_pod):
            pods_version = self._pools_version()
        cached = await self.cached_tokens(
            prompt_token_ids, [*prefill_pods, *decode_pods], hash_keys, pods_version
        )
        self._credit_cache_key(cached, cache_key, len(prompt_token_ids))
        place = self.settings.place
        if self.settings.policy != "round_robin":  # a rotation must see every pod
            region = client_region or place.region
            weights = self._policy_weights
            # Unfiltered, a pool's ranking lists from its available pods as they are now (a
            # Redis lookup may have waited since they were read), as the pick's checks below do.
            decode_ranking = prefill_ranking = None
            if is_every_decode_pod:
                decode_ranking = self.decode_pool.ranked(weights)
            if is_every_prefill_pod:
                prefill_ranking = self.prefill_pool.ranked(weights)  # type: ignore[union-attr]
            decode_pods = shortlist(decode_pods, cached, weights, region, decode_ranking)
            prefill_pods = shortlist(prefill_pods, cached, weights, region, prefill_ranking)
        # A stats poll that failed while the index answered leaves its pod without a load to
        # score (and unavailable): it drops out now (seen at 1,000 pods: benchmarks/scale).
        decode_pods = [p for p in decode_pods if p.is_available]
        prefill_pods = [p for p in prefill_pods if p.is_available]
        if not decode_pods:
            return None
        ctx = RoutingContext(
            num_prompt_tokens=len(prompt_token_ids),
            client=Location(client_region) if client_region else Location(place.region, place.zone),
            weights=self.settings.weights,
            latency=self.settings.latency,
            policy=self.settings.policy,
            is_index_available=self.redis is None or self.is_redis_up,
            round_robin_turn=next(self._turns),
        )
        decision = decide(
            [p.view(cached.get(p.pod_id, 0), lora_name) for p in prefill_pods],
            [p.view(cached.get(p.pod_id, 0), lora_name) for p in decode_pods],
            ctx,
        )
        logger.debug("routing decision: %s", decision)
        if cache_key is not None:
            self._cache_key_pods[cache_key] = decision.decode_pod_id
            self._cache_key_pods.move_to_end(cache_key)
            while len(self._cache_key_pods) > MAX_CACHE_KEYS:
                self._cache_key_pods.popitem(last=False)
        return self._dispatch(decision, prefill_pods, decode_pods, len(prompt_token_ids))

    def _credit_cache_key(
        self, cached: dict[str, int], cache_key: str | None, num_prompt_tokens: int
    ) -> None:
        """The pod that served `cache_key` last counts as holding the prompt (all but its
        last token, which is always computed), unless the index already says more."""
        pod_id = self._cache_key_pods.get(cache_key) if cache_key is not None else None
        if pod_id is not None:
            cached[pod_id] = max(cached.get(pod_id, 0), num_prompt_tokens - 1)

    def _prefill_candidates(self, avoid: Collection[str]) -> list[Pod]:
        available = self.prefill_pool.available() if self.prefill_pool else []
        if not avoid:
            return available
        preferred = [p for p in available if p.address not in avoid]
        return preferred or available

    def _dispatch(
        self,
        decision: RoutingDecision,
        prefill: list[Pod],
        decode: list[Pod],
        num_prompt_tokens: int,
    ) -> PickedPods:
        """Counts the prompt on the pods chosen until their next stats: on the prefill pod
        if there is one, else on the decode pod, which then prefills it."""
        decode_pod = next(p for p in decode if p.pod_id == decision.decode_pod_id)
        decode_pod.num_dispatched += 1
        prefill_pod = next((p for p in prefill if p.pod_id == decision.prefill_pod_id), None)
        if prefill_pod is not None:
            prefill_pod.num_dispatched += 1
        (prefill_pod or decode_pod).dispatched_prompt_tokens += num_prompt_tokens
        return PickedPods(decision, decode_pod, prefill_pod)

    async def cached_tokens(
        self,
        prompt: list[int],
        pods: list[Pod],
        extra_hash_keys: tuple[str, ...] = (),
        pods_version: tuple | None = None,
    ) -> dict[str, int]:
        """pod id -> tokens of `prompt` cached there, per the index ({} without one), blocks in
        a pod's offload tiers counted by their measured credit (`tier_credit.py`). A pod
        absent holds none (the gateway's index names only the pods holding some).
        `pods_version`: `_pools_version()` read with `pods` when they are all the pools'
        available pods (the grouping of their records is then kept while it holds)."""
        uses_index = self.settings.policy == "cache_aware" and self.is_redis_up
        if self.redis is None or not uses_index:
            return {}
        if self.index_follower is not None and self.index_follower.is_synced:
            return self._local_cached_tokens(prompt, pods, extra_hash_keys, pods_version)
        indexed = [(p.pod_id, p.record) for p in pods if p.record is not None]
        if not indexed:
            return {}
        hashes = _prompt_hashes(prompt, [record for _, record in indexed], extra_hash_keys)
        queries = [
            (
                record.tier_blocks_keys(self.keys),
                hashes[(record.block_size, record.hash_namespace)],
            )
            for _, record in indexed
        ]
        try:
            prefixes = await cached_prefixes(self.redis, queries)
        except (RedisError, OSError) as error:
            self._redis_failed(error)
            return {}
        return {
            pod_id: credited_tokens(record, prefix)
            for (pod_id, record), prefix in zip(indexed, prefixes, strict=True)
        }

    def _local_cached_tokens(
        self,
        prompt: list[int],
        pods: list[Pod],
        extra_hash_keys: tuple[str, ...],
        pods_version: tuple | None,
    ) -> dict[str, int]:
        """cached_tokens from the gateway's index, for the pods holding the prompt's first
        block only: crediting a thousand empty prefixes was O(pods) work the index exists to
        avoid (absent means 0, as for callers). One walk per (block size, namespace) group."""
        groups = self._index_groups(pods, pods_version)
        index = self.index_follower.index  # type: ignore[union-attr]
        found: dict[str, int] = {}
        for (block_size, namespace), (generations, pods_by_id) in groups.items():
            # Only this group's pods: another's could share a hash only by collision.
            hashes = hash_full_blocks(prompt[:-1], block_size, namespace, extra_hash_keys)
            for pod_id, prefix in index.lookup(hashes, generations).items():
                record = pods_by_id[pod_id].record
                if record is not None:
                    found[pod_id] = credited_tokens(record, prefix)
        return found

    def _index_groups(self, pods: list[Pod], pods_version: tuple | None) -> IndexGroups:
        """`_group_for_index(pods)`, kept while the same records come in the same order: they
        change at a registry refresh or when a pod stops being available, and building them
        was a sixth of a pick at a thousand pods. With `pods_version` the pools' rankings
        say whether they did; without, the records are compared (passes over every pod)."""
        if pods_version is not None:
            if pods_version != self._index_groups_key:
                self._index_groups_kept = _group_for_index(pods)
                self._index_groups_key, self._index_groups_records = pods_version, []
            return self._index_groups_kept
        records = list(map(_RECORD_OF, pods))
        key = list(map(id, records))
        if key != self._index_groups_key:
            self._index_groups_kept = _group_for_index(pods)
            self._index_groups_key, self._index_groups_records = key, records
        return self._index_groups_kept

    def _pools_version(self) -> tuple:
        """Changes whenever the pools' available pods or their records may have: the
        rankings' versions, with the rankings themselves (a pool's is its own)."""
        pools = (self.decode_pool, self.prefill_pool)
        return tuple((id(p.ranking), p.ranking.grouping_version) for p in pools if p is not None)


def _group_for_index(pods: list[Pod]) -> IndexGroups:
    """(block size, namespace) -> the pods' generations and the pods: one pass over them."""
    groups: IndexGroups = {}
    for pod in pods:
        record = pod.record
        if record is None:
            continue
        group = groups.get((record.block_size, record.hash_namespace))
        if group is None:
            group = groups[(record.block_size, record.hash_namespace)] = ({}, {})
        group[0][record.pod_id] = record.generation
        group[1][record.pod_id] = pod
    return groups


def _holds(pod: Pod, lora_name: str | None) -> bool:
    return lora_name is None or lora_name in pod.lora_adapters


def _prompt_hashes(
    prompt: list[int], records: list[PodRecord], extra_hash_keys: tuple[str, ...] = ()
) -> dict[tuple[int, str], list[BlockHash]]:
    """The prompt's block hashes once per (block size, namespace) among the pods. A prompt's
    last token is never served from cache (it must be computed to sample), so a prompt of
    whole blocks is looked up without its last block, as the engine would."""
    groups = {(record.block_size, record.hash_namespace) for record in records}
    return {
        (block_size, namespace): hash_full_blocks(
            prompt[:-1], block_size, namespace, extra_hash_keys
        )
        for block_size, namespace in groups
    }
