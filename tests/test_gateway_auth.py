"""API keys, tenants, limits and request bounds at the gateway (issue 34), against real
processes: a redis-server, one decode pod registered there, and two gateway replicas sharing
that Redis, both given the same key file. HTTP through the openai client and raw requests,
gRPC through the generated stub.
"""

from __future__ import annotations

import hashlib
import http.client
import json
import random
import statistics
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator

import grpc
import pytest
import redis
from openai import OpenAI, RateLimitError

from splitserve.common.redis_server import RedisServer
from splitserve.gateway.bounds import MAX_LOGIT_BIAS, MAX_STOP, MAX_TOOLS
from splitserve.v1 import generate_pb2, generate_pb2_grpc
from tests.services_util import (
    MODEL_NAME,
    Stack,
    free_port,
    start_gateway,
    start_stack,
    wait_until_idle,
)

KEY_A = "sk-team-a-0123456789"
KEY_B = "sk-team-b-0123456789"  # given to the gateways as its SHA-256 only
KEY_RPM = "sk-rpm-0123456789"
KEY_TPM = "sk-tpm-0123456789"
KEY_CONCURRENT = "sk-concurrent-0123456789"
KEY_SHARED = "sk-shared-0123456789"
KEY_ROOMY = "sk-roomy-0123456789"
# Small enough that a replica leases nothing beyond each request (auth/lease.py): what Redis
# says is left is all there is.
ROOMY_RPM = 8
MAX_REQUEST_BYTES = 1 << 20
SHARED_RPM = 4
KEYS = [
    {"key": KEY_A, "tenant": "team-a"},
    {"key_sha256": hashlib.sha256(KEY_B.encode()).hexdigest(), "tenant": "team-b"},
    {"key": KEY_RPM, "tenant": "rpm", "requests_per_minute": 3},
    {"key": KEY_TPM, "tenant": "tpm", "tokens_per_minute": 400},
    {"key": KEY_CONCURRENT, "tenant": "concurrent", "concurrent_requests": 1},
    {"key": KEY_SHARED, "tenant": "shared", "requests_per_minute": SHARED_RPM},
    {"key": KEY_ROOMY, "tenant": "roomy", "requests_per_minute": ROOMY_RPM},
]
# Long enough for several full KV blocks (16 tokens each).
PROMPT = "Here is a list of fruits: apple, banana, cherry, date, elderberry, fig, grape. " * 4


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="module")
def stack(redis_server, tmp_path_factory) -> Iterator[Stack]:
    key_file = tmp_path_factory.mktemp("keys") / "keys.json"
    key_file.write_text(json.dumps(KEYS))
    flags = ["--redis-url", redis_server.url, "--api-keys", str(key_file)]
    flags += ["--max-request-bytes", str(MAX_REQUEST_BYTES)]
    stack = start_stack(decode_flags=["--redis-url", redis_server.url], gateway_flags=flags)
    try:
        stack.replica_port = free_port()  # type: ignore[attr-defined]
        start_gateway(stack, "gateway-1", stack.replica_port, free_port(), flags)  # type: ignore[attr-defined]
        yield stack.wait_healthy()
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def replica_url(stack) -> str:
    return f"http://127.0.0.1:{stack.replica_port}"


def _client(stack: Stack, key: str, base_url: str | None = None) -> OpenAI:
    base = base_url or stack.base_url
    return OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=120)


def _request(
    url: str, body: bytes | None = None, headers: dict[str, str] | None = None
) -> tuple[int, dict, dict[str, str]]:
    """(status, JSON body or {}, lower-case headers) of a raw request."""
    request = urllib.request.Request(url, data=body, headers=headers or {})
    if body is not None:
        request.add_header("Content-Type", "application/json")
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            status, raw, got = response.status, response.read(), response.headers
    except urllib.error.HTTPError as error:
        status, raw, got = error.code, error.read(), error.headers
    try:
        parsed = json.loads(raw)
    except ValueError:
        parsed = {}
    return status, parsed, {k.lower(): v for k, v in got.items()}


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _chat(stack: Stack, key: str, text: str, **options) -> object:
    return _client(stack, key).chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": text}],
        max_tokens=options.pop("max_tokens", 2),
        temperature=0.0,
        **options,
    )


# ---- keys ------------------------------------------------------------------------------------


@pytest.mark.parametrize("headers", [{}, _bearer("sk-wrong-0123456789"), {"x-api-key": "nope"}])
def test_no_key_or_a_wrong_key_is_a_401_with_openais_body(stack, headers):
    body = json.dumps({"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}]})
    status, error, _ = _request(f"{stack.base_url}/v1/chat/completions", body.encode(), headers)
    assert status == 401
    assert error["error"]["type"] == "invalid_request_error"
    assert error["error"]["code"] in ("missing_api_key", "invalid_api_key")
    assert _request(f"{stack.base_url}/v1/models", None, headers)[0] == 401


def test_bearer_and_x_api_key_both_admit(stack):
    for headers in (_bearer(KEY_A), {"x-api-key": KEY_B}):
        status, models, _ = _request(f"{stack.base_url}/v1/models", None, headers)
        assert status == 200, models
        assert models["data"][0]["id"] == MODEL_NAME


def test_anthropics_sdk_key_admits_and_a_wrong_one_gets_anthropics_401(stack):
    import anthropic  # optional: the test extras install it; the gateway never imports it

    def client(key: str) -> anthropic.Anthropic:  # the SDK sends its key as x-api-key
        return anthropic.Anthropic(base_url=stack.base_url, api_key=key, max_retries=0)

    message = client(KEY_B).messages.create(
        model=MODEL_NAME, max_tokens=4, messages=[{"role": "user", "content": "Hi"}]
    )
    assert message.usage.output_tokens > 0
    with pytest.raises(anthropic.AuthenticationError) as refused:
        client("sk-wrong-0123456789").messages.create(
            model=MODEL_NAME, max_tokens=4, messages=[{"role": "user", "content": "Hi"}]
        )
    assert refused.value.status_code == 401
    assert refused.value.body["type"] == "error"
    assert refused.value.body["error"]["type"] == "authentication_error"


def test_health_is_open_and_metrics_guarded(stack):
    assert _request(f"{stack.base_url}/health")[0] == 200
    assert _request(f"{stack.base_url}/metrics")[0] == 401
    _chat(stack, KEY_A, "Say hi.")
    request = urllib.request.Request(f"{stack.base_url}/metrics", headers=_bearer(KEY_A))
    with urllib.request.urlopen(request, timeout=10) as response:
        text = response.read().decode()
    assert 'splitserve_tenant_requests_total{status="200",tenant="team-a"}' in text
    assert "splitserve_unauthenticated_requests_total" in text


def _gateway_time_count(stack: Stack) -> float:
    request = urllib.request.Request(f"{stack.base_url}/metrics", headers=_bearer(KEY_A))
    with urllib.request.urlopen(request, timeout=10) as response:
        text = response.read().decode()
    return next(
        float(line.split()[-1])
        for line in text.splitlines()
        if line.startswith("splitserve_gateway_time_seconds_count")
    )


def test_without_server_timing_no_header_but_the_gateways_time_is_observed(stack):
    before = _gateway_time_count(stack)
    status, _, headers = _request(
        f"{stack.base_url}/v1/chat/completions", json.dumps(_chat_body()).encode(), _bearer(KEY_A)
    )
    assert status == 200
    assert "server-timing" not in headers  # the gateways here run without --server-timing
    assert _gateway_time_count(stack) == before + 1


def test_grpc_needs_a_key(stack):
    request = generate_pb2.GenerateRequest(
        text="Hello", sampling=generate_pb2.SamplingOptions(max_tokens=2, temperature=0.0)
    )
    with grpc.insecure_channel(stack.grpc_address) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        for metadata in [(), (("authorization", "Bearer sk-wrong-0123456789"),)]:
            with pytest.raises(grpc.RpcError) as caught:
                stub.Generate(request, metadata=metadata, timeout=60)
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.RpcError) as caught:
                next(iter(stub.GenerateStream(request, metadata=metadata, timeout=60)))
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
        for metadata in [(("authorization", f"Bearer {KEY_A}"),), (("x-api-key", KEY_B),)]:
            response = stub.Generate(request, metadata=metadata, timeout=60)
            assert response.usage.completion_tokens == 2


# ---- tenants ---------------------------------------------------------------------------------


def _cached_tokens(stack: Stack, key: str, text: str, **options) -> int:
    response = _chat(stack, key, text, max_tokens=1, **options)
    return response.usage.prompt_tokens_details.cached_tokens  # type: ignore[attr-defined]


def test_a_tenants_cached_prompt_is_not_another_tenants(stack):
    """The chat template's head (the default system turn) is cached per tenant too: each
    tenant's first look at A's prompt finds that head at most, never A's prompt blocks."""
    text = f"{uuid.uuid4().hex} {PROMPT}"
    _cached_tokens(stack, KEY_B, uuid.uuid4().hex)  # B's own template head, cached
    head_b = _cached_tokens(stack, KEY_B, uuid.uuid4().hex)
    first_a = _cached_tokens(stack, KEY_A, text)
    repeat_a = _cached_tokens(stack, KEY_A, text)
    assert repeat_a >= first_a + 64  # A's own repeat hits its prompt's blocks
    assert _cached_tokens(stack, KEY_B, text) == head_b  # B computes A's prompt itself
    # A client salt only narrows within the tenant; none reaches another tenant's blocks.
    assert _cached_tokens(stack, KEY_A, text, extra_body={"cache_salt": "x"}) == 0
    spoof = {"cache_salt": "tenant:team-a"}
    assert _cached_tokens(stack, KEY_B, uuid.uuid4().hex + text, extra_body=spoof) == 0
    assert _cached_tokens(stack, KEY_B, text) == repeat_a  # B's own blocks now serve B


def _ttft(stack: Stack, key: str, text: str) -> float:
    start = time.perf_counter()
    stream = _client(stack, key).chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": text}],
        max_tokens=2,
        temperature=0.0,
        stream=True,
    )
    next(iter(stream))
    elapsed = time.perf_counter() - start
    stream.close()
    return elapsed


@pytest.mark.slow
def test_no_ttft_advantage_for_another_tenants_prompt(stack):
    """Over repeated trials with fresh prompts: A's repeat (a hit) is faster than B's first
    send (a miss), and B's time is that of a cold prompt. Slow: a prompt long enough that its
    prefill dwarfs a busy 2-core machine's noise."""
    long_prompt = PROMPT * 6
    hits, misses, colds = [], [], []
    for _ in range(5):
        text = f"{uuid.uuid4().hex} {long_prompt}"
        colds.append(_ttft(stack, KEY_A, text))
        hits.append(_ttft(stack, KEY_A, text))
        misses.append(_ttft(stack, KEY_B, text))
    assert statistics.median(hits) < 0.7 * statistics.median(misses), (hits, misses)
    assert statistics.median(misses) > 0.7 * statistics.median(colds), (misses, colds)


# ---- limits ----------------------------------------------------------------------------------


def test_a_tenant_over_its_requests_per_minute_gets_429_while_another_is_served(stack):
    url = f"{stack.base_url}/v1/models"
    remaining = []
    for _ in range(3):
        status, _, headers = _request(url, None, _bearer(KEY_RPM))
        assert status == 200
        assert headers["x-ratelimit-limit-requests"] == "3"
        remaining.append(int(headers["x-ratelimit-remaining-requests"]))
        assert headers["x-ratelimit-reset-requests"].endswith("s")
    assert remaining == [2, 1, 0]
    status, error, headers = _request(url, None, _bearer(KEY_RPM))
    assert status == 429
    assert error["error"]["code"] == "rate_limit_exceeded"
    assert error["error"]["type"] == "requests"
    assert int(headers["retry-after"]) >= 1
    assert headers["x-ratelimit-remaining-requests"] == "0"
    with pytest.raises(RateLimitError):
        _chat(stack, KEY_RPM, "Hello")
    assert _chat(stack, KEY_A, "Hello").usage.completion_tokens == 2  # type: ignore[attr-defined]


def test_tokens_per_minute_count_prompt_and_max_tokens(stack):
    response = _client(stack, KEY_TPM).chat.completions.with_raw_response.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=200,
        temperature=0.0,
    )
    assert response.headers["x-ratelimit-limit-tokens"] == "400"
    prompt_tokens = response.parse().usage.prompt_tokens  # type: ignore[union-attr]
    assert int(response.headers["x-ratelimit-remaining-tokens"]) == 400 - prompt_tokens - 200
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}]}
    body["max_tokens"] = 200
    url = f"{stack.base_url}/v1/chat/completions"
    status, error, headers = _request(url, json.dumps(body).encode(), _bearer(KEY_TPM))
    assert status == 429, error
    assert error["error"]["type"] == "tokens"
    assert int(headers["retry-after"]) >= 1
    assert headers["x-ratelimit-limit-tokens"] == "400"


def test_concurrent_requests_are_limited_and_released(stack):
    client = _client(stack, KEY_CONCURRENT)
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "user", "content": "Count to one hundred."}],
        max_tokens=200,
        temperature=0.0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    next(iter(stream))  # running
    with pytest.raises(RateLimitError) as caught:
        _chat(stack, KEY_CONCURRENT, "Hello")
    assert caught.value.response.headers["retry-after"] == "1"
    stream.close()
    deadline = time.monotonic() + 10
    while True:  # the slot is freed once the gateway sees the client go
        try:
            _chat(stack, KEY_CONCURRENT, "Hello")
            break
        except RateLimitError:
            assert time.monotonic() < deadline, "the slot was never released"
            time.sleep(0.1)


def test_limits_hold_across_two_gateway_replicas(stack, replica_url):
    urls = [stack.base_url, replica_url] * SHARED_RPM
    statuses = [_request(f"{url}/v1/models", None, _bearer(KEY_SHARED))[0] for url in urls]
    # Each replica alone would allow SHARED_RPM; together they allow SHARED_RPM in all.
    assert statuses[:SHARED_RPM] == [200] * SHARED_RPM
    assert set(statuses[SHARED_RPM:]) == {429}


def _limit_checks(stack: Stack, tenant: str) -> dict[str, float]:
    """The gateway's splitserve_tenant_limit_checks_total for `tenant`, by when."""
    request = urllib.request.Request(f"{stack.base_url}/metrics", headers=_bearer(KEY_A))
    with urllib.request.urlopen(request, timeout=10) as response:
        text = response.read().decode()
    checks = {}
    for when in ("overlapped", "before_send"):
        series = f'splitserve_tenant_limit_checks_total{{tenant="{tenant}",when="{when}"}} '
        line = next((line for line in text.splitlines() if line.startswith(series)), None)
        checks[when] = float(line.split()[-1]) if line is not None else 0.0
    return checks


def test_a_tenant_with_room_is_refused_in_its_first_outputs_place(stack, redis_server):
    """A tenant that had room is checked beside its routing and prefill; another replica
    (here: Redis written directly) used the rest of its minute meanwhile, so the check
    refuses after the request was sent: 429 all the same, the pod's work aborted, no block
    kept. Refused once, the tenant is checked before anything is sent."""
    assert _chat(stack, KEY_ROOMY, "Hello").usage.completion_tokens == 2  # type: ignore[attr-defined]
    assert _chat(stack, KEY_ROOMY, "Hello").usage.completion_tokens == 2  # type: ignore[attr-defined]
    index = int(time.time() // 60)
    client = redis.Redis.from_url(redis_server.url)
    for window in (index, index - 1, index + 1):  # whichever minute the next check falls in
        client.set(f"splitserve:limits:{{roomy}}:requests:{window}", ROOMY_RPM, ex=180)
    before = _limit_checks(stack, "roomy")
    for stream in (True, False):
        body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": PROMPT}]}
        body.update(max_tokens=8, stream=stream)
        url = f"{stack.base_url}/v1/chat/completions"
        status, error, headers = _request(url, json.dumps(body).encode(), _bearer(KEY_ROOMY))
        assert status == 429, error
        assert error["error"]["code"] == "rate_limit_exceeded"
        assert int(headers["retry-after"]) >= 1
    after = _limit_checks(stack, "roomy")
    assert after["overlapped"] - before["overlapped"] == 1
    assert after["before_send"] - before["before_send"] == 1
    stats = wait_until_idle(stack.decode_addresses[0])
    assert stats.kv_blocks_free == stats.kv_blocks_total


# ---- request bounds --------------------------------------------------------------------------


def _post(stack: Stack, path: str, body: bytes | dict) -> tuple[int, dict]:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    status, parsed, _ = _request(f"{stack.base_url}{path}", data, _bearer(KEY_A))
    return status, parsed


def _chat_body(**fields) -> dict:
    body: dict = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "Hi"}]}
    return {**body, "max_tokens": 1, **fields}


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
OVER_BOUNDS = {
    "stop": _chat_body(stop=[f"s{i}" for i in range(MAX_STOP + 1)]),
    "logit_bias": _chat_body(logit_bias={str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}),
    "tools": _chat_body(tools=[TOOL] * (MAX_TOOLS + 1)),
    "messages": _chat_body(messages=[{"role": "user", "content": "a"}] * 4097),
    "messages[0].role": _chat_body(messages=[{"role": "wizard", "content": "Hi"}]),
    "priority": _chat_body(priority=2**31),
    "messages[1].role": _chat_body(messages=[{"role": "user", "content": "a"}, {"role": "x"}]),
}


@pytest.mark.parametrize("param", OVER_BOUNDS)
def test_past_a_bound_is_a_400_naming_the_field(stack, param):
    status, error = _post(stack, "/v1/chat/completions", OVER_BOUNDS[param])
    assert status == 400, error
    assert error["error"]["param"] == param.split("[")[0]  # a message's fault names messages
    assert param.split(".")[-1] in error["error"]["message"]
    assert error["error"]["type"] == "invalid_request_error"


def test_a_body_past_the_size_limit_is_a_400(stack):
    """Refused on its Content-Length, before the body is read (so none is sent here: a client
    still sending would see the connection close under it)."""
    connection = http.client.HTTPConnection("127.0.0.1", stack.http_port, timeout=30)
    try:
        connection.putrequest("POST", "/v1/chat/completions")
        for name, value in {**_bearer(KEY_A), "Content-Type": "application/json"}.items():
            connection.putheader(name, value)
        connection.putheader("Content-Length", str(MAX_REQUEST_BYTES + 1))
        connection.endheaders()
        response = connection.getresponse()
        assert response.status == 400
        assert json.load(response)["error"]["code"] == "request_too_large"
    finally:
        connection.close()


@pytest.mark.parametrize(
    "raw",
    [
        b'{"model": "m", "prompt": "caf\xe9", "max_tokens": 1}',  # latin-1, not UTF-8
        b'{"model": "m", "prompt": "\\ud800 alone", "max_tokens": 1}',
        b'{"model": "m", "prompt": "low \\udc00", "max_tokens": 1}',
    ],
)
def test_text_no_tokenizer_can_take_is_a_400(stack, raw):
    status, error = _post(stack, "/v1/completions", raw)
    assert status == 400, error
    assert error["error"]["code"] == "invalid_encoding"


def test_an_escaped_surrogate_pair_is_text(stack):
    body = _chat_body(messages=[{"role": "user", "content": "smile \ud83d\ude00"}])
    raw = json.dumps(body, ensure_ascii=True).encode()  # the emoji as "\ud83d\ude00"
    assert b"\\ud83d" in raw
    status, answer = _post(stack, "/v1/chat/completions", raw)
    assert status == 200, answer


# ---- fuzz ------------------------------------------------------------------------------------

FUZZ_PATHS = ["/v1/chat/completions", "/v1/completions", "/tokenize", "/v1/responses"]
SEEDS = [
    _chat_body(),
    {"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 1},
    {"model": MODEL_NAME, "prompt": "Hello"},
    {"model": MODEL_NAME, "input": "Hello", "max_output_tokens": 1},
]
ODD_VALUES = [
    10**400, -(10**30), 1e308, float("inf"), -1, 0, 2**63, "", "\u0000", [], {}, None, True,
    [[[[]]]], "a" * 5000, {"role": "wizard"}, [1, "x", None], 0.5,
]  # fmt: skip


def _mutations(rng: random.Random) -> Iterator[bytes]:
    for _ in range(60):
        seed = rng.choice(SEEDS)
        raw = json.dumps(seed).encode()
        kind = rng.randrange(6)
        if kind == 0:  # truncated JSON
            yield raw[: rng.randrange(len(raw))]
        elif kind == 1:  # random bytes flipped, invalid UTF-8 among them
            data = bytearray(raw)
            for _ in range(rng.randrange(1, 6)):
                data[rng.randrange(len(data))] = rng.randrange(256)
            yield bytes(data)
        elif kind == 2:  # a field of the wrong type or a huge number
            body = dict(seed)
            name = rng.choice(["max_tokens", "temperature", "n", "stop", "seed", "messages",
                               "prompt", "logprobs", "top_p", "logit_bias", "model"])  # fmt: skip
            value = rng.choice(ODD_VALUES)
            text = json.dumps({**body, name: 0}).replace('"' + name + '": 0', "")
            yield (text[:-1] + f', "{name}": ' + _json_value(value) + "}").encode()
        elif kind == 3:  # deep nesting
            depth = rng.choice([100, 1000, 100_000])
            yield b'{"model": "m", "prompt": ' + b"[" * depth + b"]" * depth + b"}"
        elif kind == 4:  # not an object at all
            yield rng.choice([b"[]", b"null", b"1e999999", b'"text"', b"", b"\xff\xfe"])
        else:  # a lone surrogate somewhere
            yield raw.replace(b"Hello", b"\\udfff") if b"Hello" in raw else raw + b"\\ud800"


def _json_value(value: object) -> str:
    if isinstance(value, int) and not isinstance(value, bool):
        return str(value)  # beyond any float or int64
    if isinstance(value, float):
        return "1e999" if value == float("inf") else repr(value)
    return json.dumps(value)


def test_raw_bytes_fuzz_gets_no_5xx(stack):
    rng = random.Random(34)
    failures = []
    for data in _mutations(rng):
        path = rng.choice(FUZZ_PATHS)
        status, body = _post(stack, path, data)
        if status >= 500:
            failures.append((path, data[:200], status, body))
        else:
            assert status in (200, 400, 404, 422) or status == 413, (path, data[:200], status)
    assert not failures, failures
    assert _chat(stack, KEY_A, "Still there?").usage.completion_tokens == 2  # type: ignore[attr-defined]
