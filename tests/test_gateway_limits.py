"""The key file and the rate limiter on their own: key files refused with the entry named,
look-ups by key and by its SHA-256, the tenant's cache salt, and the limiter against a real
redis-server: shared counts, the sliding window, concurrent slots, one call checking and
charging every limit of each waiting request or nothing (counted by Redis's own
commandstats), the replicas' leases (never past a limit together, a lease starving another
replica by at most its bound and only until it goes back, a dead replica's slots forgotten),
and a Redis that goes away (the limiter keeps counting in its own process and says so in the
log). The HTTP gate is driven in process over a stand-in generation route."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import random
import time

import pytest
import redis
from prometheus_client import CollectorRegistry

from splitserve.common.redis_server import RedisServer
from splitserve.engine.kv.block_hash import quota_tenant, tenant_cache_salt
from splitserve.engine.sampling_params import SamplingParams
from splitserve.gateway.api.http_app import GENERATION_ENDPOINTS
from splitserve.gateway.auth import headroom, lease, lease_script, limits
from splitserve.gateway.auth.gate import Caller, Gate, current_caller
from splitserve.gateway.auth.http import CHARGED_PATHS, GateMiddleware
from splitserve.gateway.auth.keys import KeyRing, api_key_from_headers
from splitserve.gateway.auth.limits import WINDOW_S, Ask, LimitExceeded, RateLimiter
from splitserve.gateway.auth.windows import window_use as _window_use
from splitserve.gateway.core import GenerationRequest


def test_keys_by_value_and_by_sha256_share_their_tenants_limits(tmp_path):
    path = tmp_path / "keys.yaml"
    digest = hashlib.sha256(b"sk-second-key-1").hexdigest()
    path.write_text(
        "- key: sk-first-key-1\n  tenant: acme\n  requests_per_minute: 10\n"
        f"- key_sha256: {digest}\n  tenant: acme\n"
        "- key: sk-other-key-1\n  tenant: other\n"
    )
    ring = KeyRing.from_file(path)
    assert ring.tenants == {"acme", "other"}
    first, second = ring.lookup("sk-first-key-1"), ring.lookup("sk-second-key-1")
    assert first is not None and second is not None
    assert first.tenant == second.tenant == "acme"
    assert second.limits.requests_per_minute == 10  # the tenant's, set on its first entry
    assert ring.lookup("sk-first-key-") is None
    assert ring.lookup(digest) is None  # the digest is not itself a key


@pytest.mark.parametrize(
    "entries, fault",
    [
        ([], "non-empty list"),
        ([{"key": "sk-12345678"}], "tenant"),
        ([{"key": "sk-12345678", "tenant": "a/b"}], "tenant"),
        ([{"key": "short", "tenant": "a"}], "at least 8"),
        ([{"key": "sk-12345678", "key_sha256": "0" * 64, "tenant": "a"}], "exactly one"),
        ([{"key_sha256": "xyz", "tenant": "a"}], "64 hex"),
        ([{"key": "sk-12345678", "tenant": "a", "requests_per_minute": 0}], "positive"),
        ([{"key": "sk-12345678", "tenant": "a", "rpm": 5}], "unknown field"),
        ([{"key": "sk-12345678", "tenant": "a"}] * 2, "entry 1: a key given twice"),
        (
            [
                {"key": "sk-12345678", "tenant": "a", "requests_per_minute": 1},
                {"key": "sk-87654321", "tenant": "a", "requests_per_minute": 2},
            ],
            "other limits",
        ),
    ],
)
def test_bad_key_files_are_refused_naming_the_entry(tmp_path, entries, fault):
    path = tmp_path / "keys.json"
    path.write_text(json.dumps(entries))
    with pytest.raises(ValueError, match="--api-keys") as caught:
        KeyRing.from_file(path)
    assert fault in str(caught.value)


def test_the_key_comes_from_bearer_else_x_api_key():
    assert api_key_from_headers({"authorization": "Bearer k1", "x-api-key": "k2"}) == "k1"
    assert api_key_from_headers({"authorization": "bearer  k1 "}) == "k1"
    assert api_key_from_headers({"authorization": "Basic k1", "x-api-key": "k2"}) == "k2"
    assert api_key_from_headers({"authorization": "Bearer "}) is None
    assert api_key_from_headers({}) is None


def test_a_client_salt_narrows_within_its_tenant_only():
    assert tenant_cache_salt("a", None) == "tenant:a"
    assert tenant_cache_salt("a", "x") == "tenant:a/x"
    # Tenant names hold no "/": no client salt of tenant a spells tenant b's salt.
    assert tenant_cache_salt("a", "/../b") != tenant_cache_salt("b", None)
    assert quota_tenant("tenant:a/x") == quota_tenant("tenant:a") == "tenant:a"
    assert quota_tenant("client-salt") == "client-salt"  # no keys: as before
    assert quota_tenant(None) == ""


def test_the_sliding_window_weighs_the_previous_minute():
    # 30 s into a window: half of the previous minute's 10 still counts.
    now = 1000 * WINDOW_S + 30
    use = _window_use(limit=10, cur=5, prev=10, amount=1, now=now)
    assert use.retry_after_s > 0 and use.used == pytest.approx(10)
    # It fits once the previous window's share falls to 4: at 36 s, 6 s from now.
    assert use.retry_after_s == pytest.approx(6.0)
    assert _window_use(limit=10, cur=5, prev=10, amount=1, now=now + 6.01).retry_after_s == 0
    fits = _window_use(limit=10, cur=4, prev=2, amount=1, now=now)
    assert fits.retry_after_s == 0 and fits.remaining == 10 - 6


@pytest.fixture(scope="module")
def redis_server():
    with RedisServer() as server:
        yield server


def test_two_limiters_on_one_redis_share_their_counts(redis_server):
    async def run() -> list[bool]:
        first, second = RateLimiter(redis_server.url), RateLimiter(redis_server.url)
        try:
            allowed = []
            for limiter in (first, second, first, second):
                use = await limiter.add("shared-test", "requests", 1, 3)
                allowed.append(not use.retry_after_s)
            return allowed
        finally:
            await first.close()
            await second.close()

    assert asyncio.run(run()) == [True, True, True, False]


def test_running_slots_are_shared_and_released(redis_server):
    async def run() -> None:
        first, second = RateLimiter(redis_server.url), RateLimiter(redis_server.url)
        try:
            assert await first.enter("slots-test", "r1", 1) == (True, True)
            assert (await second.enter("slots-test", "r2", 1))[0] is False
            await first.leave("slots-test", "r1", True)
            assert await second.enter("slots-test", "r2", 1) == (True, True)
        finally:
            await first.close()
            await second.close()

    asyncio.run(run())


def test_a_redis_outage_degrades_to_this_replicas_counts_and_logs_it(caplog):
    async def run(server: RedisServer) -> None:
        limiter = RateLimiter(server.url)
        try:
            assert not (await limiter.add("outage-test", "requests", 1, 2)).retry_after_s
            server.stop()
            with caplog.at_level(logging.WARNING, "splitserve.gateway.auth.limits"):
                # Redis counted one; this replica alone now allows its own two.
                results = [await limiter.add("outage-test", "requests", 1, 2) for _ in range(3)]
                slot = await limiter.enter("outage-test", "r1", 1)
            assert [not use.retry_after_s for use in results] == [True, True, False]
            assert slot == (True, False)  # taken in this process
            await limiter.leave("outage-test", "r1", False)
            assert await limiter.enter("outage-test", "r2", 1) == (True, False)
        finally:
            await limiter.close()

    server = RedisServer().start()
    try:
        asyncio.run(run(server))
    finally:
        server.stop()
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "per replica" in warnings[0], warnings


def test_a_refused_admission_charges_nothing(redis_server):
    """Requests, tokens and concurrent slots in one script: the first limit over refuses
    (requests, then concurrent requests, then tokens) and no count moves. What the replica
    leased beyond its requests goes back as it closes, so Redis then holds what was admitted."""
    everything = {"requests_per_minute": 10, "tokens_per_minute": 100, "concurrent_requests": 1}

    async def run() -> tuple[list[str | None], dict[bytes, bytes]]:
        limiter = RateLimiter(redis_server.url)
        try:
            refusals = []
            for request_id, num_tokens in [("r1", 150), ("r2", 60), ("r3", 10), ("r4", 10)]:
                ask = Ask(num_tokens=num_tokens, **everything)
                admission = await limiter.admit("atomic-test", request_id, ask)
                refusals.append(admission.refused)
                if request_id == "r3":  # r2 still runs: its slot refused r3
                    assert admission.requests is not None and admission.requests.remaining == 9
                    await limiter.leave("atomic-test", "r2", True)
            return refusals, redis.Redis.from_url(redis_server.url).hgetall(_SLOTS)
        finally:
            await limiter.close()

    refusals, slots_held = asyncio.run(run())
    assert refusals == ["tokens", None, "concurrent_requests", None]
    assert list(slots_held.values()) == [b"1"]  # r4's, on the one replica
    assert _counted(redis_server.url, "atomic-test") == (2, 70)  # r2's and r4's alone
    assert not redis.Redis.from_url(redis_server.url).hgetall(_SLOTS)  # given back on close


_SLOTS = "splitserve:limits:{atomic-test}:slots"


def _counted(url: str, tenant: str) -> tuple[int, int]:
    """The tenant's requests and tokens in Redis, this minute's and the last's (the minute may
    have turned)."""
    client = redis.Redis.from_url(url)
    index = int(time.time() // WINDOW_S)
    counts = []
    for kind in ("requests", "tokens"):
        keys = [f"splitserve:limits:{{{tenant}}}:{kind}:{i}" for i in (index, index - 1)]
        counts.append(sum(int(value or 0) for value in client.mget(keys)))
    return counts[0], counts[1]


def test_the_charged_paths_are_the_generation_endpoints():
    assert set(GENERATION_ENDPOINTS) == CHARGED_PATHS


LIMITED_KEY = "sk-limited-0123456789"


def _gate(url: str, tenant: str, **limits: int) -> Gate:
    keys = KeyRing.from_entries([{"key": LIMITED_KEY, "tenant": tenant, **limits}])
    return Gate(keys, CollectorRegistry(), url)


async def _generation_route(scope, receive, send) -> None:
    """A stand-in for a generation route: the body read, the caller charged as
    GatewayCore.start charges it, then a stream of two tokens."""
    await receive()
    caller = current_caller()
    assert caller is not None, "the gate sets the caller"
    request = GenerationRequest("gen-1", [[1] * 10], SamplingParams(max_tokens=5))
    _, charge = caller.charge_soon(request)
    await charge.wait()
    await send({"type": "http.response.start", "status": 200, "headers": []})
    for token in (b"data: a\n\n", b"data: b\n\n"):
        await send({"type": "http.response.body", "body": token, "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _malformed_route(scope, receive, send) -> None:
    """A stand-in for a generation route refusing its body before any charge."""
    await receive()
    await send({"type": "http.response.start", "status": 400, "headers": []})
    await send({"type": "http.response.body", "body": b"{}", "more_body": False})


async def _call(app, path: str = "/v1/chat/completions", on_body=None) -> list[dict]:
    """The messages `app` sent for one POST with the limited key."""
    scope = {
        "type": "http",
        "method": "POST",
        "path": path,
        "headers": [(b"authorization", f"Bearer {LIMITED_KEY}".encode()),
                    (b"content-length", b"2")],
    }  # fmt: skip
    messages: list[dict] = []

    async def receive() -> dict:
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message: dict) -> None:
        if message["type"] == "http.response.body" and on_body is not None:
            on_body(message)
        messages.append(message)

    await app(scope, receive, send)
    return messages


def _command_calls(client: redis.Redis) -> dict[str, int]:
    stats = client.info("commandstats")
    return {name.removeprefix("cmdstat_"): int(stat["calls"]) for name, stat in stats.items()}


def _delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    delta = {name: calls - before.get(name, 0) for name, calls in after.items()}
    return {name: calls for name, calls in delta.items() if calls and name != "info"}


def test_a_tenant_with_room_is_admitted_from_its_lease_without_redis(redis_server, monkeypatch):
    """Counted by Redis itself (INFO commandstats, which also counts the commands a script
    runs): a burst of requests shares one call, which leases about as much again; the next
    burst is admitted from the lease, its slots given back to the lease, without one Redis
    command, and its headers still count each request. Closing gives back what was leased:
    Redis then holds exactly what was admitted."""
    monkeypatch.setattr(limits, "TEND_S", 60.0)  # no background pass during the test
    client = redis.Redis.from_url(redis_server.url)
    many = {"requests_per_minute": 10_000, "tokens_per_minute": 10**6, "concurrent_requests": 1000}

    async def run() -> tuple[list[dict[str, int]], list[int]]:
        gate = _gate(redis_server.url, "leased", **many)
        app = GateMiddleware(_generation_route, gate)
        try:
            await _call(app)  # the script loaded, a connection open
            calls = [_command_calls(client)]
            for _ in range(2):
                bursts = await asyncio.gather(*(_call(app) for _ in range(16)))
                await gate.limiter.drain()  # type: ignore[union-attr]
                calls.append(_command_calls(client))
            assert {messages[0]["status"] for messages in bursts} == {200}
            header = b"x-ratelimit-remaining-requests"
            return calls, sorted(int(dict(m[0]["headers"])[header]) for m in bursts)
        finally:
            await gate.close()  # gives back what the lease holds

    calls, remaining = asyncio.run(run())
    first_burst, second_burst = _delta(calls[0], calls[1]), _delta(calls[1], calls[2])
    assert first_burst["evalsha"] == 1 and "zrem" not in first_burst, first_burst
    assert second_burst == {}
    assert remaining == list(range(10_000 - 33, 10_000 - 17))  # 1 + 16 before, 16 here
    assert _counted(redis_server.url, "leased") == (33, 33 * 15)
    assert not client.hgetall("splitserve:limits:{leased}:slots")


def test_a_generation_request_refused_before_its_charge_still_counts(redis_server):
    """A 400 before the tokens are known is a request: counted, and past the requests per
    minute a 429 goes out in its place."""

    async def run() -> list[int]:
        gate = _gate(redis_server.url, "malformed", requests_per_minute=1, concurrent_requests=1)
        app = GateMiddleware(_malformed_route, gate)
        try:
            first, second = await _call(app), await _call(app)
            assert len(second) == 2 and b"rate_limit_exceeded" in second[1]["body"]
            assert dict(second[0]["headers"])[b"x-ratelimit-remaining-requests"] == b"0"
            assert not await _running(redis_server.url)  # no slot was taken for either
            return [first[0]["status"], second[0]["status"]]
        finally:
            await gate.close()

    assert asyncio.run(run()) == [400, 429]


async def _running(url: str) -> list[bytes]:
    client = redis.asyncio.Redis.from_url(url)
    try:
        return await client.zrange("splitserve:limits:{malformed}:running", 0, -1)
    finally:
        await client.aclose()


def test_a_tenant_without_limits_makes_no_redis_command(redis_server):
    client = redis.Redis.from_url(redis_server.url)

    async def run() -> list[dict]:
        gate = _gate(redis_server.url, "unlimited")
        try:
            return await _call(GateMiddleware(_generation_route, gate))
        finally:
            await gate.close()

    before = _command_calls(client)
    messages = asyncio.run(run())
    assert messages[0]["status"] == 200
    assert _delta(before, _command_calls(client)) == {}


def test_concurrent_admissions_share_calls_and_survive_a_script_flush(redis_server):
    """Admissions made at once share one call per tenant, the tenants' calls one pipeline, and
    each request is still checked on its own: of 20 at once under a limit of 10, exactly 10
    pass, for each of two tenants. A Redis that lost the script (SCRIPT FLUSH, as after a
    restart) is sent it again, and the calls it refused run."""
    client = redis.Redis.from_url(redis_server.url)

    async def run() -> list[str | None]:
        limiter = RateLimiter(redis_server.url)
        ask = Ask(requests_per_minute=10)
        try:
            client.script_flush()
            admissions = await asyncio.gather(
                *(
                    limiter.admit(tenant, f"r{i}", ask)
                    for tenant in ("one", "two")
                    for i in range(20)
                )
            )
            return [admission.refused for admission in admissions]
        finally:
            await limiter.close()

    before = _command_calls(client)
    refusals = asyncio.run(run())
    for refused in (refusals[:20], refusals[20:]):
        assert refused.count(None) == 10 and set(refused) == {None, "requests"}
    calls = _delta(before, _command_calls(client))
    assert calls["evalsha"] == 4 and calls["script|load"] == 1  # both refused, then run


# ---- checks beside the routing and prefill (auth/headroom.py) --------------------------------


def _caller(gate: Gate) -> Caller:
    key = gate.authenticate({"authorization": f"Bearer {LIMITED_KEY}"})
    return gate.defer(key)


def _ask(num_prompt_tokens: int, max_tokens: int) -> GenerationRequest:
    params = SamplingParams(max_tokens=max_tokens)
    return GenerationRequest("gen", [[1] * num_prompt_tokens], params)


async def _charged(gate: Gate, request: GenerationRequest) -> tuple[bool, str | None]:
    """(whether the charge might overlap the request's work, the limit that refused it)."""
    _, charge = _caller(gate).charge_soon(request)
    try:
        await charge.wait()
    except LimitExceeded as error:
        return charge.may_overlap, error.kind
    return charge.may_overlap, None


def test_a_tenant_is_checked_beside_its_work_only_while_it_had_room(redis_server, monkeypatch):
    async def run() -> list[tuple[bool, str | None]]:
        # A limit this small leases nothing beyond each request (an eighth of what is left is
        # under one), so what the other replica takes is what it admits.
        gate = _gate(redis_server.url, "headroom-test", requests_per_minute=8)
        other_replica = _gate(redis_server.url, "headroom-test", requests_per_minute=8)
        try:
            seen = [await _charged(gate, _ask(4, 4))]  # never checked: before anything is sent
            seen.append(await _charged(gate, _ask(4, 4)))  # 6 of 8 left at its last check
            for _ in range(6):  # another replica takes the rest meanwhile
                await _charged(other_replica, _ask(4, 4))
            seen.append(await _charged(gate, _ask(4, 4)))  # its view had room: refused late
            seen.append(await _charged(gate, _ask(4, 4)))  # refused last: checked first now
            return seen
        finally:
            await gate.close()
            await other_replica.close()

    assert asyncio.run(run()) == [(False, None), (True, None), (True, "requests"),
                                  (False, "requests")]  # fmt: skip


def test_a_stale_view_or_a_request_past_the_tokens_left_is_checked_first(redis_server, monkeypatch):
    async def run() -> list[bool]:
        gate = _gate(redis_server.url, "headroom-tokens-test", tokens_per_minute=1000)
        try:
            await _charged(gate, _ask(100, 100))  # 800 left
            seen = [(await _charged(gate, _ask(100, 100)))[0]]  # 600 left: 500 > 100 after it
            seen.append((await _charged(gate, _ask(200, 350)))[0])  # 600 - 550 = 50 < 10%
            await _charged(gate, _ask(10, 10))
            monkeypatch.setattr(headroom, "FRESH_S", 0.0)
            seen.append((await _charged(gate, _ask(10, 10)))[0])  # the view is too old
            return seen
        finally:
            await gate.close()

    assert asyncio.run(run()) == [True, False, False]


def test_a_slot_taken_after_its_response_ended_is_given_back(redis_server):
    async def run() -> list[bytes]:
        gate = _gate(redis_server.url, "late-slot-test", concurrent_requests=5)
        try:
            caller = _caller(gate)
            _, charge = caller.charge_soon(_ask(4, 4))
            Gate.release(caller)  # the response ended (a client gone) before the check answered
            await charge.wait()
            await gate.limiter.drain()
            client = redis.Redis.from_url(redis_server.url)
            return client.zrange("splitserve:limits:{late-slot-test}:running", 0, -1)
        finally:
            await gate.close()

    assert asyncio.run(run()) == []


# ---- leases across replicas (auth/lease.py) --------------------------------------------------


@pytest.fixture
def fresh_minute(monkeypatch):
    """time.time() moved to a second into a minute, so no window turns under a test."""
    real_time = time.time
    offset = WINDOW_S - real_time() % WINDOW_S + 1.0
    monkeypatch.setattr(time, "time", lambda: real_time() + offset)


@pytest.mark.parametrize("tokens_per_minute, binding", [(60_000, "requests"), (20_000, "tokens")])
def test_two_replicas_leasing_at_once_never_admit_past_a_limit(
    redis_server, fresh_minute, tokens_per_minute, binding
):
    """24 clients on two replicas, random token counts, slots held a few ms: together they
    admit no more than each limit (`binding`: the per-minute one they reach), and once both
    close Redis holds exactly what they admitted (no refusal was charged, every lease came
    back)."""
    tenant = f"two-replicas-{binding}"
    tenant_limits = {"requests_per_minute": 300, "tokens_per_minute": tokens_per_minute}
    tenant_limits["concurrent_requests"] = 12
    rng = random.Random(34)
    admitted = {"requests": 0, "tokens": 0, "running": 0, "peak": 0}
    refusals: set[str] = set()

    async def client(replica: RateLimiter, number: int) -> None:
        for attempt in range(40):
            request_id, num_tokens = f"c{number}-{attempt}", rng.randint(10, 200)
            ask = Ask(num_tokens=num_tokens, **tenant_limits)
            admission = await replica.admit(tenant, request_id, ask)
            if admission.refused is not None:
                refusals.add(admission.refused)
                await asyncio.sleep(0.001)
                continue
            admitted["requests"] += 1
            admitted["tokens"] += num_tokens
            admitted["running"] += 1
            admitted["peak"] = max(admitted["peak"], admitted["running"])
            await asyncio.sleep(rng.uniform(0, 0.004))
            admitted["running"] -= 1
            replica.leave_soon(tenant, request_id, admission.slot_in_redis)

    async def run() -> None:
        replicas = [RateLimiter(redis_server.url), RateLimiter(redis_server.url)]
        try:
            await asyncio.gather(*(client(replicas[i % 2], i) for i in range(24)))
        finally:
            for replica in replicas:
                await replica.close()

    asyncio.run(run())
    assert admitted["requests"] <= 300 and admitted["tokens"] <= tokens_per_minute
    assert admitted["peak"] <= 12
    assert binding in refusals and "concurrent_requests" in refusals
    assert _counted(redis_server.url, tenant) == (admitted["requests"], admitted["tokens"])
    assert not redis.Redis.from_url(redis_server.url).hgetall(
        f"splitserve:limits:{{{tenant}}}:slots"
    )


def test_an_idle_replicas_lease_starves_another_by_at_most_an_eighth_briefly(
    redis_server, fresh_minute, monkeypatch
):
    """One replica admits bursts, so its lease grows, then goes quiet holding what it leased;
    the other is refused once the rest is used: short of the limit by exactly that lease, at
    most LEASE_FRACTION of the limit. Once the quiet lease is IDLE_S old the background pass
    gives it back, and the other admits up to the limit exactly."""
    limit = 400  # bursts large against it: the lease is held to an eighth, not to their use
    monkeypatch.setattr(lease, "IDLE_S", 60.0)  # the quiet replica keeps its lease, for now

    async def admit_until_refused(replica: RateLimiter) -> int:
        num_admitted = 0
        while (await replica.admit("starve", "", Ask(requests_per_minute=limit))).refused is None:
            num_admitted += 1
        return num_admitted

    async def run() -> tuple[int, int, int, int]:
        quiet, busy = RateLimiter(redis_server.url), RateLimiter(redis_server.url)
        ask = Ask(requests_per_minute=limit)
        try:
            for _ in range(3):
                burst = await asyncio.gather(*(quiet.admit("starve", "", ask) for _ in range(64)))
                assert {admission.refused for admission in burst} == {None}
            leased = _counted(redis_server.url, "starve")[0] - NUM_QUIET
            num_busy = await admit_until_refused(busy)
            monkeypatch.setattr(lease, "IDLE_S", 0.2)
            await asyncio.sleep(0.2 + 2 * limits.TEND_S)
            charged_when_returned = _counted(redis_server.url, "starve")[0]
            return (
                leased,
                num_busy,
                charged_when_returned,
                num_busy + await admit_until_refused(busy),
            )
        finally:
            await quiet.close()
            await busy.close()

    leased, num_busy, charged_when_returned, num_busy_in_all = asyncio.run(run())
    assert 0 < leased <= limit / 8  # the bound docs/security.md gives (LEASE_FRACTION)
    assert limit - NUM_QUIET - num_busy == leased  # refused short of the limit by the lease alone
    assert charged_when_returned == NUM_QUIET + num_busy
    assert NUM_QUIET + num_busy_in_all == limit


NUM_QUIET = 3 * 64


def test_a_request_past_what_its_lease_has_left_is_checked_in_redis(redis_server, fresh_minute):
    """A lease with tokens left, but fewer than the next request asks: that request goes to
    Redis (one call), and every token it and the others asked is charged there in the end."""
    client = redis.Redis.from_url(redis_server.url)

    async def run() -> tuple[int, dict[str, int]]:
        limiter = RateLimiter(redis_server.url)
        ask = Ask(num_tokens=100, tokens_per_minute=10_000)
        try:
            await asyncio.gather(*(limiter.admit("past-lease", "", ask) for _ in range(8)))
            tokens_left = limiter._leases["past-lease"].tokens_left
            before = _command_calls(client)
            big = Ask(num_tokens=tokens_left + 100, tokens_per_minute=10_000)
            assert (await limiter.admit("past-lease", "", big)).refused is None
            return tokens_left, _delta(before, _command_calls(client))
        finally:
            await limiter.close()

    tokens_left, calls = asyncio.run(run())
    assert tokens_left > 0 and calls["evalsha"] == 1
    assert _counted(redis_server.url, "past-lease")[1] == 8 * 100 + tokens_left + 100


def test_a_dead_replicas_slots_are_forgotten_once_its_lease_expires(redis_server, monkeypatch):
    monkeypatch.setattr(lease_script, "SLOT_LEASE_S", 0.5)

    async def run() -> list[bool]:
        dead, alive = RateLimiter(redis_server.url), RateLimiter(redis_server.url)
        try:
            for request_id in ("d1", "d2"):  # held by a replica that then calls no more
                assert (await dead.enter("expiry", request_id, 2))[0]
            taken = [(await alive.enter("expiry", "a1", 2))[0]]
            await asyncio.sleep(0.7)
            taken.append((await alive.enter("expiry", "a1", 2))[0])
            return taken
        finally:
            await dead.close()
            await alive.close()

    assert asyncio.run(run()) == [False, True]


def _slot_call(replica_id: str, now: float, num_waiters: int) -> lease_script.LeaseCall:
    """A call that asks one concurrent slot for each of `num_waiters` requests, at a replica
    whose clock reads `now`."""
    take = lease_script.WaiterAsk(False, None, lease_script.SlotAsk.TAKE)
    return lease_script.LeaseCall(
        "skew", replica_id, now, lease_script.TenantLimits(concurrent_requests=2),
        0, 0, False, 0, 0, 0, 0, (take,) * num_waiters,
    )


def test_slot_leases_expire_by_redis_clock_not_a_replicas(redis_server):
    # Replica b's clock runs an hour ahead of a's: read by its own clock, a's live slots
    # would look long expired to it, and b would take slots past the tenant's limit of two.
    client = redis.Redis.from_url(redis_server.url)

    def send(call: lease_script.LeaseCall) -> lease_script.LeaseReply:
        keys = call.keys()
        reply = client.eval(lease_script.LEASE_SCRIPT, len(keys), *keys, *call.args())
        return lease_script.LeaseReply.parse(reply)

    try:
        now = time.time()
        held = send(_slot_call("replica-a", now, 2))
        ahead = send(_slot_call("replica-b", now + 3600.0, 1))
        behind = send(_slot_call("replica-c", now - 3600.0, 1))
    finally:
        client.close()
    assert held.verdicts == (None, None) and held.num_slots_held == 2
    assert ahead.verdicts == ("concurrent_requests",) and ahead.num_slots_elsewhere == 2
    assert behind.verdicts == ("concurrent_requests",)


def test_a_call_whose_reply_was_lost_never_lets_two_replicas_past_the_slot_limit(
    redis_server, monkeypatch
):
    # A trim that ran in Redis (this replica's count set down to its slots in use) but whose
    # reply never came back: the lease must not go on admitting into the slots it gave up.
    monkeypatch.setattr(limits, "REDIS_RETRY_S", 0.0)  # no outage fallback in the way
    limit = 10

    async def run() -> tuple[int, int]:
        a, b = RateLimiter(redis_server.url), RateLimiter(redis_server.url)
        ask = Ask(concurrent_requests=limit)
        try:
            for i in range(limit):
                assert (await a.admit("lost", f"a{i}", ask)).refused is None
            held = a._leases["lost"]
            held.is_calling = True  # eight finish while a call is under way: none goes back
            for i in range(8):
                a.leave_soon("lost", f"a{i}", True)
            held.is_calling = False
            real_call = a._script.call

            async def reply_lost(keys, args):
                await real_call(keys, args)
                raise redis.exceptions.TimeoutError("Timeout reading from socket")

            a._script.call = reply_lost
            trim = held.tend_call(time.time(), time.monotonic())
            assert trim is not None
            await a._run(held, trim)
            a._script.call = real_call
            admitted = []
            for replica, prefix in ((b, "b"), (a, "c")):
                for i in range(limit):
                    admission = await replica.admit("lost", f"{prefix}{i}", ask)
                    admitted.append(admission.refused is None)
            return 2 + sum(admitted), sum(admitted)
        finally:
            await a.close()
            await b.close()

    running, newly_admitted = asyncio.run(run())
    assert running == limit  # two still running, and exactly the eight freed slots taken again
    assert newly_admitted == limit - 2


def test_a_request_cancelled_just_after_its_admission_gives_its_slot_back(redis_server):
    async def run() -> list[bool]:
        limiter = RateLimiter(redis_server.url)
        real_answer = limiter._answer
        task: asyncio.Task | None = None

        def answer_then_cancel(held, waiter, admission) -> None:
            real_answer(held, waiter, admission)
            assert task is not None
            task.cancel()  # the server cancels the request's task as its admission is set

        limiter._answer = answer_then_cancel
        try:
            task = asyncio.create_task(limiter.admit("gone", "r1", Ask(concurrent_requests=2)))
            with pytest.raises(asyncio.CancelledError):
                await task
            limiter._answer = real_answer
            await limiter.drain()
            again = [await limiter.enter("gone", f"r{i}", 2) for i in (2, 3)]
            return [taken for taken, _ in again]
        finally:
            await limiter.close()

    assert asyncio.run(run()) == [True, True]  # the cancelled request's slot came back


def test_a_request_cancelled_while_it_waits_for_a_call_is_not_charged(redis_server):
    tenant = "cancelled-waiter"

    async def run() -> None:
        limiter = RateLimiter(redis_server.url)
        ask = Ask(num_tokens=7, requests_per_minute=5, tokens_per_minute=100)
        try:
            # Both fall short of an empty lease in one turn: they wait for the same call,
            # which the first request's cancel (its client gone) reaches first.
            gone = asyncio.create_task(limiter.admit(tenant, "gone", ask))
            kept = asyncio.create_task(limiter.admit(tenant, "kept", ask))
            await asyncio.sleep(0)
            gone.cancel()
            assert (await kept).refused is None
            with pytest.raises(asyncio.CancelledError):
                await gone
        finally:
            await limiter.close()  # what the lease held beyond "kept" goes back

    asyncio.run(run())
    assert _counted(redis_server.url, tenant) == (1, 7)
