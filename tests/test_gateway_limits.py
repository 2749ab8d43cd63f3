"""The key file and the rate limiter on their own: key files refused with the entry named,
look-ups by key and by its SHA-256, the tenant's cache salt, and the limiter against a real
redis-server: shared counts, the sliding window, the running set, and a Redis that goes away
(the limiter keeps counting in its own process and says so in the log)."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging

import pytest

from splitserve.common.redis_server import RedisServer
from splitserve.engine.kv.block_hash import quota_tenant, tenant_cache_salt
from splitserve.gateway.auth.keys import KeyRing, api_key_from_headers
from splitserve.gateway.auth.limits import WINDOW_S, RateLimiter, _window_use


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
