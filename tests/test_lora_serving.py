"""LoRA adapters through the served system: real pods (1 prefill, 2 decode) on a tiny random
Llama with `--lora-modules`, a real gateway, random PEFT adapters. `"model": <adapter>` gives the
offline engine's tokens with that adapter, locally prefilled and through a prefill pod; the
adapter is listed by /v1/models with its base as parent; unknown adapters are 404
model_not_found (gRPC NOT_FOUND); an adapter loaded at run time over HTTP serves and unloads;
the router sends an adapter's next request to the pod where it is resident."""

from __future__ import annotations

import json
import os
import signal
import time
import urllib.error
import urllib.request

import grpc
import pytest
import torch

from splitserve import LLM, LoRARequest, SamplingParams
from splitserve.cli import build_parser
from splitserve.common.channels import sync_channel
from splitserve.common.convert import options_from_params
from splitserve.common.pod_load import PodLoad
from splitserve.common.supervisor import RestartPolicy
from splitserve.gateway.routing.scoring import (
    Location,
    LoRAResidency,
    PodView,
    RoutingContext,
    decide,
    score_terms,
)
from splitserve.launcher import plan
from splitserve.v1 import generate_pb2, generate_pb2_grpc, worker_pb2, worker_pb2_grpc
from tests.services_util import (
    HttpResult,
    Stack,
    free_port,
    get_json,
    pod_stats,
    prefill_stats,
    start_stack,
)
from tests.test_lora import ADAPTERS, _write_adapter

MODEL_NAME = "tiny-llama"
MAX_TOKENS = 8
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
LORA_FLAGS = ["--max-loras", "2", "--max-lora-rank", "8"]
# Long enough (>= the decode pod's local-prefill threshold of 32 tokens) for a prefill pod.
LONG_PROMPT = (
    "The lighthouse keeper had lived on the island for thirty years. Every evening he climbed "
    "the spiral stairs, trimmed the wick and watched the beam sweep across the dark water."
)


@pytest.fixture(scope="module")
def base_dir(make_tiny_hf_checkpoint) -> str:
    return make_tiny_hf_checkpoint()


@pytest.fixture(scope="module")
def adapter_dirs(base_dir, tmp_path_factory) -> dict[str, str]:
    dirs = {}
    for name in ("alpha", "beta"):
        dirs[name] = str(tmp_path_factory.mktemp(f"served_lora_{name}"))
        _write_adapter(base_dir, dirs[name], ADAPTERS[name])
    return dirs


@pytest.fixture(scope="module")
def prefill_metrics_port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def stack(base_dir, adapter_dirs, prefill_metrics_port):
    model = ["--model", base_dir, "--model-name", MODEL_NAME]
    pod_flags = [*model, "--lora-modules", f"alpha={adapter_dirs['alpha']}", *LORA_FLAGS]
    started = start_stack(
        num_decode=2,
        num_prefill=1,
        decode_flags=pod_flags,
        prefill_flags=[*pod_flags, "--metrics-port", str(prefill_metrics_port)],
        gateway_flags=model,
    )
    try:
        yield started.wait_healthy()
    finally:
        started.stop()


@pytest.fixture(scope="module")
def llm(base_dir, stack) -> LLM:
    """The offline engine with adapters, one torch thread as the pods run (built while they
    start)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield LLM(base_dir, kv_cache_bytes=16 * 2**20, enable_lora=True, max_loras=2, max_lora_rank=8)
    torch.set_num_threads(previous)


def offline(llm: LLM, prompt: str, lora: LoRARequest | None) -> list[int]:
    return list(llm.generate([prompt], GREEDY, lora_request=lora)[0].outputs[0].token_ids)


def post(url: str, body: dict) -> HttpResult:
    request = urllib.request.Request(
        url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            text = response.read().decode()
            return HttpResult(response.status, _json_or_text(text))
    except urllib.error.HTTPError as error:
        return HttpResult(error.code, _json_or_text(error.read().decode()))


def _json_or_text(text: str) -> dict:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return {"text": text}


def complete(stack: Stack, model: str, prompt: str) -> HttpResult:
    body = {"model": model, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0.0}
    return post(f"{stack.base_url}/v1/completions", {**body, "return_token_ids": True})


def completion_tokens(result: HttpResult) -> list[int]:
    assert result.status == 200, result.body
    return result.body["choices"][0]["token_ids"]


def decode_call(address: str, request: worker_pb2.DecodeRequest) -> list:
    with sync_channel(address) as channel:
        return list(worker_pb2_grpc.DecodeWorkerStub(channel).Decode(request, timeout=60))


def resident_on(stack: Stack, name: str) -> list[str]:
    return [a for a in stack.decode_addresses if name in pod_stats(a).resident_lora_adapters]


def wait_for_poll() -> None:
    """The gateway polls the pods' stats (residency included) every 0.5 s."""
    time.sleep(1.5)


# ---- what clients see -------------------------------------------------------------------------


def test_models_list_the_adapter_with_the_base_as_parent(stack):
    models = get_json(f"{stack.base_url}/v1/models")
    assert models.status == 200
    cards = {card["id"]: card for card in models.body["data"]}
    assert set(cards) == {MODEL_NAME, "alpha"}
    assert cards["alpha"]["parent"] == MODEL_NAME
    assert cards[MODEL_NAME]["parent"] is None
    one = get_json(f"{stack.base_url}/v1/models/alpha")
    assert one.status == 200 and one.body["parent"] == MODEL_NAME


def test_completions_and_chat_with_an_adapter_equal_the_offline_engine(stack, llm, adapter_dirs):
    alpha = LoRARequest("alpha", 1, adapter_dirs["alpha"])
    prompt = "Once upon a time"
    expected = offline(llm, prompt, alpha)
    assert expected != offline(llm, prompt, None), "the adapter must change the tokens"
    result = complete(stack, "alpha", prompt)
    assert completion_tokens(result) == expected
    assert result.body["model"] == "alpha"
    assert completion_tokens(complete(stack, MODEL_NAME, prompt)) == offline(llm, prompt, None)
    messages = [{"role": "user", "content": "Say something"}]
    chat = post(
        f"{stack.base_url}/v1/chat/completions",
        {
            "model": "alpha",
            "messages": messages,
            "max_tokens": MAX_TOKENS,
            "temperature": 0.0,
            "return_token_ids": True,
        },
    )
    assert chat.status == 200, chat.body
    template = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    chat_ids = llm.tokenizer.encode(template, add_special_tokens=False)
    reference = llm.generate([chat_ids], GREEDY, lora_request=alpha)[0].outputs[0].token_ids
    assert chat.body["choices"][0]["token_ids"] == list(reference)


def test_an_adapter_through_the_prefill_pod_equals_the_offline_engine(stack, llm, adapter_dirs):
    alpha = LoRARequest("alpha", 1, adapter_dirs["alpha"])
    prompt_ids = llm.tokenizer.encode(LONG_PROMPT)
    assert len(prompt_ids) >= 32, "long enough for the decode pod to send it to the prefill pod"
    expected = list(llm.generate([prompt_ids], GREEDY, lora_request=alpha)[0].outputs[0].token_ids)
    request = worker_pb2.DecodeRequest(
        request_id="pd-alpha",
        prompt_token_ids=prompt_ids,
        sampling=options_from_params(GREEDY),
        prefill_address=stack.prefill_addresses[0],
        lora_name="alpha",
    )
    responses = decode_call(stack.decode_addresses[0], request)
    assert [r.prefill_mode for r in responses][-1] == "remote"
    assert [t for r in responses for t in r.token_ids] == expected
    # The prefill pod computed the pages with the adapter (the decode engine would have
    # refused other pages and prefilled itself, which the mode would not show).
    assert "alpha" in prefill_stats(stack.prefill_addresses[0]).resident_lora_adapters
    # And through the gateway (it names the prefill pod for a long prompt).
    gateway = completion_tokens(complete(stack, "alpha", LONG_PROMPT))
    assert gateway == offline(llm, LONG_PROMPT, alpha)


def test_unknown_adapters_are_404_model_not_found(stack):
    messages = [{"role": "user", "content": "hi"}]
    for path, body in (
        ("/v1/completions", {"model": "nope", "prompt": "hi"}),
        ("/v1/chat/completions", {"model": "nope", "messages": messages}),
        ("/v1/responses", {"model": "nope", "input": "hi"}),
    ):
        result = post(f"{stack.base_url}{path}", body)
        assert result.status == 404, (path, result.body)
        assert result.body["error"]["code"] == "model_not_found"
    assert get_json(f"{stack.base_url}/v1/models/nope").status == 404
    with sync_channel(stack.grpc_address) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        with pytest.raises(grpc.RpcError) as caught:
            stub.Generate(generate_pb2.GenerateRequest(text="hi", model="nope"), timeout=30)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    # A pod asked directly for an adapter it does not hold.
    request = worker_pb2.DecodeRequest(
        request_id="no-such-adapter",
        prompt_token_ids=[1, 2, 3],
        sampling=options_from_params(GREEDY),
        lora_name="nope",
    )
    with pytest.raises(grpc.RpcError) as caught:
        decode_call(stack.decode_addresses[0], request)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND


def test_the_grpc_gateway_selects_the_adapter(stack, llm, adapter_dirs):
    alpha = LoRARequest("alpha", 1, adapter_dirs["alpha"])
    prompt = "In the beginning"
    with sync_channel(stack.grpc_address) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        request = generate_pb2.GenerateRequest(
            text=prompt, model="alpha", sampling=options_from_params(GREEDY)
        )
        response = stub.Generate(request, timeout=60)
    assert list(response.sequences[0].token_ids) == offline(llm, prompt, alpha)
    assert response.model == "alpha"


def test_anthropic_messages_select_the_adapter(stack, llm, adapter_dirs):
    alpha = LoRARequest("alpha", 1, adapter_dirs["alpha"])
    messages = [{"role": "user", "content": "Tell me a story"}]
    body = {"model": "alpha", "max_tokens": MAX_TOKENS, "messages": messages, "temperature": 0.0}
    result = post(f"{stack.base_url}/v1/messages", body)
    assert result.status == 200, result.body
    assert result.body["model"] == "alpha"
    template = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    ids = llm.tokenizer.encode(template, add_special_tokens=False)
    expected = llm.generate([ids], GREEDY, lora_request=alpha)[0].outputs[0].text
    assert result.body["content"][0]["text"] == expected
    unknown = post(f"{stack.base_url}/v1/messages", {**body, "model": "nope"})
    assert unknown.status == 404 and unknown.body["error"]["type"] == "not_found_error"


# ---- runtime adapters and routing ---------------------------------------------------------


def test_runtime_load_use_and_unload_over_http_and_residency_routing(stack, llm, adapter_dirs):
    url = stack.base_url
    bad = post(f"{url}/v1/load_lora_adapter", {"lora_name": "bad", "lora_path": "/nonexistent"})
    assert bad.status == 400, bad.body
    loaded = post(
        f"{url}/v1/load_lora_adapter", {"lora_name": "beta", "lora_path": adapter_dirs["beta"]}
    )
    assert loaded.status == 200, loaded.body
    again = {"lora_name": "beta", "lora_path": adapter_dirs["beta"]}
    assert post(f"{url}/v1/load_lora_adapter", again).status == 200  # the same: no change
    taken = {"lora_name": "alpha", "lora_path": adapter_dirs["beta"]}
    clash = post(f"{url}/v1/load_lora_adapter", taken)
    assert clash.status == 400 and clash.body["error"]["param"] == "lora_path", clash.body
    ids = {card["id"] for card in get_json(f"{url}/v1/models").body["data"]}
    assert ids == {MODEL_NAME, "alpha", "beta"}
    assert resident_on(stack, "beta") == [], "loaded, but no request has run with it yet"
    # The pods number adapters themselves; the offline engine's id is its own.
    beta = LoRARequest("beta", 2, adapter_dirs["beta"])
    first, second = "A tale of two", "Far far away"
    assert completion_tokens(complete(stack, "beta", first)) == offline(llm, first, beta)
    holders = resident_on(stack, "beta")
    assert len(holders) == 1
    wait_for_poll()
    # A different prompt (no cached prefix anywhere): residency alone sends it to the holder.
    assert completion_tokens(complete(stack, "beta", second)) == offline(llm, second, beta)
    assert resident_on(stack, "beta") == holders
    unloaded = post(f"{url}/v1/unload_lora_adapter", {"lora_name": "beta"})
    assert unloaded.status == 200, unloaded.body
    assert complete(stack, "beta", first).status == 404
    again = post(f"{url}/v1/unload_lora_adapter", {"lora_name": "beta"})
    assert again.status == 404 and again.body["error"]["code"] == "model_not_found"


def test_the_prefill_pod_reports_its_adapters_in_metrics(stack, prefill_metrics_port):
    assert complete(stack, "alpha", LONG_PROMPT).status == 200  # prefilled there with alpha
    url = f"http://127.0.0.1:{prefill_metrics_port}/metrics"
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode()
    info = [line for line in text.splitlines() if line.startswith("splitserve:lora_requests_info")]
    assert len(info) == 1 and 'max_lora="2"' in info[0], info
    assert 'running_lora_adapters=""' in info[0]  # nothing runs now
    loads = _sample(text, "splitserve:lora_slot_loads_total")
    assert loads >= 1  # alpha at least
    assert _sample(text, "splitserve:lora_slot_evictions_total") >= 0


def _sample(text: str, name: str) -> float:
    lines = [line for line in text.splitlines() if line.startswith(name + "{")]
    assert len(lines) == 1, (name, lines)
    return float(lines[0].rsplit(" ", 1)[1])


# ---- pure parts: the residency score and `splitserve up`'s flags --------------------------


def _view(pod_id: str, residency: LoRAResidency | None, queued: int = 0) -> PodView:
    load = PodLoad(num_waiting=queued, kv_blocks_total=100, kv_blocks_free=100)
    return PodView(pod_id, f"{pod_id}:1", Location(), load, lora_residency=residency)


def test_residency_scores_resident_over_free_slot_over_eviction():
    ctx = RoutingContext(num_prompt_tokens=10, client=Location())
    terms = {
        r: score_terms(_view("p", r), ctx)["lora_affinity"] for r in LoRAResidency
    }
    weight = ctx.weights.lora
    assert terms == {
        LoRAResidency.RESIDENT: weight * 1.0,
        LoRAResidency.FREE_SLOT: weight * 0.8,
        LoRAResidency.MUST_EVICT: weight * 0.6,
    }
    assert "lora_affinity" not in score_terms(_view("p", None), ctx)  # base-model requests
    pods = [
        _view("a", LoRAResidency.MUST_EVICT),
        _view("b", LoRAResidency.RESIDENT),
        _view("c", LoRAResidency.FREE_SLOT),
    ]
    decision = decide([], pods, ctx)
    assert (decision.decode_pod_id, decision.reason) == ("b", "lora_affinity")
    # One request queued on the resident pod does not outweigh the load of a cold load...
    busy = [_view("b", LoRAResidency.RESIDENT, queued=1), _view("c", LoRAResidency.FREE_SLOT)]
    assert decide([], busy, ctx).decode_pod_id == "b"
    # ... a long queue does.
    swamped = [_view("b", LoRAResidency.RESIDENT, queued=8), _view("c", LoRAResidency.FREE_SLOT)]
    assert decide([], swamped, ctx).decode_pod_id == "c"


def test_up_passes_the_lora_flags_to_every_engine_pod(tmp_path):
    args = ["up", "--lora-modules", "alpha=adapters/a", "b=/abs/b", "--max-loras", "3"]
    specs = plan(build_parser().parse_args(args), prefill_available=True).specs
    pods = [spec for spec in specs if "--kv-transport" in spec.argv]
    assert len(pods) == 2  # one prefill, one decode
    for spec in pods:
        argv = spec.argv
        start = argv.index("--lora-modules") + 1
        assert argv[start : start + 2] == [f"alpha={os.path.abspath('adapters/a')}", "b=/abs/b"]
        assert argv[argv.index("--max-loras") + 1] == "3"
    gateway = [spec for spec in specs if "--kv-transport" not in spec.argv]
    assert all("--lora-modules" not in spec.argv for spec in gateway)


def test_the_chart_passes_lora_modules_to_both_engine_roles():
    chart = pytest.importorskip("tests.test_helm_chart")
    adapters = [{"name": "sql", "path": "/models/adapters/sql"}, {"name": "chat", "path": "/a/c"}]
    objects = chart.objects_of(chart.render({"engine": {"loraModules": adapters, "maxLoras": 2}}))
    roles = set()
    for component, container in chart.containers_of(objects):
        argv = chart.command_line(container, objects)
        if component not in ("prefill", "decode"):
            assert "--lora-modules" not in argv
            continue
        roles.add(component)
        start = argv.index("--lora-modules") + 1
        assert argv[start : start + 2] == ["sql=/models/adapters/sql", "chat=/a/c"]
        assert argv[argv.index("--max-loras") + 1] == "2"
        assert chart.command_problems(argv) == []
    assert roles == {"prefill", "decode"}
    default = chart.objects_of(chart.render({}))
    assert all(
        "--lora-modules" not in chart.command_line(container, default)
        for _, container in chart.containers_of(default)
    )


def test_an_adapter_held_by_one_decode_pod_is_routed_only_there(stack, llm, adapter_dirs):
    """Loaded on one pod directly (as a pod that joined with other --lora-modules would hold
    it): served, routed only to that pod, and unloaded from it through the gateway."""
    holder = stack.decode_addresses[1]
    with sync_channel(holder) as channel:
        load = worker_pb2.LoadLoRAAdapterRequest(lora_name="gamma", lora_path=adapter_dirs["beta"])
        assert worker_pb2_grpc.DecodeWorkerStub(channel).LoadLoRAAdapter(load, timeout=60).changed
    wait_for_poll()
    cards = {card["id"]: card for card in get_json(f"{stack.base_url}/v1/models").body["data"]}
    assert cards["gamma"]["parent"] == MODEL_NAME
    gamma = LoRARequest("gamma", 9, adapter_dirs["beta"])
    for prompt in ("Roses are red", "Violets are blue"):  # short: prefilled on the decode pod
        assert completion_tokens(complete(stack, "gamma", prompt)) == offline(llm, prompt, gamma)
        assert resident_on(stack, "gamma") == [holder]
    unloaded = post(f"{stack.base_url}/v1/unload_lora_adapter", {"lora_name": "gamma"})
    assert unloaded.status == 200, unloaded.body
    assert "gamma" not in pod_stats(holder).lora_adapters


# ---- last: it restarts a decode pod -------------------------------------------------------


@pytest.mark.slow  # make test stays well under 15 min: a pod restart, ~6 s
def test_a_restarted_pod_gets_the_runtime_adapters_back(stack, adapter_dirs):
    url = stack.base_url
    body = {"lora_name": "delta", "lora_path": adapter_dirs["beta"]}
    assert post(f"{url}/v1/load_lora_adapter", body).status == 200
    victim = stack.decode_addresses[1]
    process = stack.supervisor.process("decode-1")
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    policy = RestartPolicy(initial_backoff_s=0.0)
    stack.supervisor.restart_exited(policy)  # sees the exit
    assert stack.supervisor.restart_exited(policy) == ["decode-1 restarted (restart 1)"]
    deadline = time.monotonic() + 90
    while True:  # started with --lora-modules alpha only: the gateway gives it delta
        try:
            adapters = set(pod_stats(victim).lora_adapters)
        except grpc.RpcError:  # not up yet, or still loading the model
            adapters = set()
        if "delta" in adapters:
            break
        assert time.monotonic() < deadline, "the restarted pod never got the runtime adapter"
        time.sleep(0.2)
    assert adapters == {"alpha", "delta"}
    wait_for_poll()
    assert post(f"{url}/v1/unload_lora_adapter", {"lora_name": "delta"}).status == 200
    assert "delta" not in pod_stats(victim).lora_adapters
