"""Prometheus metrics of a real gateway, decode pod and prefill pod (three processes): every
/metrics parses with prometheus_client's text parser, and after N requests each series has
moved by what those requests account for."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from splitserve.pod.metrics import PREFIX
from tests.services_util import MODEL_NAME, free_port, start_stack

NUM_REQUESTS = 2
PROMPT_TOKENS = 40  # past the decode pod's local-prefill threshold: every prompt goes remote
MAX_TOKENS = 3
DASHBOARD = Path(__file__).parent.parent / "charts/splitserve/dashboards/splitserve.json"


@pytest.fixture(scope="module")
def stack():
    decode_port, prefill_port = free_port(), free_port()
    started = start_stack(
        num_prefill=1,
        decode_flags=["--metrics-port", str(decode_port)],
        prefill_flags=["--metrics-port", str(prefill_port)],
    )
    try:
        started.wait_healthy()
        started.metrics_urls = {
            "gateway": f"{started.base_url}/metrics",
            "decode": f"http://127.0.0.1:{decode_port}/metrics",
            "prefill": f"http://127.0.0.1:{prefill_port}/metrics",
        }
        yield started
    finally:
        started.stop()


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample as (name, sorted labels) -> value, through the Prometheus text parser."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def total(samples: dict, name: str, **labels: str) -> float:
    """The sum over every series of `name` whose labels include `labels`."""
    wanted = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and wanted <= set(ls))


def complete(stack, index: int) -> dict:
    prompt = [2000 + 50 * index + i for i in range(PROMPT_TOKENS)]  # nothing cached before
    body = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True}
    request = urllib.request.Request(
        f"{stack.base_url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.load(response)


def test_metrics_move_by_what_the_requests_did(stack):
    before = {name: scrape(url) for name, url in stack.metrics_urls.items()}
    for index in range(NUM_REQUESTS):
        assert complete(stack, index)["usage"]["completion_tokens"] == MAX_TOKENS
    after = {name: scrape(url) for name, url in stack.metrics_urls.items()}

    def moved(service: str, name: str, **labels: str) -> float:
        return total(after[service], name, **labels) - total(before[service], name, **labels)

    n = NUM_REQUESTS
    for role in ("decode", "prefill"):
        for histogram in ("time_to_first_token_seconds", "e2e_request_latency_seconds"):
            assert moved(role, f"{PREFIX}{histogram}_count", role=role) == n
        assert moved(role, f"{PREFIX}request_queue_time_seconds_count") == n
        assert moved(role, f"{PREFIX}prompt_tokens_total") == n * PROMPT_TOKENS
        assert moved(role, f"{PREFIX}num_requests_running") == 0
        assert total(after[role], f"{PREFIX}num_kv_blocks_total") > 0
        assert total(after[role], f"{PREFIX}spec_decode_num_draft_tokens_total") == 0

    # The decode pod generated every token and saw the gaps between them; the prefill pod
    # computed each prompt (and its first token) and sent its pages.
    assert moved("decode", f"{PREFIX}generation_tokens_total") == n * MAX_TOKENS
    assert moved("decode", f"{PREFIX}inter_token_latency_seconds_count") == n * (MAX_TOKENS - 1)
    assert moved("decode", f"{PREFIX}request_success_total", finished_reason="length") == n
    assert moved("decode", f"{PREFIX}remote_prefill_requests_total", mode="remote") == n
    assert moved("prefill", f"{PREFIX}generation_tokens_total") == n
    assert moved("prefill", f"{PREFIX}request_prefill_time_seconds_count") == n
    assert moved("prefill", f"{PREFIX}prefix_cache_queries_total") == n * PROMPT_TOKENS
    sent = moved("prefill", f"{PREFIX}kv_transfer_bytes_total", direction="send")
    received = moved("decode", f"{PREFIX}kv_transfer_bytes_total", direction="receive")
    assert sent > 0 and sent == received
    assert moved("prefill", f"{PREFIX}kv_transfer_time_seconds_count", transport="tcp") == n

    # The gateway: its own request view and one routing decision per sequence.
    assert moved("gateway", "splitserve_prompt_tokens_total") == n * PROMPT_TOKENS
    assert moved("gateway", "splitserve_generation_tokens_total") == n * MAX_TOKENS
    assert moved("gateway", f"{PREFIX}routing_decisions_total") == n
    assert moved("gateway", f"{PREFIX}routing_prompt_tokens_total") == n * PROMPT_TOKENS


def test_every_pod_series_names_its_model_and_role(stack):
    for role in ("decode", "prefill"):
        samples = scrape(stack.metrics_urls[role])
        ours = [labels for (name, labels) in samples if name.startswith(PREFIX)]
        assert ours
        for labels in ours:
            assert ("role", role) in labels and ("model_name", MODEL_NAME) in labels


def test_pods_expose_what_splitserve_env_reports(stack):
    """`splitserve:environment_info`: the pod's versions and CPU paths as labels of a 1."""
    import torch

    from splitserve.kernels import cpu as cpu_kernels

    loaded = cpu_kernels.load() is not None  # the pods run on this machine
    for role in ("decode", "prefill"):
        samples = scrape(stack.metrics_urls[role])
        (labels,) = [dict(ls) for (n, ls) in samples if n == f"{PREFIX}environment_info"]
        assert labels["role"] == role and labels["model_name"] == MODEL_NAME
        assert labels["versions_torch"] == torch.__version__
        assert labels["cpu_kernels"].startswith("loaded" if loaded else "unavailable: ")
        assert {"quantization_int8", "quantization_int4", "quantization_gguf"} <= set(labels)
        assert "dtypes_bfloat16" in labels and labels["cpu_kernel_isa_name"]


def test_dashboard_queries_only_series_the_services_expose(stack):
    complete(stack, NUM_REQUESTS)  # so every labelled series (routing reasons...) exists
    exposed = {name for url in stack.metrics_urls.values() for (name, _) in scrape(url)}
    with open(DASHBOARD) as file:
        dashboard = json.load(file)
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    queried = {name for expr in exprs for name in re.findall(r"splitserve[:_][a-z0-9_:]+", expr)}
    assert queried and queried <= exposed, queried - exposed
