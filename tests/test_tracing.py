"""Tracing: one request through a real gateway, decode pod and prefill pod (three processes,
real gRPC, KV pages over TCP) leaves one trace in the span file, with the parent/child
structure the README's "Observability" section draws; plus the setup and propagation rules
in-process."""

from __future__ import annotations

import json
import time
import urllib.request

import pytest
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from splitserve.common import tracing
from tests.services_util import MODEL_NAME, start_stack

CLIENT_TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
CLIENT_SPAN_ID = "00f067aa0ba902b7"
PROMPT = list(range(1000, 1040))  # 40 tokens: past the decode pod's local-prefill threshold
CHUNK_TOKENS = 16  # the prefill pod's token budget per step, so the prompt takes 3 chunks
MAX_TOKENS = 4


# ---- in-process ---------------------------------------------------------------------------------


@pytest.fixture
def memory_exporter():
    exporter = InMemorySpanExporter()
    tracing.configure_tracing("test-service", environ={}, extra_exporters=[exporter])
    yield exporter
    tracing.shutdown_tracing()


def test_unset_or_none_means_off_and_costs_no_span():
    for environ in ({}, {"OTEL_TRACES_EXPORTER": "none"}, {"OTEL_SDK_DISABLED": "true"}):
        settings = tracing.configure_tracing("svc", environ=environ)
        assert not settings.is_enabled and not tracing.is_enabled()
        span = tracing.start_span("anything")
        assert span is tracing.NO_SPAN and not span.is_recording()
        assert tracing.grpc_metadata() == ()
        incoming = {"traceparent": f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"}
        assert tracing.context_from_headers(incoming) is None


def test_settings_from_env():
    env = {"OTEL_TRACES_EXPORTER": "console, none", "OTEL_SERVICE_NAME": "edge"}
    settings = tracing.TracingSettings.from_env("splitserve-gateway", env)
    assert settings.exporters == ("console",) and settings.service_name == "edge"
    only_file = tracing.TracingSettings.from_env("x", {tracing.TRACES_FILE_ENV: "/tmp/s.jsonl"})
    assert only_file.is_enabled and only_file.exporters == ()
    with pytest.raises(ValueError, match="OTEL_TRACES_EXPORTER"):
        tracing.TracingSettings.from_env("x", {"OTEL_TRACES_EXPORTER": "jaeger"})


def test_context_travels_through_grpc_metadata_and_http_headers(memory_exporter):
    incoming = {"traceparent": f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01"}
    server = tracing.start_span("server", tracing.context_from_headers(incoming))
    metadata = dict(tracing.grpc_metadata(server))
    assert metadata["traceparent"].split("-")[1] == CLIENT_TRACE_ID

    class Call:  # what a grpc ServicerContext offers a handler
        def invocation_metadata(self):
            return tuple(metadata.items())

    callee = tracing.start_span("callee", tracing.context_from_grpc(Call()))
    callee.end()
    server.end()
    records = {
        span.name: tracing.span_record(span) for span in memory_exporter.get_finished_spans()
    }
    assert records["server"]["trace_id"] == records["callee"]["trace_id"] == CLIENT_TRACE_ID
    assert records["server"]["parent_span_id"] == CLIENT_SPAN_ID
    assert records["callee"]["parent_span_id"] == records["server"]["span_id"]
    assert records["server"]["service"] == "test-service"


def test_child_span_records_the_error(memory_exporter):
    with pytest.raises(KeyError), tracing.child_span("step", None):
        raise KeyError("boom")
    (span,) = memory_exporter.get_finished_spans()
    assert tracing.span_record(span)["status"] == "ERROR"


def test_span_scope_ends_the_span_failed_or_plain(memory_exporter):
    failed = tracing.start_span("failed")
    with pytest.raises(KeyError), tracing.span_scope(failed):
        raise KeyError("boom")
    with tracing.span_scope(tracing.start_span("plain")) as plain:
        assert plain.is_recording(), "ended only when the block leaves"
    finished = memory_exporter.get_finished_spans()
    records = {span.name: tracing.span_record(span) for span in finished}
    assert records["failed"]["status"] == "ERROR"
    assert records["plain"]["status"] != "ERROR"


# ---- the real stack ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def traced_stack(tmp_path_factory):
    span_file = str(tmp_path_factory.mktemp("traces") / "spans.jsonl")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(tracing.TRACES_FILE_ENV, span_file)
        patch.delenv("OTEL_SERVICE_NAME", raising=False)
        patch.setenv("OTEL_TRACES_EXPORTER", "none")
        stack = start_stack(
            num_prefill=1,
            prefill_flags=["--max-num-batched-tokens", str(CHUNK_TOKENS)],
        )
    try:
        yield stack.wait_healthy(), span_file
    finally:
        stack.stop()


@pytest.mark.slow  # make test stays well under 15 min: a 1P+1D stack of its own, ~9 s
def test_one_trace_links_gateway_decode_and_prefill(traced_stack):
    stack, span_file = traced_stack
    body = {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    request = urllib.request.Request(
        f"{stack.base_url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={
            "Content-Type": "application/json",
            "traceparent": f"00-{CLIENT_TRACE_ID}-{CLIENT_SPAN_ID}-01",
        },
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        assert json.load(response)["usage"]["completion_tokens"] == MAX_TOKENS

    ends = {"POST /v1/completions", "decode.request", "prefill.request"}
    spans = _wait_for_trace(span_file, CLIENT_TRACE_ID, ends)
    by_name = _by_name(spans)
    assert {span["service"] for span in spans} == {
        "splitserve-gateway",
        "splitserve-decode",
        "splitserve-prefill",
    }

    gateway = _one(by_name, "POST /v1/completions", "splitserve-gateway")
    assert gateway["parent_span_id"] == CLIENT_SPAN_ID
    assert gateway["attributes"][tracing.OUTPUT_TOKENS] == MAX_TOKENS
    for step in ("gateway.validate", "gateway.tokenize", "gateway.route"):
        assert _one(by_name, step, "splitserve-gateway")["parent_span_id"] == gateway["span_id"]
    route = _one(by_name, "gateway.route", "splitserve-gateway")["attributes"]
    assert route["splitserve.route.decode_addresses"] == stack.decode_addresses
    assert route["splitserve.route.prefill_addresses"] == stack.prefill_addresses

    decode = _one(by_name, "decode.request", "splitserve-decode")
    assert decode["parent_span_id"] == gateway["span_id"]
    assert decode["attributes"][tracing.INPUT_TOKENS] == len(PROMPT)
    assert decode["attributes"][tracing.OUTPUT_TOKENS] == MAX_TOKENS
    assert decode["attributes"]["splitserve.prefill_mode"] == "remote"
    assert [event["name"] for event in decode["events"]] == ["first_token", "finish"]
    for step in ("decode.queue", "decode.remote_prefill", "decode.decode"):
        assert _one(by_name, step, "splitserve-decode")["parent_span_id"] == decode["span_id"]
    remote = _one(by_name, "decode.remote_prefill", "splitserve-decode")

    prefill = _one(by_name, "prefill.request", "splitserve-prefill")
    assert prefill["parent_span_id"] == remote["span_id"]
    assert prefill["attributes"][tracing.INPUT_TOKENS] == len(PROMPT)
    chunks = sorted(by_name["prefill.chunk"], key=lambda s: s["start_time_unix_nano"])
    assert all(chunk["parent_span_id"] == prefill["span_id"] for chunk in chunks)
    sizes = [chunk["attributes"]["splitserve.chunk.num_tokens"] for chunk in chunks]
    assert sizes == [16, 16, 8] and prefill["attributes"]["splitserve.num_chunks"] == 3
    _one(by_name, "prefill.queue", "splitserve-prefill")

    send = _one(by_name, "kv_transfer.send", "splitserve-prefill")
    assert send["parent_span_id"] == prefill["span_id"]
    assert send["attributes"]["splitserve.kv.transport"] == "tcp"
    assert send["attributes"]["splitserve.kv.bytes"] > 0
    assert remote["attributes"]["splitserve.kv.bytes"] == send["attributes"]["splitserve.kv.bytes"]

    # Children lie within their parents (one machine, one clock).
    for child, parent in ((decode, gateway), (remote, decode), (prefill, remote), (send, prefill)):
        assert parent["start_time_unix_nano"] <= child["start_time_unix_nano"]
        assert child["end_time_unix_nano"] <= parent["end_time_unix_nano"]


def test_a_short_prompt_prefilled_on_the_decode_pod_has_its_chunks_there(traced_stack):
    """Below the local-prefill threshold the decode pod computes the prompt itself: its own
    queue and chunk spans, and no prefill pod in the trace."""
    stack, span_file = traced_stack
    trace_id, parent_id = "0af7651916cd43dd8448eb211c80319c", "b7ad6b7169203331"
    short_prompt = list(range(2000, 2010))  # 10 tokens: under the threshold of 32
    body = {"model": MODEL_NAME, "prompt": short_prompt, "max_tokens": 2, "ignore_eos": True}
    request = urllib.request.Request(
        f"{stack.base_url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={
            "Content-Type": "application/json",
            "traceparent": f"00-{trace_id}-{parent_id}-01",
        },
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        assert json.load(response)["usage"]["completion_tokens"] == 2

    spans = _wait_for_trace(span_file, trace_id, {"POST /v1/completions", "decode.request"})
    by_name = _by_name(spans)
    assert {span["service"] for span in spans} == {"splitserve-gateway", "splitserve-decode"}
    decode = _one(by_name, "decode.request", "splitserve-decode")
    assert decode["attributes"]["splitserve.prefill_mode"] == "local"
    assert _one(by_name, "decode.queue", "splitserve-decode")["parent_span_id"] == decode["span_id"]
    chunks = by_name["decode.chunk"]
    assert all(chunk["parent_span_id"] == decode["span_id"] for chunk in chunks)
    assert sum(c["attributes"]["splitserve.chunk.num_tokens"] for c in chunks) == len(short_prompt)
    assert "decode.remote_prefill" not in by_name


def _wait_for_trace(path: str, trace_id: str, names: set[str], timeout: float = 15.0):
    """The trace's spans once every span named in `names` has been written (each process
    writes a span when it ends, and the servers' spans end just after their last answer)."""
    deadline = time.monotonic() + timeout
    while True:
        spans = [s for s in tracing.read_span_file(path) if s["trace_id"] == trace_id]
        if names <= {s["name"] for s in spans} or time.monotonic() > deadline:
            return spans
        time.sleep(0.1)


def _by_name(spans: list[dict]) -> dict[str, list[dict]]:
    grouped: dict[str, list[dict]] = {}
    for span in spans:
        grouped.setdefault(span["name"], []).append(span)
    return grouped


def _one(by_name: dict[str, list[dict]], name: str, service: str) -> dict:
    spans = by_name.get(name, [])
    assert len(spans) == 1, f"expected one {name} span, got {len(spans)}"
    assert spans[0]["service"] == service
    return spans[0]
