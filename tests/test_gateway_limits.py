"""The key file and the rate limiter on their own: key files refused with the entry named,
look-ups by key and by its SHA-256, the tenant's cache salt, and the limiter against a real
redis-server: shared counts, the sliding window, the running set, one admission checking and
charging every limit in one round trip (counted by Redis's own commandstats) or nothing, and
a Redis that goes away (the limiter keeps counting in its own process and says so in the
log). The HTTP gate is driven in process over a stand-in generation route."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import time

import pytest
import redis
from prometheus_client import CollectorRegistry

from splitserve.common.redis_server import RedisServer
from splitserve.engine.kv.block_hash import quota_tenant, tenant_cache_salt
from splitserve.engine.sampling_params import SamplingParams
from splitserve.gateway.api.http_app import GENERATION_ENDPOINTS
from splitserve.gateway.auth import headroom
from splitserve.gateway.auth.gate import Caller, Gate, current_caller
from splitserve.gateway.auth.http import CHARGED_PATHS, GateMiddleware
from splitserve.gateway.auth.keys import KeyRing, api_key_from_headers
from splitserve.gateway.auth.limits import WINDOW_S, Ask, LimitExceeded, RateLimiter, _window_use
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
    """Requests, tokens and the running set in one script: the first limit over refuses
    (requests, then concurrent requests, then tokens) and no count moves."""
    everything = {"requests_per_minute": 10, "tokens_per_minute": 100, "concurrent_requests": 1}

    async def run() -> list[str | None]:
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
            return refusals
        finally:
            await limiter.close()

    assert asyncio.run(run()) == ["tokens", None, "concurrent_requests", None]
    client = redis.Redis.from_url(redis_server.url)
    index = int(time.time() // WINDOW_S)

    def counted(kind: str) -> int:  # this minute and the last: the minute may have turned
        keys = [f"splitserve:limits:{{atomic-test}}:{kind}:{i}" for i in (index, index - 1)]
        return sum(int(value or 0) for value in client.mget(keys))

    assert (counted("requests"), counted("tokens")) == (2, 70)  # r2's and r4's alone
    assert client.zrange("splitserve:limits:{atomic-test}:running", 0, -1) == [b"r4"]


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


def test_an_admitted_request_makes_one_redis_command_before_its_first_token(redis_server):
    """Counted by Redis itself (INFO commandstats, which also counts the commands a script
    runs): before the first token, one EVALSHA and what its script ran; after the response,
    the slot's ZREM."""
    client = redis.Redis.from_url(redis_server.url)
    limits = {"requests_per_minute": 100, "tokens_per_minute": 10_000, "concurrent_requests": 4}
    at_first_token: list[dict[str, int]] = []

    def on_body(message: dict) -> None:
        if not at_first_token:
            at_first_token.append(_command_calls(client))

    async def run() -> dict[str, int]:
        gate = _gate(redis_server.url, "one-trip", **limits)
        app = GateMiddleware(_generation_route, gate)
        try:
            await _call(app)  # the script loaded, a connection open
            await gate.limiter.drain()  # type: ignore[union-attr]
            before = _command_calls(client)
            messages = await _call(app, on_body=on_body)
            assert messages[0]["status"] == 200
            headers = dict(messages[0]["headers"])
            assert headers[b"x-ratelimit-remaining-requests"] == b"98"
            assert headers[b"x-ratelimit-remaining-tokens"] == str(10_000 - 2 * 15).encode()
            return before
        finally:
            await gate.close()  # waits for the slots queued for release

    before = asyncio.run(run())
    assert _delta(before, at_first_token[0]) == {
        "evalsha": 1,  # the one round trip; the rest ran inside it
        "get": 4,  # requests and tokens: this minute's and the last's
        "zremrangebyscore": 1,
        "zcard": 1,
        "incr": 1,
        "incrby": 1,
        "expire": 3,
        "zadd": 1,
    }
    assert _delta(at_first_token[0], _command_calls(client)) == {"zrem": 1}


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


def test_concurrent_admissions_share_pipelines_and_survive_a_script_flush(redis_server):
    """Admissions made at once go out pipelined, each still its own script: of 20 at once
    under a limit of 10, exactly 10 pass. A Redis that lost the script (SCRIPT FLUSH, as after
    a restart) is sent it again, and the calls it refused run."""
    client = redis.Redis.from_url(redis_server.url)

    async def run() -> list[str | None]:
        limiter = RateLimiter(redis_server.url)
        ask = Ask(requests_per_minute=10)
        try:
            client.script_flush()
            admissions = await asyncio.gather(
                *(limiter.admit("pipelined", f"r{i}", ask) for i in range(20))
            )
            return [admission.refused for admission in admissions]
        finally:
            await limiter.close()

    before = _command_calls(client)
    refusals = asyncio.run(run())
    assert refusals.count(None) == 10 and set(refusals) == {None, "requests"}
    calls = _delta(before, _command_calls(client))
    assert calls["evalsha"] == 40 and calls["script|load"] == 1  # all 20 refused, then run


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
        gate = _gate(redis_server.url, "headroom-test", requests_per_minute=10)
        other_replica = _gate(redis_server.url, "headroom-test", requests_per_minute=10)
        try:
            seen = [await _charged(gate, _ask(4, 4))]  # never checked: before anything is sent
            seen.append(await _charged(gate, _ask(4, 4)))  # 8 of 10 left at its last check
            for _ in range(8):  # another replica takes the rest meanwhile
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
