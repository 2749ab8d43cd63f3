"""The OpenAI HTTP API end to end: a real decode pod and a real gateway (separate processes,
real gRPC between them), driven with the official `openai` client and with raw HTTP.

The reference is the offline engine (`LLM`) in this process, with the decode pod's settings:
what the gateway returns must be what the engine produces, token for token.
"""

from __future__ import annotations

import asyncio
import http.client
import json
import subprocess
import sys
import time
import urllib.request

import openai
import pytest
import torch
from openai import AsyncOpenAI, OpenAI

from splitserve import LLM, SamplingParams
from splitserve.engine.outputs import CompletionOutput
from splitserve.gateway.server_timing import parse_header
from tests.services_util import (
    MODEL_NAME,
    Stack,
    decode_stats,
    get_json,
    post_raw,
    start_stack,
    wait_until_idle,
)

PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "def fibonacci(n):",
    "Water boils at",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
CHAT = [
    {"role": "system", "content": "You are a terse assistant."},
    {"role": "user", "content": "What is 2+2? Answer with one number."},
]


@pytest.fixture(scope="module")
def processes():
    stack = start_stack(gateway_flags=["--server-timing"])
    yield stack
    stack.stop()


@pytest.fixture(scope="module")
def llm(processes: Stack) -> LLM:
    """Built while the pods start (hence the dependency); single-threaded as the pod is, so
    the two share the 2 cores."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield LLM(kv_cache_bytes=128 * 2**20)
    torch.set_num_threads(previous)


@pytest.fixture(scope="module")
def stack(processes: Stack) -> Stack:
    return processes.wait_healthy()


@pytest.fixture(scope="module")
def client(stack: Stack) -> OpenAI:
    return OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def greedy_reference(llm: LLM) -> dict[str, CompletionOutput]:
    return {
        prompt: output.outputs[0] for prompt, output in zip(PROMPTS, llm.generate(PROMPTS, GREEDY))
    }


def _token_ids(choice) -> list[int]:
    return choice.model_extra["token_ids"]  # vLLM's return_token_ids extension


def test_greedy_completions_equal_the_offline_engine(client, llm, greedy_reference):
    for prompt, want in greedy_reference.items():
        got = client.completions.create(
            model=MODEL_NAME,
            prompt=prompt,
            max_tokens=8,
            temperature=0,
            extra_body={"return_token_ids": True},
        )
        (choice,) = got.choices
        assert _token_ids(choice) == want.token_ids
        assert choice.text == want.text
        assert choice.finish_reason == want.finish_reason == "length"
        assert got.usage.prompt_tokens == len(llm.tokenizer.encode(prompt))
        assert got.usage.completion_tokens == 8
        assert got.usage.total_tokens == got.usage.prompt_tokens + 8
        assert got.object == "text_completion" and got.model == MODEL_NAME
        assert got.id.startswith("cmpl-")


def test_a_token_id_prompt_equals_its_text(client, llm, greedy_reference):
    prompt_ids = llm.tokenizer.encode(PROMPTS[0])
    got = client.completions.create(
        model=MODEL_NAME,
        prompt=prompt_ids,
        max_tokens=8,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    assert _token_ids(got.choices[0]) == greedy_reference[PROMPTS[0]].token_ids


def test_several_prompts_in_one_request_get_one_choice_each(client, greedy_reference):
    prompts = [PROMPTS[0], PROMPTS[3]]
    got = client.completions.create(
        model=MODEL_NAME,
        prompt=prompts,
        max_tokens=8,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    assert [choice.index for choice in got.choices] == [0, 1]
    assert [_token_ids(choice) for choice in got.choices] == [
        greedy_reference[prompt].token_ids for prompt in prompts
    ]
    assert got.usage.completion_tokens == 16


def test_stream_chunks_concatenate_to_the_same_text(client, llm):
    want = llm.generate(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=12))[0].outputs[0]
    stream = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPTS[1],
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    with_choices = [chunk for chunk in chunks if chunk.choices]
    assert len(with_choices) > 2  # really streamed, not one chunk at the end
    assert "".join(chunk.choices[0].text for chunk in with_choices) == want.text
    finish_reasons = [chunk.choices[0].finish_reason for chunk in with_choices]
    assert finish_reasons[-1] == want.finish_reason
    assert finish_reasons[:-1] == [None] * (len(finish_reasons) - 1)
    assert chunks[-1].choices == []  # include_usage: the last chunk carries only usage
    assert chunks[-1].usage.completion_tokens == len(want.token_ids)


def test_raw_event_stream_ends_with_done(stack):
    body = {"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0, "stream": True}
    request = urllib.request.Request(
        f"{stack.base_url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.headers["Content-Type"].startswith("text/event-stream")
        raw = response.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    payloads = [json.loads(event.removeprefix("data: ")) for event in events[:-2]]
    assert all(event.startswith("data: {") for event in events[:-2])
    assert {payload["object"] for payload in payloads} == {"text_completion"}
    assert payloads[-1]["choices"][0]["finish_reason"] == "length"


def test_chat_completions_apply_the_chat_template(client, llm):
    want = llm.chat(CHAT, SamplingParams(temperature=0.0, max_tokens=16))
    got = client.chat.completions.create(
        model=MODEL_NAME,
        messages=CHAT,
        max_tokens=16,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    (choice,) = got.choices
    assert choice.message.role == "assistant"
    assert choice.message.content == want.outputs[0].text
    assert _token_ids(choice) == want.outputs[0].token_ids
    assert choice.finish_reason == want.outputs[0].finish_reason
    # The template's tokens, not the bare message text's, were the prompt.
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)
    assert got.object == "chat.completion" and got.id.startswith("chatcmpl-")

    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=16, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want.outputs[0].text
    assert chunks[-1].choices[0].finish_reason == want.outputs[0].finish_reason


def test_n_sequences_with_a_seed_sample_as_the_engine_does(client, llm):
    params = SamplingParams(n=3, temperature=1.0, top_p=0.9, seed=1234, max_tokens=6)
    want = llm.generate(PROMPTS[1], params)[0]
    got = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPTS[1],
        n=3,
        temperature=1.0,
        top_p=0.9,
        seed=1234,
        max_tokens=6,
        extra_body={"return_token_ids": True},
    )
    assert [choice.index for choice in got.choices] == [0, 1, 2]
    got_ids = [_token_ids(choice) for choice in got.choices]
    assert got_ids == [output.token_ids for output in want.outputs]
    assert len({tuple(ids) for ids in got_ids}) > 1  # siblings got different seeds
    assert got.usage.prompt_tokens == len(want.prompt_token_ids)  # the prompt counts once
    assert got.usage.completion_tokens == sum(len(ids) for ids in got_ids)


def test_logprobs_are_the_engines(client, llm):
    want = llm.generate(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=4, logprobs=2))
    entries = want[0].outputs[0].logprobs
    got = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=4, temperature=0, logprobs=2
    )
    logprobs = got.choices[0].logprobs
    expected_tokens = [
        llm.tokenizer.decode([entry.token_id], skip_special_tokens=False) for entry in entries
    ]
    assert logprobs.tokens == expected_tokens
    assert logprobs.token_logprobs == pytest.approx([entry.logprob for entry in entries], abs=1e-5)
    for token, top, entry in zip(logprobs.tokens, logprobs.top_logprobs, entries):
        assert top[token] == pytest.approx(entry.logprob, abs=1e-5)  # greedy: its own top-1
        assert len(entry.top) == 2 and len(top) == 2
    assert logprobs.text_offset == sorted(logprobs.text_offset)

    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_tokens=3, temperature=0, logprobs=True, top_logprobs=2
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == 3
    assert all(len(entry.top_logprobs) == 2 for entry in content)
    assert all(entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob for entry in content)


def test_stop_strings_end_sequences_as_the_engine_does(client, llm):
    params = SamplingParams(temperature=0.0, max_tokens=16, stop=["."])
    want = llm.generate(PROMPTS[0], params)[0].outputs[0]
    got = client.completions.create(
        model=MODEL_NAME, prompt=PROMPTS[0], max_tokens=16, temperature=0, stop="."
    )
    (choice,) = got.choices
    assert (choice.text, choice.finish_reason) == (want.text, "stop")
    assert choice.model_extra["stop_reason"] == want.stop_reason == "."


def test_32_concurrent_requests_all_complete_correctly(stack, greedy_reference):
    expected_text = {prompt: output.text for prompt, output in greedy_reference.items()}

    async def one(client: AsyncOpenAI, i: int) -> tuple[str, str]:
        prompt = PROMPTS[i % len(PROMPTS)]
        options = {"model": MODEL_NAME, "prompt": prompt, "max_tokens": 8, "temperature": 0}
        if i % 4 == 0:  # a quarter stream, the rest wait for the whole answer
            stream = await client.completions.create(stream=True, **options)
            return prompt, "".join([chunk.choices[0].text async for chunk in stream])
        response = await client.completions.create(**options)
        return prompt, response.choices[0].text

    async def all_of_them() -> list[tuple[str, str]]:
        client = AsyncOpenAI(
            base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=120
        )
        async with client:
            return await asyncio.gather(*(one(client, i) for i in range(32)))

    results = asyncio.run(all_of_them())
    assert len(results) == 32
    assert [text for _, text in results] == [expected_text[prompt] for prompt, _ in results]
    stats = wait_until_idle(stack.decode_addresses[0])
    assert stats.kv_blocks_free == stats.kv_blocks_total


def test_client_disconnect_mid_stream_frees_the_blocks(client, stack):
    address = stack.decode_addresses[0]
    stream = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPTS[1],
        max_tokens=1000,  # a minute of decoding, unless the disconnect aborts it
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for i, _ in enumerate(stream):
        if i == 3:
            break
    during = decode_stats(address)
    assert during.num_running == 1 and during.kv_blocks_free < during.kv_blocks_total
    stream.close()
    after = wait_until_idle(address)
    assert (after.num_running, after.num_waiting) == (0, 0)
    assert after.kv_blocks_free == after.kv_blocks_total


def test_client_disconnect_while_waiting_for_a_whole_answer_frees_the_blocks(stack):
    body = {"prompt": PROMPTS[1], "max_tokens": 1000, "temperature": 0, "ignore_eos": True}
    request = urllib.request.Request(
        f"{stack.base_url}/v1/completions",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with pytest.raises(TimeoutError):
        urllib.request.urlopen(request, timeout=1.5)  # gives up and closes the connection
    after = wait_until_idle(stack.decode_addresses[0])
    assert after.kv_blocks_free == after.kv_blocks_total and after.num_running == 0


CHAT_OK = [{"role": "user", "content": "hi"}]
BAD_INPUT = [
    # (endpoint, body, param, code)
    ("completions", b"{not json", None, "invalid_json"),
    ("completions", b"[1, 2]", None, "invalid_type"),
    ("completions", {"prompt": "hi", "max_tokens": "ten"}, "max_tokens", "invalid_type"),
    ("completions", {"prompt": 42}, "prompt", "invalid_type"),
    ("completions", {"prompt": ""}, "prompt", "invalid_value"),
    ("completions", {"prompt": []}, "prompt", "invalid_type"),
    ("completions", {"max_tokens": 4}, "prompt", "missing_required_parameter"),
    ("completions", {"prompt": "hi", "model": "gpt-4"}, "model", "model_not_found"),
    ("completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens", "invalid_value"),
    ("completions", {"prompt": "hi", "max_tokens": 9000}, "max_tokens", "invalid_value"),
    ("completions", {"prompt": "hi", "n": 0}, "n", "invalid_value"),
    ("completions", {"prompt": "hi", "n": 500}, "n", "invalid_value"),
    ("completions", {"prompt": "hi", "temperature": -0.5}, "temperature", "invalid_value"),
    ("completions", {"prompt": "hi", "temperature": 1000}, "temperature", "invalid_value"),
    ("completions", {"prompt": "hi", "temperature": "hot"}, "temperature", "invalid_type"),
    ("completions", {"prompt": "hi", "top_p": 0}, "top_p", "invalid_value"),
    ("completions", {"prompt": "hi", "top_p": 1.5}, "top_p", "invalid_value"),
    ("completions", {"prompt": "hi", "logprobs": 50}, "logprobs", "invalid_value"),
    ("completions", {"prompt": "hi", "stream": "yes"}, "stream", "invalid_type"),
    ("completions", {"prompt": "hi", "stop": [1]}, "stop", "invalid_type"),
    ("completions", {"prompt": [1, 2, 10**6]}, "prompt", "invalid_value"),
    ("completions", {"prompt": "word " * 9000}, "prompt", "context_length_exceeded"),
    ("chat", {}, "messages", "missing_required_parameter"),
    ("chat", {"messages": []}, "messages", "invalid_value"),
    ("chat", {"messages": "hi"}, "messages", "invalid_type"),
    ("chat", {"messages": [{"content": "hi"}]}, "messages[0]", "invalid_type"),
    ("chat", {"messages": CHAT_OK, "model": "nope"}, "model", "model_not_found"),
    ("chat", {"messages": CHAT_OK, "top_logprobs": 2}, "top_logprobs", "invalid_value"),
    (
        "chat",
        {"messages": CHAT_OK, "logprobs": True, "top_logprobs": 21},
        "top_logprobs",
        "invalid_value",
    ),
    ("chat", {"messages": CHAT_OK, "max_completion_tokens": -1}, "max_tokens", "invalid_value"),
    ("chat", {"messages": CHAT_OK, "top_p": -1}, "top_p", "invalid_value"),
]


@pytest.mark.parametrize(("endpoint", "body", "param", "code"), BAD_INPUT)
def test_bad_input_is_a_400_with_an_openai_error_body(stack, endpoint, body, param, code):
    path = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}[endpoint]
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    result = post_raw(f"{stack.base_url}{path}", data)
    # An unknown model is OpenAI's 404 (model_not_found); the rest are 400s.
    assert result.status == (404 if code == "model_not_found" else 400), result.body
    error = result.body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert (error["param"], error["code"]) == (param, code), error["message"]
    assert error["message"]


def test_the_openai_client_sees_bad_input_as_bad_request(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model=MODEL_NAME, prompt="hi", temperature=-1)
    assert info.value.param == "temperature"
    assert "temperature" in info.value.message


def test_services_keep_serving_after_bad_input(client, stack, greedy_reference):
    got = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPTS[2],
        max_tokens=8,
        temperature=0,
        extra_body={"return_token_ids": True},
    )
    assert _token_ids(got.choices[0]) == greedy_reference[PROMPTS[2]].token_ids
    stats = wait_until_idle(stack.decode_addresses[0])
    assert stats.kv_blocks_free == stats.kv_blocks_total


def test_models_health_and_metrics(client, stack):
    assert [model.id for model in client.models.list().data] == [MODEL_NAME]
    health = get_json(f"{stack.base_url}/health")
    assert health.status == 200 and health.body["status"] == "ok"
    assert health.body["workers"]["decode"] == {stack.decode_addresses[0]: True}
    assert health.body["torch_imported"] is False  # the live gateway loaded no model code
    with urllib.request.urlopen(f"{stack.base_url}/metrics", timeout=10) as response:
        metrics = response.read().decode()
    assert 'splitserve_requests_total{endpoint="/v1/completions",status="200"}' in metrics
    assert 'splitserve_requests_total{endpoint="/v1/completions",status="400"}' in metrics
    ttft_count = next(
        line
        for line in metrics.splitlines()
        if line.startswith("splitserve_time_to_first_token_seconds_count")
    )
    assert float(ttft_count.split()[-1]) > 0
    assert "splitserve_e2e_request_latency_seconds_bucket" in metrics
    assert f'splitserve_worker_up{{address="{stack.decode_addresses[0]}",role="decode"}} 1.0' in (
        metrics
    )


def test_gateway_modules_import_no_torch():
    code = (
        "import sys\n"
        "import splitserve.gateway.__main__, splitserve.gateway.api.http_app\n"
        "import splitserve.gateway.api.grpc_service\n"
        "import splitserve.cli, splitserve.launcher\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


# ---- Server-Timing (services/gateway/server_timing.py) ----------------------------------------

_JSON = {"Content-Type": "application/json"}


def _timed_completion(port: int, stream: bool, max_tokens: int) -> tuple[dict[str, float], float]:
    """One completion's Server-Timing durations (ms by name), and the milliseconds the client
    waited for the response's headers."""
    body = {"model": MODEL_NAME, "prompt": PROMPTS[1], "max_tokens": max_tokens}
    body |= {"temperature": 0.0, "ignore_eos": True, "stream": stream}
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        started = time.perf_counter()
        connection.request("POST", "/v1/completions", json.dumps(body), _JSON)
        response = connection.getresponse()
        waited_ms = (time.perf_counter() - started) * 1e3
        header = response.getheader("server-timing")
        response.read()
    finally:
        connection.close()
    assert response.status == 200
    assert header is not None, "the gateway runs with --server-timing"
    return parse_header(header), waited_ms


def _gateway_time_count(port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        text = response.read().decode()
    for line in text.splitlines():
        if line.startswith("splitserve_gateway_time_seconds_count"):
            return float(line.split()[-1])
    raise AssertionError("no splitserve_gateway_time_seconds in /metrics")


def test_server_timing_splits_the_wait_between_gateway_and_pods(stack: Stack):
    before = _gateway_time_count(stack.http_port)
    streamed, streamed_wait_ms = _timed_completion(stack.http_port, True, 24)
    whole, whole_wait_ms = _timed_completion(stack.http_port, False, 24)
    for durations, waited_ms in ((streamed, streamed_wait_ms), (whole, whole_wait_ms)):
        assert set(durations) == {"gateway", "pods"}
        assert durations["gateway"] > 0 and durations["pods"] > 0
        # Both parts happen inside the client's wait for the headers.
        assert durations["gateway"] + durations["pods"] <= waited_ms
    # A stream's headers go out with its first token; a whole response's after its 24th, so
    # the pods' part of the latter holds 23 more decode steps (its prompt is cached by then).
    assert whole["pods"] > streamed["pods"] + 10
    assert _gateway_time_count(stack.http_port) == before + 2


def test_a_request_refused_before_any_pod_call_is_all_gateway_time(stack: Stack):
    body = {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": "many"}
    connection = http.client.HTTPConnection("127.0.0.1", stack.http_port, timeout=30)
    try:
        connection.request("POST", "/v1/completions", json.dumps(body), _JSON)
        response = connection.getresponse()
        header = response.getheader("server-timing")
        response.read()
    finally:
        connection.close()
    assert response.status == 400
    durations = parse_header(header)
    assert durations["pods"] == 0.0 and durations["gateway"] > 0
