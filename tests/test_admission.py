"""Admission control through real processes (issue 35): one decode pod that runs one row at a
time (--max-num-seqs 1), so a second request must queue, and gateways in front of it with
--admission and a key file of two tenants. Shows refusal before any prefill, fair sharing
between a flooding tenant and a quiet one, the queue timeout, a queued request cancelled by
its client, gRPC's codes, and a gateway without admission refusing an SLO header."""

from __future__ import annotations

import http.client
import json
import re
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

import grpc
import pytest

from splitserve.v1 import generate_pb2, generate_pb2_grpc
from tests.services_util import (
    MODEL_NAME,
    Stack,
    decode_stats,
    free_port,
    start_gateway,
    start_stack,
)

KEY_FLOOD = "sk-flood-0123456789"
KEY_QUIET = "sk-quiet-0123456789"
KEYS = [{"key": KEY_FLOOD, "tenant": "flood"}, {"key": KEY_QUIET, "tenant": "quiet"}]
QUEUE_TIMEOUT_S = 1.0  # the second gateway's
LONG_TOKENS = 160  # a request that holds the pod's one row for a few seconds


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Iterator[Stack]:
    key_file = tmp_path_factory.mktemp("keys") / "keys.json"
    key_file.write_text(json.dumps(KEYS))
    keys = ["--api-keys", str(key_file)]
    stack = start_stack(
        decode_flags=["--max-num-seqs", "1"],
        gateway_flags=[*keys, "--admission", "--queue-timeout", "60"],
    )
    try:
        ports = {name: (free_port(), free_port()) for name in ("short-queue", "open")}
        short = [*keys, "--admission", "--queue-timeout", str(QUEUE_TIMEOUT_S)]
        start_gateway(stack, "short-queue", *ports["short-queue"], short)
        start_gateway(stack, "open", *ports["open"], keys)  # no --admission
        stack.ports = ports  # type: ignore[attr-defined]
        stack.wait_healthy()
        _wait_for_fitted_costs(stack)
        yield stack
    finally:
        stack.stop()


def _url(stack: Stack, gateway: str = "") -> str:
    if not gateway:
        return stack.base_url
    return f"http://127.0.0.1:{stack.ports[gateway][0]}"  # type: ignore[attr-defined]


def _post(
    url: str, key: str, max_tokens: int, headers: dict[str, str] | None = None
) -> tuple[int, dict, dict[str, str]]:
    """(status, body, response headers) of one completion that runs `max_tokens` tokens."""
    body = {
        "model": MODEL_NAME,
        "prompt": "Count to one hundred: one, two, three,",
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "temperature": 0,
    }
    request = urllib.request.Request(
        f"{url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        | (headers or {}),
    )
    try:
        with urllib.request.urlopen(request, timeout=120) as response:
            return response.status, json.loads(response.read()), _lower(response.headers)
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read()), _lower(error.headers)


def _lower(headers) -> dict[str, str]:
    return {name.lower(): value for name, value in headers.items()}


def _in_background(target, *args) -> tuple[threading.Thread, list]:
    """Runs `target(*args)` in a thread; its result lands in the returned list."""
    result: list = []
    thread = threading.Thread(target=lambda: result.append(target(*args)), daemon=True)
    thread.start()
    return thread, result


def _metric(url: str, name: str, labels: str = "") -> float:
    request = urllib.request.Request(
        f"{url}/metrics", headers={"Authorization": f"Bearer {KEY_QUIET}"}
    )
    text = urllib.request.urlopen(request, timeout=10).read().decode()
    labelled = r"\{" + re.escape(labels) + r"\}" if labels else ""
    found = re.search("^" + re.escape(name) + labelled + r" (\S+)$", text, re.MULTILINE)
    return float(found.group(1)) if found else 0.0


def _wait_for(condition, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out waiting"
        time.sleep(0.05)


def _wait_for_fitted_costs(stack: Stack) -> None:
    """Predictions need the pod's fitted step costs: a few requests' steps give them."""
    deadline = time.monotonic() + 60
    while decode_stats(stack.decode_addresses[0]).step_base_ms <= 0:
        assert time.monotonic() < deadline, "the decode pod never reported fitted step costs"
        assert _post(_url(stack, "open"), KEY_QUIET, 16)[0] == 200
    time.sleep(1.0)  # the gateways' next polls carry them


def _queued(url: str) -> float:
    return _metric(url, "splitserve:admission_queued_requests")


def _hold_the_row(url: str, key: str = KEY_FLOOD) -> tuple[threading.Thread, list]:
    """A long request in flight on the pod's one row, admitted by the gateway at `url`."""
    thread, result = _in_background(_post, url, key, LONG_TOKENS)
    _wait_for(lambda: _metric(url, "splitserve:admission_rows_in_flight") >= 1)
    return thread, result


# ---- refusal before prefill ------------------------------------------------------------------


def test_a_request_no_pod_can_serve_in_time_is_refused_before_any_prefill(stack):
    address = stack.decode_addresses[0]
    before = decode_stats(address).prefix_cache_queried_tokens
    start = time.perf_counter()
    status, body, headers = _post(stack.base_url, KEY_QUIET, 8, {"x-slo-ttft-ms": "1"})
    elapsed = time.perf_counter() - start
    assert status == 429, body
    assert body["error"]["code"] == "slo" and "time to first token" in body["error"]["message"]
    assert int(headers["retry-after"]) >= 1
    assert elapsed < 1.0
    assert decode_stats(address).prefix_cache_queried_tokens == before  # nothing reached it
    assert _metric(stack.base_url, "splitserve:admission_total", 'outcome="refused",reason="slo"')


def test_a_bad_slo_header_is_a_400_naming_it(stack):
    status, body, _ = _post(stack.base_url, KEY_QUIET, 8, {"x-slo-tpot-ms": "soon"})
    assert status == 400 and body["error"]["param"] == "x-slo-tpot-ms"


def test_without_admission_an_slo_header_is_a_400_not_ignored(stack):
    status, body, _ = _post(_url(stack, "open"), KEY_QUIET, 8, {"x-slo-ttft-ms": "3000"})
    assert status == 400
    assert body["error"]["param"] == "x-slo-ttft-ms" and "--admission" in body["error"]["message"]


def test_grpc_refusal_is_resource_exhausted(stack):
    with grpc.insecure_channel(stack.grpc_address) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        request = generate_pb2.GenerateRequest(
            model=MODEL_NAME, text="Hello", sampling=generate_pb2.SamplingOptions(max_tokens=4)
        )
        metadata = [("authorization", f"Bearer {KEY_QUIET}"), ("x-slo-ttft-ms", "1")]
        with pytest.raises(grpc.RpcError) as caught:
            stub.Generate(request, metadata=metadata, timeout=30)
    assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "SLO" in caught.value.details()
    trailers = dict(caught.value.trailing_metadata())
    assert int(trailers["retry-after"]) >= 1


# ---- the queue -------------------------------------------------------------------------------


def test_a_saturated_pool_refuses_at_once_what_would_wait_past_its_slo(stack):
    url = stack.base_url
    holder, held = _hold_the_row(url)
    start = time.perf_counter()
    status, body, headers = _post(url, KEY_QUIET, 8, {"x-slo-ttft-ms": "300"})
    elapsed = time.perf_counter() - start
    holder.join()
    assert held[0][0] == 200
    assert status == 503, body
    assert body["error"]["code"] == "saturated" and int(headers["retry-after"]) >= 1
    assert elapsed < 1.0


# make test stays well under 15 min: ~6 s; test_admission_units checks the fair queue
@pytest.mark.slow
def test_a_flooding_tenant_does_not_push_another_to_the_back(stack):
    url = stack.base_url
    finished: list[str] = []
    lock = threading.Lock()

    def one(tenant: str, key: str) -> int:
        status = _post(url, key, 12)[0]
        with lock:
            finished.append(tenant)
        return status

    threads = [_in_background(one, "flood", KEY_FLOOD) for _ in range(6)]
    _wait_for(lambda: _queued(url) >= 5)  # one runs, five wait
    threads += [_in_background(one, "quiet", KEY_QUIET) for _ in range(2)]
    for thread, _ in threads:
        thread.join()
    assert all(result == [200] for _, result in threads)
    # First come first served would finish the quiet tenant's two last (7th and 8th); fair
    # share interleaves them with the flood's next ones.
    quiet_places = [place for place, tenant in enumerate(finished) if tenant == "quiet"]
    assert max(quiet_places) <= 4, finished


@pytest.mark.slow  # make test stays well under 15 min: ~7 s
def test_a_request_queued_past_the_timeout_gets_408(stack):
    url = _url(stack, "short-queue")
    holder, held = _hold_the_row(url)
    start = time.perf_counter()
    status, body, headers = _post(url, KEY_QUIET, 8)
    waited = time.perf_counter() - start
    holder.join()
    assert held[0][0] == 200
    assert status == 408, body
    assert body["error"]["code"] == "queue_timeout" and "retry-after" in headers
    assert QUEUE_TIMEOUT_S * 0.9 <= waited < QUEUE_TIMEOUT_S + 2.0


@pytest.mark.slow  # make test stays well under 15 min: ~9 s
def test_a_queued_request_whose_client_leaves_frees_its_place_at_once(stack):
    url = stack.base_url
    holder, held = _hold_the_row(url)
    admitted = _metric(url, "splitserve:admission_total", 'outcome="admitted",reason="queued"')
    port = int(url.rsplit(":", 1)[1])
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    body = json.dumps({"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 4, "stream": True})
    headers = {"Authorization": f"Bearer {KEY_QUIET}", "Content-Type": "application/json"}
    connection.request("POST", "/v1/completions", body, headers)
    _wait_for(lambda: _queued(url) == 1)
    connection.close()  # the client goes away while its request waits
    _wait_for(lambda: _queued(url) == 0, timeout_s=5.0)
    assert holder.is_alive(), "the place was freed while the row was still held"
    holder.join()
    assert held[0][0] == 200
    # It left the queue without being admitted, so it never reached the pod.
    after = _metric(url, "splitserve:admission_total", 'outcome="admitted",reason="queued"')
    assert after == admitted
    assert _post(url, KEY_QUIET, 4)[0] == 200  # and the pool serves the next one


def test_metrics_count_decisions_and_slo_results(stack):
    url = stack.base_url
    assert _post(url, KEY_QUIET, 8, {"x-slo-ttft-ms": "60000", "x-slo-tpot-ms": "60000"})[0] == 200
    assert _metric(url, "splitserve:slo_requests_total", 'result="met"') >= 1
    assert _metric(url, "splitserve:admission_prediction_ratio_count", 'metric="ttft"') >= 1
