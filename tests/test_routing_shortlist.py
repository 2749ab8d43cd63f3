"""The router's shortlist at scale (services/gateway/routing/shortlist.py): past
MAX_SCORED_PODS it scores the best-cached, least-loaded and in-region pods only, and the pick
is the one scoring every pod would make when a listed signal decides it."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time

from splitserve.common.pod_load import PodLoad
from splitserve.common.registry_schema import PodRecord, RegistryKeys
from splitserve.engine.kv.block_hash import hash_full_blocks
from splitserve.engine.kv.tiers import Tier
from splitserve.gateway.routing import shortlist as shortlist_module
from splitserve.gateway.routing.index_follower import IndexFollower
from splitserve.gateway.routing.pods import Pod, PodPool
from splitserve.gateway.routing.router import Router, RouterSettings
from splitserve.gateway.routing.scoring import RoutingWeights, load_term
from splitserve.gateway.routing.shortlist import MAX_SCORED_PODS, shortlist, shortlist_positions
from splitserve.v1 import worker_pb2


def _pod(index: int, running: int, region: str = "r1") -> Pod:
    load = PodLoad(num_running=running, kv_blocks_total=1000, kv_blocks_free=900)
    stats = worker_pb2.WorkerStats(
        worker_id=f"d-{index}", role="decode", model="m", region=region, **load.as_fields()
    )
    record = PodRecord(f"d-{index}", "decode", f"h{index}:1", 1, model="m", region=region)
    return Pod(f"h{index}:1", stub=None, stats=stats, is_serving_model=True, record=record)


def _pool(num_pods: int, seed: int = 0) -> list[Pod]:
    rng = random.Random(seed)
    return [_pod(i, rng.randrange(5, 40), region=f"r{i % 4}") for i in range(num_pods)]


def test_a_small_pool_is_scored_whole():
    pods = _pool(MAX_SCORED_PODS)
    assert shortlist(pods, {}, RoutingWeights()) is pods


def test_the_shortlist_holds_the_best_cached_the_least_loaded_and_the_local_pods():
    pods = _pool(500)
    cached = {f"d-{i}": 16 * i for i in range(0, 500, 7)}  # 72 holders
    listed = shortlist(pods, cached, RoutingWeights(), region="r3")
    ids = {p.pod_id for p in listed}
    best_cached = sorted(cached, key=cached.get, reverse=True)[: shortlist_module.MOST_CACHED]
    assert set(best_cached) <= ids
    least = sorted(pods, key=lambda p: (p.num_queued, pods.index(p)))
    assert {p.pod_id for p in least[: shortlist_module.LEAST_LOADED]} <= ids
    local = [p for p in least if p.location.region == "r3"]
    assert {p.pod_id for p in local[: shortlist_module.LEAST_LOADED_IN_REGION]} <= ids
    bound = (shortlist_module.MOST_CACHED + shortlist_module.LEAST_LOADED
             + shortlist_module.LEAST_LOADED_IN_REGION)  # fmt: skip
    assert len(listed) <= bound
    assert listed == [p for p in pods if p.pod_id in ids]  # the pool's order kept
    # This gateway's own dispatches count as load.
    pods[1].num_dispatched = 1000
    assert pods[1] not in shortlist(pods, {}, RoutingWeights())


def test_a_large_pool_picks_as_scoring_every_pod_would():
    """With no prefix cached anywhere the least-loaded pod wins, and with one pod holding the
    prompt it wins: the same as the whole pool scored."""

    async def pick(num_pods: int, cached_pod: str | None) -> str:
        pool = PodPool("decode", [], "m")
        pool.pods = _pool(num_pods, seed=3)
        router = Router(pool, None, RouterSettings())
        if cached_pod is not None:
            router._cache_key_pods["session"] = cached_pod  # holds the whole prompt
        picked = await router.pick(list(range(200)), cache_key="session")
        assert picked is not None
        return picked.decision.decode_pod_id

    for cached_pod in (None, "d-377"):
        whole = shortlist_module.MAX_SCORED_PODS
        try:
            shortlist_module.MAX_SCORED_PODS = 10**6  # score every pod
            expected = asyncio.run(pick(600, cached_pod))
        finally:
            shortlist_module.MAX_SCORED_PODS = whole
        assert asyncio.run(pick(600, cached_pod)) == expected
        if cached_pod is not None:
            assert expected == cached_pod


def test_among_equal_queues_the_pods_with_most_kv_free_are_listed():
    """The shortlist ranks by the score's own load term: with every queue equal, the pods
    scoring prefers (most KV free) are the ones listed, as the planner's simulated gateway
    relies on."""
    weights = RoutingWeights()
    kv_usage = [((i * 37) % 100) / 100 for i in range(300)]
    loads = [load_term(3, usage, weights) for usage in kv_usage]
    listed = shortlist_positions([0] * 300, loads)
    freest = sorted(range(300), key=lambda i: kv_usage[i])[: shortlist_module.LEAST_LOADED]
    assert set(freest) <= set(listed) and len(listed) == shortlist_module.LEAST_LOADED


def test_no_cached_tokens_given_lists_what_all_zeros_lists():
    """None (no pod holds any of the prompt, the simulated gateway's shortcut) shortlists the
    pods a list of zeros does, ties to the earlier pod included."""
    loads = [float((i * 7) % 5) for i in range(200)]
    assert shortlist_positions(None, loads) == shortlist_positions([0] * 200, loads)
    assert len(shortlist_positions(None, loads)) == shortlist_module.LEAST_LOADED


def test_a_pods_load_term_follows_its_polls_and_dispatches():
    """The term a pick ranks by is kept per pod; a dispatch or a new poll answer changes it."""
    weights = RoutingWeights()
    pod = _pod(0, running=3)
    assert pod.load_term(weights) == load_term(3, pod.kv_usage, weights)
    pod.num_dispatched = 2
    assert pod.load_term(weights) == load_term(5, pod.kv_usage, weights)
    busier = PodLoad(num_running=10, kv_blocks_total=1000, kv_blocks_free=100)
    pod.stats = worker_pb2.WorkerStats(worker_id="d-0", model="m", **busier.as_fields())
    assert pod.load_term(weights) == load_term(12, busier.kv_usage, weights)
    other = RoutingWeights(load=3.0)
    assert pod.load_term(other) == load_term(12, busier.kv_usage, other)


def _router_with_one_holder() -> tuple[Router, PodPool]:
    """100 pods; d-7 (unsaturated, so its cache decides a pick) holds 3 blocks of range(64)."""
    pool = PodPool("decode", [], "m")
    pool.pods = _pool(100)
    pool.pods[7].stats.num_running = 1
    router = Router(pool, None, RouterSettings())
    follower = IndexFollower(None, RegistryKeys())
    follower.index.replace_pod("d-7", 1, {Tier.DEVICE: hash_full_blocks(list(range(63)), 16, "")})
    follower.is_synced = True
    router.index_follower, router.redis, router.is_redis_up = follower, object(), True
    return router, pool


def test_the_index_lookup_follows_the_registrys_records():
    """The router keeps its grouping of the pods' records between lookups; a registry refresh
    that names a pod's new process (another generation) stops its old blocks counting, and
    equal records in new objects keep them."""
    router, pool = _router_with_one_holder()
    prompt = list(range(64))

    def cached() -> dict[str, int]:
        return asyncio.run(router.cached_tokens(prompt, pool.pods))

    assert cached() == {"d-7": 48}
    for pod in pool.pods:  # a refresh: equal records, new objects
        pod.record = dataclasses.replace(pod.record)
    assert cached() == {"d-7": 48}
    pool.pods[7].record = dataclasses.replace(pool.pods[7].record, generation=2)
    assert cached() == {}


def test_picks_follow_the_registrys_records():
    """The same through picks, where the grouping is kept by the pool's ranking's version: a
    heartbeat's new records keep it, a new generation of the holder changes it."""
    router, pool = _router_with_one_holder()
    prompt = list(range(64))

    def picked_holding() -> tuple[str, int]:
        picked = asyncio.run(router.pick(prompt))
        assert picked is not None
        return picked.decision.decode_pod_id, picked.decision.cached_prefix_tokens

    assert picked_holding() == ("d-7", 48)
    for pod in pool.pods:  # a refresh: new records, heartbeats' figures changed
        pod.record = dataclasses.replace(pod.record, recent_itl_s=0.01)
    assert picked_holding() == ("d-7", 48)
    pool.pods[7].record = dataclasses.replace(pool.pods[7].record, generation=2)
    assert picked_holding()[1] == 0


def _brute_force_available(pods: list[Pod]) -> list[Pod]:
    now = time.monotonic()
    return [pod for pod in pods if pod.is_available_at(now)]


def _shake(pool: PodPool, rng: random.Random, step: int) -> None:
    """One random change of the kinds a gateway sees: a poll's answer (new load, maybe
    another region or model), a dispatch, a failed poll, a call that found a pod unreachable
    (a short cooldown, to run out within the test), a registry refresh, pods joining and
    leaving."""
    pods = pool.pods
    pod = rng.choice(pods)
    # Now and then a short cooldown, where the sleep below lets it run out before the next look.
    kind = 4 if step % 70 == 69 else rng.randrange(9)
    if kind == 0:
        load = PodLoad(num_running=rng.randrange(4), kv_blocks_total=1000,
                       kv_blocks_free=rng.choice([100, 500, 900]))  # fmt: skip
        region = rng.choice(["", "r0", "r1", "r2", "r3"])  # "": the record's counts
        pod.stats = worker_pb2.WorkerStats(
            worker_id=pod.pod_id, model="m", region=region, **load.as_fields()
        )
        pod.num_dispatched, pod.is_serving_model = 0, rng.random() > 0.05
    elif kind in (1, 2):
        pod.num_dispatched += 1
    elif kind == 3:
        pod.stats = None
    elif kind == 4:
        pool.mark_unreachable(pod)
        cooldown = 0.25 if step % 70 == 69 else rng.choice([0.0, 60.0])
        pod.unreachable_until = time.monotonic() + cooldown
    elif kind == 5 and pod.record is not None:  # a heartbeat's record; now and then a move
        region = rng.choice(["r0", "r1", "r2", "r3"]) if rng.random() < 0.5 else pod.record.region
        pod.record = dataclasses.replace(pod.record, region=region, recent_itl_s=rng.random())
    elif kind == 6:  # one pod leaves and another joins: the list changed in place
        pods.remove(pod)
        pods.insert(rng.randrange(len(pods)), _pod(1000 + step, rng.randrange(5)))
        pool.ranking.forget()
    elif kind == 7 and step % 50 == 0:  # the pool's list replaced outright
        pool.pods = list(pods)
    elif kind == 8 and step % 20 == 0:  # one appended, as tests and benchmarks build pools
        pods.append(_pod(5000 + step, rng.randrange(5), region=""))


def test_the_pools_ranking_lists_what_a_pass_over_every_pod_lists():
    """The ranking a pool keeps as its pods change gives the available pods and shortlists
    that reading every pod at the pick gives, through polls, dispatches, failures, cooldowns
    running out, registry refreshes, moves between regions and pods joining and leaving."""
    rng = random.Random(5)
    pool = PodPool("decode", [], "m")
    pool.pods = _pool(300, seed=5)
    for pod in pool.pods[::2]:  # their region is their record's
        pod.stats.region = ""
    weights = RoutingWeights()
    for step in range(1500):
        _shake(pool, rng, step)
        if step % 7 and step % 70 != 69:  # a look right after a short cooldown begins, too
            continue
        if step % 70 == 0:
            time.sleep(0.3)  # the short cooldown runs out
        available = pool.available()
        assert available == _brute_force_available(pool.pods)
        holders = rng.sample(available, rng.choice([0, 5, 40]))
        cached = {pod.pod_id: 16 * rng.randrange(1, 4) for pod in holders}  # ties among them
        for region in ("", "r0", "r1", "r2", "r3", "r9"):
            ranked = shortlist(available, cached, weights, region, pool.ranked(weights))
            assert ranked == shortlist(available, cached, weights, region)
