"""Anthropic's Messages API end to end: a prefill pod, two decode pods and a gateway (real
processes, the shipped SmolLM2), driven with Anthropic's own Python SDK.

The prompt must be the one /v1/chat/completions renders for the same conversation (same answer,
same token count), streamed answers must assemble to the whole ones, enforced tool choices must
give `tool_use` inputs valid against their schema, errors must carry Anthropic's body, and a
stream whose decode pod is killed must finish on the other one. The last test kills a pod: it
stays last.
"""

from __future__ import annotations

import json
import signal
import time
import urllib.request
import uuid
from typing import TYPE_CHECKING

import jsonschema
import pytest
from openai import OpenAI

from splitserve.cli import build_parser
from splitserve.common import tracing
from splitserve.engine.model_paths import default_model_path
from splitserve.engine.tokenizer import Tokenizer
from splitserve.launcher import plan
from tests.services_util import MODEL_NAME, Stack, decode_stats, post_raw, start_stack

if TYPE_CHECKING:
    import anthropic

BILLING = "x-anthropic-billing-header:"  # the gateway is started to strip lines starting so
WEATHER = {
    "name": "get_weather",
    "description": "Get the current weather in a city",
    "input_schema": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city", "unit"],
        "additionalProperties": False,
    },
}
ADD = {
    "name": "add",
    "description": "Add two integers",
    "input_schema": {
        "type": "object",
        "properties": {
            "a": {"type": "integer", "minimum": -1000, "maximum": 1000},
            "b": {"type": "integer", "minimum": -1000, "maximum": 1000},
        },
        "required": ["a", "b"],
        "additionalProperties": False,
    },
}
SCHEMAS = {tool["name"]: tool["input_schema"] for tool in (WEATHER, ADD)}
SYSTEM = "You are a helpful assistant who answers in one short sentence."
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def span_file(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("traces") / "spans.jsonl")


@pytest.fixture(scope="module")
def stack(span_file) -> Stack:
    with pytest.MonkeyPatch.context() as patch:  # every process writes its spans there
        patch.setenv(tracing.TRACES_FILE_ENV, span_file)
        patch.delenv("OTEL_SERVICE_NAME", raising=False)
        patch.setenv("OTEL_TRACES_EXPORTER", "none")
        started = start_stack(
            num_decode=2,
            num_prefill=1,
            decode_flags=["--local-prefill-threshold", "8"],
            gateway_flags=["--strip-system-line-prefix", BILLING, "--stream-stall-timeout", "3"],
        )
    try:
        yield started.wait_healthy()
    finally:
        started.stop()


@pytest.fixture(scope="module")
def client(stack: Stack) -> anthropic.Anthropic:
    import anthropic  # lazy: ~5 s to import, paid by the worker that runs this file only

    return anthropic.Anthropic(
        base_url=stack.base_url, api_key="unused", max_retries=0, timeout=120
    )


# Anthropic's newest SDK has no sampling arguments (its newest models take none); the API, and
# clients such as Claude Code, still send them in the body.
GREEDY = {"temperature": 0}


def create(client: anthropic.Anthropic, content: str = QUESTION, **kwargs):
    kwargs = {"max_tokens": 24, "extra_body": GREEDY, **kwargs}
    messages = [{"role": "user", "content": content}]
    return client.messages.create(model=MODEL_NAME, messages=messages, **kwargs)


def total_input(usage) -> int:
    return usage.input_tokens + usage.cache_read_input_tokens + usage.cache_creation_input_tokens


# ---- plain text -----------------------------------------------------------------------------


def test_create_with_a_system_prompt_answers_as_the_chat_endpoint_does(stack, client):
    message = create(client, system=SYSTEM)
    assert (message.type, message.role, message.model) == ("message", "assistant", MODEL_NAME)
    assert message.id.startswith("msg_")
    (block,) = message.content
    assert block.type == "text" and block.text
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert 1 <= message.usage.output_tokens <= 24
    # The same conversation through /v1/chat/completions: the same prompt, the same answer.
    chat = OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    completion = chat.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
        max_tokens=24,
        temperature=0,
    )
    assert completion.choices[0].message.content == block.text
    assert total_input(message.usage) == completion.usage.prompt_tokens
    finish = {"stop": "end_turn", "length": "max_tokens"}[completion.choices[0].finish_reason]
    assert message.stop_reason == finish


def test_system_text_blocks_and_a_system_string_are_one_prompt(client):
    as_blocks = [
        {"type": "text", "text": "You are a helpful assistant"},
        {"type": "text", "text": "who answers in one short sentence."},
    ]
    joined = "You are a helpful assistant\nwho answers in one short sentence."
    assert create(client, system=as_blocks).content == create(client, system=joined).content


def test_a_stream_assembles_to_the_whole_message(client):
    whole = create(client, "Tell me about the sea.", max_tokens=30)
    with client.messages.stream(
        model=MODEL_NAME,
        max_tokens=30,
        extra_body=GREEDY,
        messages=[{"role": "user", "content": "Tell me about the sea."}],
    ) as stream:
        streamed_text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed_text == final.content[0].text == whole.content[0].text
    assert (final.stop_reason, final.stop_sequence) == (whole.stop_reason, whole.stop_sequence)
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert total_input(final.usage) == total_input(whole.usage)


def test_the_event_sequence_is_anthropics(stack):
    body = {
        "model": MODEL_NAME,
        "max_tokens": 8,
        "temperature": 0,
        "stream": True,
        "messages": [{"role": "user", "content": "Tell me about the sea."}],
    }
    headers = {"anthropic-version": "2023-06-01", "x-api-key": "unused"}
    names, datas = [], []
    request = urllib.request.Request(
        f"{stack.base_url}/v1/messages",
        data=json.dumps(body).encode(),
        headers={"Content-Type": "application/json", **headers},
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        assert response.status == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        for raw in response:
            line = raw.decode().rstrip("\n")
            if line.startswith("event: "):
                names.append(line.removeprefix("event: "))
            elif line.startswith("data: "):
                datas.append(json.loads(line.removeprefix("data: ")))
    assert [data["type"] for data in datas] == names
    deltas = names.count("content_block_delta")
    assert deltas >= 1
    assert names == [
        "message_start",
        "ping",
        "content_block_start",
        *["content_block_delta"] * deltas,
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    start, delta = datas[0]["message"], datas[-2]
    assert (start["content"], start["stop_reason"]) == ([], None)
    assert delta["delta"]["stop_reason"] == "max_tokens"
    assert delta["usage"]["output_tokens"] == 8


def test_stop_sequences_end_the_answer_with_stop_sequence(client):
    whole = create(client, "Count from 1 to 20, separated by commas.", max_tokens=40)
    text = whole.content[0].text
    assert "5" in text, text
    stopped = create(
        client, "Count from 1 to 20, separated by commas.", max_tokens=40, stop_sequences=["5"]
    )
    assert (stopped.stop_reason, stopped.stop_sequence) == ("stop_sequence", "5")
    assert stopped.content[0].text == text[: text.index("5")]


# ---- tools ----------------------------------------------------------------------------------


def test_tool_choice_any_answers_with_a_valid_tool_use(client):
    message = create(
        client,
        "What is the weather like in Paris today?",
        max_tokens=80,
        tools=[WEATHER, ADD],
        tool_choice={"type": "any"},
    )
    assert message.stop_reason == "tool_use"
    uses = [block for block in message.content if block.type == "tool_use"]
    assert uses, message.content
    for use in uses:
        assert use.id.startswith("toolu_") and use.name in SCHEMAS
        jsonschema.validate(use.input, SCHEMAS[use.name])


def test_a_named_tool_streams_to_the_same_tool_use(client):
    kwargs = {
        "max_tokens": 80,
        "extra_body": GREEDY,
        "tools": [WEATHER, ADD],
        "tool_choice": {"type": "tool", "name": "add", "disable_parallel_tool_use": True},
    }
    messages = [{"role": "user", "content": "What is 17 plus 25?"}]
    whole = client.messages.create(model=MODEL_NAME, messages=messages, **kwargs)
    (use,) = whole.content
    assert (use.type, use.name, whole.stop_reason) == ("tool_use", "add", "tool_use")
    jsonschema.validate(use.input, ADD["input_schema"])
    with client.messages.stream(model=MODEL_NAME, messages=messages, **kwargs) as stream:
        final = stream.get_final_message()
    (streamed,) = final.content
    assert (streamed.type, streamed.name, streamed.input) == ("tool_use", "add", use.input)
    assert final.stop_reason == "tool_use"


def test_output_config_format_makes_the_answer_match_its_schema(client):
    schema = {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 20},
            "country": {"type": "string", "maxLength": 20},
        },
        "required": ["city", "country"],
    }
    message = create(
        client,
        "Name a city in Japan as JSON.",
        max_tokens=60,
        output_config={"format": {"type": "json_schema", "schema": schema}},
    )
    assert message.stop_reason == "end_turn"
    jsonschema.validate(json.loads(message.content[0].text), schema)


TOOL_TURNS = [
    {"role": "user", "content": "What is the weather like in Paris today?"},
    {
        "role": "assistant",
        "content": [
            {"type": "text", "text": "Let me look."},
            {
                "type": "tool_use",
                "id": "toolu_01",
                "name": "get_weather",
                "input": {"city": "Paris", "unit": "celsius"},
            },
        ],
    },
    {
        "role": "user",
        "content": [
            {"type": "tool_result", "tool_use_id": "toolu_01", "content": "18 degrees and sunny"},
            {"type": "text", "text": "Answer in one sentence."},
        ],
    },
]
# The same conversation as OpenAI's chat completions spell it.
OPENAI_TURNS = [
    {"role": "user", "content": "What is the weather like in Paris today?"},
    {
        "role": "assistant",
        "content": "Let me look.",
        "tool_calls": [
            {
                "id": "toolu_01",
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "arguments": json.dumps({"city": "Paris", "unit": "celsius"}),
                },
            },
        ],
    },
    {"role": "tool", "tool_call_id": "toolu_01", "content": "18 degrees and sunny"},
    {"role": "user", "content": "Answer in one sentence."},
]


def test_a_tool_result_turn_is_rendered_as_the_chat_endpoint_renders_it(stack, client):
    message = client.messages.create(
        model=MODEL_NAME, max_tokens=40, extra_body=GREEDY, tools=[WEATHER], messages=TOOL_TURNS
    )
    assert message.stop_reason in ("end_turn", "max_tokens", "tool_use")
    for block in message.content:
        if block.type == "tool_use":
            jsonschema.validate(block.input, WEATHER["input_schema"])
        else:
            assert block.type == "text" and block.text
    openai_tools = [
        {
            "type": "function",
            "function": {
                "name": WEATHER["name"],
                "description": WEATHER["description"],
                "parameters": WEATHER["input_schema"],
            },
        }
    ]
    chat = _post(
        stack,
        "/v1/chat/completions",
        {
            "model": MODEL_NAME,
            "messages": OPENAI_TURNS,
            "tools": openai_tools,
            "max_tokens": 40,
            "temperature": 0,
        },
    )
    counted = client.messages.count_tokens(model=MODEL_NAME, tools=[WEATHER], messages=TOOL_TURNS)
    assert counted.input_tokens == chat["usage"]["prompt_tokens"] == total_input(message.usage)
    if message.content[0].type == "text":
        assert message.content[0].text == chat["choices"][0]["message"]["content"]


# ---- counting and caching -------------------------------------------------------------------


def test_count_tokens_is_the_tokenizers_count_of_the_rendered_prompt(client):
    tokenizer = Tokenizer.from_gguf(default_model_path())
    rendered = tokenizer.apply_chat_template(
        [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}],
        add_generation_prompt=True,
    )
    want = len(tokenizer.encode(rendered, add_special_tokens=False))
    messages = [{"role": "user", "content": QUESTION}]
    counted = client.messages.count_tokens(model=MODEL_NAME, system=SYSTEM, messages=messages)
    assert counted.input_tokens == want
    # The operator's prefix (--strip-system-line-prefix) drops a volatile first line.
    with_header = f"{BILLING} cc_version=2.0.1; cc_entrypoint=cli\n{SYSTEM}"
    stripped = client.messages.count_tokens(model=MODEL_NAME, system=with_header, messages=messages)
    assert stripped.input_tokens == want
    kept = f"x-other-header: 1\n{SYSTEM}"
    assert (
        client.messages.count_tokens(model=MODEL_NAME, system=kept, messages=messages).input_tokens
        > want
    )


def test_a_repeated_long_system_prompt_is_read_from_the_cache(client):
    story = " ".join(f"Rule {i}: be kind to lighthouse keeper number {i}." for i in range(60))
    session = f"user_{uuid.uuid4().hex}"  # one user's requests go to one decode pod

    def ask(header: str):
        system = [
            {"type": "text", "text": f"{BILLING} cc_version=2.0.{header}; cc_entrypoint=cli"},
            {"type": "text", "text": story, "cache_control": {"type": "ephemeral"}},
        ]
        return create(client, system=system, max_tokens=4, metadata={"user_id": session})

    first, second = ask("1"), ask("2")  # the volatile header differs; it is stripped
    count = client.messages.count_tokens(
        model=MODEL_NAME, system=story, messages=[{"role": "user", "content": QUESTION}]
    ).input_tokens
    assert count > 600
    assert total_input(first.usage) == total_input(second.usage) == count
    assert first.usage.cache_read_input_tokens == 0
    assert first.usage.cache_creation_input_tokens == count  # computed, kept for the window
    assert second.usage.cache_read_input_tokens >= 512
    assert second.usage.cache_creation_input_tokens == count - second.usage.cache_read_input_tokens
    assert second.usage.input_tokens == 0


# ---- errors ---------------------------------------------------------------------------------


def _error_of(call) -> anthropic.APIStatusError:
    import anthropic  # lazy: as in the client fixture

    with pytest.raises(anthropic.APIStatusError) as caught:
        call()
    return caught.value


def _assert_invalid(error: anthropic.APIStatusError, message_start: str) -> None:
    assert error.status_code == 400
    assert error.body["type"] == "error" and set(error.body) == {"type", "error"}
    assert error.body["error"]["type"] == "invalid_request_error"
    assert error.body["error"]["message"].startswith(message_start), error.body


def test_an_unknown_field_is_a_400_with_anthropics_body(client):
    error = _error_of(lambda: create(client, extra_body={"max_token": 5}))
    _assert_invalid(error, "max_token is not a recognized parameter")


def test_a_bad_role_is_a_400(client):
    error = _error_of(
        lambda: client.messages.create(
            model=MODEL_NAME, max_tokens=5, messages=[{"role": "system", "content": "hi"}]
        )
    )
    _assert_invalid(error, "messages[0].role")


def test_unsupported_fields_and_blocks_are_400s_naming_them(client):
    error = _error_of(lambda: create(client, thinking={"type": "enabled", "budget_tokens": 1024}))
    _assert_invalid(error, "thinking is not supported by this server")
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}
    error = _error_of(
        lambda: client.messages.create(
            model=MODEL_NAME,
            max_tokens=5,
            messages=[
                {"role": "user", "content": [image, {"type": "text", "text": "What is it?"}]}
            ],
        )
    )
    _assert_invalid(error, "messages[0].content[0]: image blocks are not supported")
    error = _error_of(lambda: create(client, extra_body={"temperature": 1.5}))
    _assert_invalid(error, "temperature must be in [0, 1]")
    error = _error_of(
        lambda: create(client, tools=[WEATHER], tool_choice={"type": "tool", "name": "nope"})
    )
    _assert_invalid(error, "tool_choice names the tool 'nope'")


def test_missing_max_tokens_and_unknown_model_get_anthropics_statuses(stack):
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}]}
    status, answer = _post_status(stack, "/v1/messages", body)
    assert status == 400
    assert answer == {
        "type": "error",
        "error": {"type": "invalid_request_error", "message": "max_tokens is required"},
    }
    status, answer = _post_status(stack, "/v1/messages", {**body, "messages": [], "max_tokens": 5})
    assert (status, answer["error"]["message"]) == (400, "messages must not be empty")
    status, answer = _post_status(
        stack, "/v1/messages", {**body, "max_tokens": 5, "model": "claude-x"}
    )
    assert (status, answer["error"]["type"]) == (404, "not_found_error")
    # The OpenAI endpoints keep OpenAI's body.
    status, answer = _post_status(stack, "/v1/chat/completions", {**body, "max_token": 5})
    assert status == 400 and answer["error"]["code"] == "unknown_parameter"


def test_schemas_metrics_traces_and_the_up_flag(stack, client, span_file):
    schema = json.loads(_get(stack, "/openapi.json"))
    assert {"/v1/messages", "/v1/messages/count_tokens"} <= set(schema["paths"])
    body = schema["components"]["schemas"]["MessagesBody"]
    assert {"max_tokens", "messages"} <= set(body["required"])
    for name in ("MessagesBody", "CountTokensBody"):  # unknown fields are refused
        assert schema["components"]["schemas"][name]["additionalProperties"] is False
    trace_id, parent_id = uuid.uuid4().hex, uuid.uuid4().hex[:16]
    traceparent = {"traceparent": f"00-{trace_id}-{parent_id}-01"}
    create(client, max_tokens=2, extra_headers=traceparent)
    spans = _wait_for_spans(span_file, trace_id, {"POST /v1/messages", "decode.request"})
    (server,) = [span for span in spans if span["name"] == "POST /v1/messages"]
    assert server["parent_span_id"] == parent_id
    assert server["attributes"][tracing.OUTPUT_TOKENS] == 2
    (decode,) = [span for span in spans if span["name"] == "decode.request"]
    assert decode["parent_span_id"] == server["span_id"]
    _error_of(lambda: create(client, extra_body={"frobnicate": 1}))
    metrics = _get(stack, "/metrics")
    assert 'splitserve_requests_total{endpoint="/v1/messages",status="200"}' in metrics
    assert 'splitserve_requests_total{endpoint="/v1/messages",status="400"}' in metrics
    args = build_parser().parse_args(["up", "--strip-system-line-prefix", BILLING])
    gateway = next(
        spec for spec in plan(args, prefill_available=True).specs if spec.name == "gateway"
    )
    at = gateway.argv.index("--strip-system-line-prefix")
    assert gateway.argv[at + 1] == BILLING


# ---- migration (kills a decode pod: keep last) ----------------------------------------------

MIGRATED_TOKENS = 60


@pytest.mark.slow  # kills a pod (~19 s); make test has migration in test_gateway_retry
def test_a_stream_whose_decode_pod_is_killed_finishes_on_the_other(stack, client):
    prompt = "Write a long story about a lighthouse keeper and the sea."
    want = create(client, prompt, max_tokens=MIGRATED_TOKENS)
    assert want.stop_reason == "max_tokens"
    migrations = _migrations(stack)
    killed = []
    with client.messages.stream(
        model=MODEL_NAME,
        max_tokens=MIGRATED_TOKENS,
        extra_body=GREEDY,
        messages=[{"role": "user", "content": prompt}],
    ) as stream:
        for i, _ in enumerate(stream.text_stream):
            if i == 6:  # well before the end: the pod must die mid-stream
                busy = _busy_pod(stack)
                name = f"decode-{stack.decode_addresses.index(busy)}"
                stack.processes[name].send_signal(signal.SIGKILL)
                killed.append(busy)
        final = stream.get_final_message()
    assert len(killed) == 1
    assert final.content[0].text == want.content[0].text
    assert (final.stop_reason, final.usage.output_tokens) == ("max_tokens", MIGRATED_TOKENS)
    assert _migrations(stack) == migrations + 1


# ---- helpers --------------------------------------------------------------------------------


def _wait_for_spans(path: str, trace_id: str, names: set[str]) -> list[dict]:
    deadline = time.monotonic() + 15
    while True:
        spans = [s for s in tracing.read_span_file(path) if s["trace_id"] == trace_id]
        if names <= {s["name"] for s in spans} or time.monotonic() > deadline:
            return spans
        time.sleep(0.1)


def _busy_pod(stack: Stack) -> str:
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        for address in stack.decode_addresses:
            if decode_stats(address).num_running:
                return address
        time.sleep(0.05)
    raise AssertionError("no decode pod is running the request")


def _migrations(stack: Stack) -> float:
    total = 0.0
    for line in _get(stack, "/metrics").splitlines():
        if line.startswith("splitserve:migrations_total{"):
            total += float(line.split()[-1])
    return total


def _get(stack: Stack, path: str) -> str:
    with urllib.request.urlopen(f"{stack.base_url}{path}", timeout=30) as response:
        return response.read().decode()


def _post(stack: Stack, path: str, body: dict) -> dict:
    status, answer = _post_status(stack, path, body)
    assert status == 200, answer
    return answer


def _post_status(stack: Stack, path: str, body: dict) -> tuple[int, dict]:
    result = post_raw(f"{stack.base_url}{path}", json.dumps(body).encode())
    return result.status, result.body
