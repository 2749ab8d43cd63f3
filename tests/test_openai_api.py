"""The OpenAI HTTP API's surface end to end: a gateway in front of a prefill pod and a decode pod
(real processes, real gRPC), driven with the official `openai` client and with raw HTTP.

Covers the request schemas (/openapi.json, unknown and unsupported fields), logit_bias,
response_format / structured_outputs validation (HTTP 400 and gRPC INVALID_ARGUMENT before
anything is scheduled), /v1/models/{id}, /tokenize and /detokenize, echo, prompt-cache hits in
usage, continuous usage stats and the Responses API. The fuzz run from /openapi.json is in
tests/test_openai_fuzz.py.
"""

from __future__ import annotations

import json
import urllib.request

import grpc
import openai
import pytest
from openai import OpenAI

from splitserve.common.channels import sync_channel
from splitserve.common.model_files import load_tokenizer, resolve_model_path
from splitserve.engine.sampling_params import SamplingParams, value_type
from splitserve.engine.structured_output.spec import StructuredOutput
from splitserve.engine.tokenizer import Tokenizer
from splitserve.gateway.api.chat import ChatBody, parse_chat
from splitserve.gateway.api.completions import CompletionBody, parse_completion
from splitserve.gateway.api.fields import SAMPLING_BODY_FIELDS, SamplingFields
from splitserve.gateway.structured.constraints import closed_objects
from splitserve.v1 import generate_pb2, generate_pb2_grpc
from tests.services_util import MODEL_NAME, Stack, get_json, pod_stats, post_raw, start_stack

CHAT = [{"role": "user", "content": "What is the capital of France?"}]
LONG_PROMPT = (
    "The lighthouse keeper climbed the narrow spiral stairs every evening at dusk, lit the "
    "great lamp, and wrote in his logbook about the ships that passed. One stormy night, he"
)


# ---- the schemas, without a stack -----------------------------------------------------------


def test_every_sampling_field_is_declared_in_the_body_schema():
    assert set(SAMPLING_BODY_FIELDS) <= set(SamplingFields.model_fields)


def test_documented_bounds_are_samplingparams_own():
    """The schema's bounds (documentation there) are the ones SamplingParams enforces."""
    for name in SAMPLING_BODY_FIELDS:
        if name in ("top_k", "seed"):  # -1 is vLLM's "off" for top_k; seed: int64 on the wire
            continue
        bounds = SamplingFields.model_fields[name].json_schema_extra or {}
        step = 1 if value_type(name) is int else 1e-3
        for keyword, value in bounds.items():
            inside, outside = {
                "minimum": (value, value - step),
                "maximum": (value, value + step),
                "exclusiveMinimum": (value + step, value),
            }[keyword]
            SamplingParams(**{name: value_type(name)(inside)})
            with pytest.raises(ValueError, match=f"^{name}"):
                SamplingParams(**{name: value_type(name)(outside)})


def test_logit_bias_and_structured_outputs_reach_samplingparams():
    completion = parse_completion(
        {
            "prompt": "hi",
            "logit_bias": {"7": 1.5, "2": -100},
            "structured_outputs": {"choice": ["yes", "no"]},
        },
        "m",
    )
    params = completion.options.params(16)
    assert params.logit_bias == ((2, -100.0), (7, 1.5))
    assert params.structured_output == StructuredOutput.choice(["yes", "no"])
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    chat = parse_chat(
        {
            "messages": CHAT,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": schema, "strict": True},
            },
        },
        "m",
    )
    closed = {**schema, "additionalProperties": False}
    assert chat.options.params(16).structured_output == StructuredOutput.json_schema(closed)
    for body, kind in (
        ({"response_format": {"type": "json_object"}}, "json_object"),
        ({"structured_outputs": {"regex": "[a-z]+"}}, "regex"),
        ({"structured_outputs": {"grammar": 'start: "a" | "b"'}}, "grammar"),
        ({"structured_outputs": {"json": json.dumps(schema)}}, "json"),
    ):
        parsed = parse_completion({"prompt": "hi", **body}, "m").options.params(16)
        assert parsed.structured_output is not None and parsed.structured_output.kind == kind


def test_json_schemas_close_objects_that_list_their_properties():
    """As OpenAI's strict mode and vLLM do: no keys beyond the listed ones, unless asked."""
    schema = {
        "type": "object",
        "properties": {
            "pets": {"type": "array", "items": {"$ref": "#/$defs/Pet"}},
            "extra": {"type": "object"},  # free-form: stays open
            "properties": {"type": "object", "properties": {"a": {"type": "string"}}},
        },
        "$defs": {"Pet": {"type": "object", "properties": {"name": {"type": "string"}}}},
    }
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["$defs"]["Pet"]["additionalProperties"] is False
    assert "additionalProperties" not in closed["properties"]["extra"]
    assert closed["properties"]["properties"]["additionalProperties"] is False
    assert "additionalProperties" not in closed["properties"]  # a name map, not a schema
    open_schema = {"type": "object", "properties": {}, "additionalProperties": True}
    assert closed_objects(open_schema) == open_schema  # said explicitly: kept


# ---- a stack --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def stack():
    stack = start_stack(num_prefill=1)
    try:
        yield stack.wait_healthy()
    finally:
        stack.stop()


@pytest.fixture(scope="module")
def client(stack: Stack) -> OpenAI:
    return OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return load_tokenizer(resolve_model_path(None))


def _post(stack: Stack, path: str, body: dict):
    return post_raw(f"{stack.base_url}{path}", json.dumps(body).encode())


def _assert_400(result, param: str, code: str | None = None) -> str:
    assert result.status == 400, result.body
    error = result.body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    assert error["message"].startswith(param.split("[")[0]), error["message"]
    if code is not None:
        assert error["code"] == code, error
    return error["message"]


def test_openapi_describes_every_request_field(stack):
    spec = get_json(f"{stack.base_url}/openapi.json").body
    schemas = spec["components"]["schemas"]
    for endpoint, name in (
        ("/v1/completions", "CompletionBody"),
        ("/v1/chat/completions", "ChatBody"),
        ("/v1/responses", "ResponsesBody"),
        ("/tokenize", "TokenizeBody"),
        ("/detokenize", "DetokenizeBody"),
    ):
        body = spec["paths"][endpoint]["post"]["requestBody"]["content"]["application/json"]
        assert body["schema"]["$ref"].endswith(f"/{name}")
        assert schemas[name]["additionalProperties"] is False  # unknown fields are refused
    completion = schemas["CompletionBody"]["properties"]
    for field in (*SAMPLING_BODY_FIELDS, "prompt", "max_tokens", "logprobs", "echo",
                  "logit_bias", "response_format", "structured_outputs", "stream_options"):
        assert field in completion, field
    assert completion["temperature"]["maximum"] == 100
    assert completion["top_p"]["exclusiveMinimum"] == 0
    assert "description" in completion["logit_bias"]
    chat = schemas["ChatBody"]["properties"]
    for field in ("messages", "max_completion_tokens", "top_logprobs", "tools", "tool_choice"):
        assert field in chat, field
    assert set(schemas["StructuredOutputs"]["properties"]) >= {"json", "regex", "choice",
                                                               "grammar"}


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2, "frobnicate": 1}),
        ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2, "frobnicate": 1}),
        ("/v1/responses", {"input": "hi", "max_output_tokens": 2, "frobnicate": 1}),
        ("/tokenize", {"prompt": "hi", "frobnicate": 1}),
    ],
)
def test_an_unknown_field_is_a_400_naming_it(stack, path, body):
    message = _assert_400(_post(stack, path, body), "frobnicate", "unknown_parameter")
    assert "not a recognized parameter" in message


# A value that asks for something, for each known-but-unsupported field.
_UNSUPPORTED_VALUES = {
    "prompt_logprobs": 1,
    "truncate_prompt_tokens": 4,
    "include_stop_str_in_output": True,
    "use_beam_search": True,
    "allowed_token_ids": [1, 2],
    "bad_words": ["x"],
    "guided_json": {"type": "object"},
    "guided_regex": "a+",
    "guided_choice": ["a"],
    "guided_grammar": "start: \"a\"",
    "store": True,
    "suffix": "tail",
    "audio": {"voice": "alloy"},
    "prediction": {"type": "content", "content": "x"},
    "web_search_options": {},
    "reasoning_effort": "low",
    "verbosity": "low",
    "functions": [{"name": "f"}],
    "function_call": "auto",
    "echo": True,
    "continue_final_message": True,
    "chat_template": "{{ messages }}",
    "chat_template_kwargs": {"enable_thinking": False},
}
_UNSUPPORTED = [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 2}, name)
    for name in CompletionBody.UNSUPPORTED
] + [
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 2}, name)
    for name in ChatBody.UNSUPPORTED
]


@pytest.mark.parametrize(("path", "base", "name"), _UNSUPPORTED)
def test_each_known_unsupported_field_is_a_400_naming_it(stack, path, base, name):
    before = pod_stats(stack.decode_addresses[0]).prefix_cache_queried_tokens
    result = _post(stack, path, {**base, name: _UNSUPPORTED_VALUES[name]})
    _assert_400(result, name, "unsupported_parameter")
    assert pod_stats(stack.decode_addresses[0]).prefix_cache_queried_tokens == before


def test_bookkeeping_fields_are_accepted(client):
    answer = client.chat.completions.create(
        model=MODEL_NAME,
        messages=CHAT,
        max_completion_tokens=2,
        temperature=0,
        user="someone",
        metadata={"team": "a"},
        store=False,
        service_tier="auto",
    )
    assert answer.choices[0].finish_reason == "length"


def test_a_string_for_a_number_is_still_a_400(stack):
    _assert_400(_post(stack, "/v1/completions", {"prompt": "hi", "max_tokens": "10"}),
                "max_tokens", "invalid_type")


def test_logit_bias_is_accepted_and_bad_values_are_400s(client, stack, tokenizer):
    answer = client.completions.create(
        model=MODEL_NAME, prompt="hi", max_tokens=2, temperature=0, logit_bias={"11": -100}
    )
    assert answer.choices[0].finish_reason == "length"
    vocab = tokenizer.vocab_size
    for bias in ({"11": 101}, {"11": -100.5}, {"eleven": 1}, {"-3": 1}, {str(vocab): 1},
                 {"11": "high"}):
        _assert_400(_post(stack, "/v1/completions", {"prompt": "hi", "logit_bias": bias}),
                    "logit_bias")
    _assert_400(_post(stack, "/v1/completions", {"prompt": "hi", "logit_bias": [1]}),
                "logit_bias", "invalid_type")


def test_logit_bias_reaches_the_engine(client, tokenizer):
    forced = tokenizer.encode(" Paris", add_special_tokens=False)[0]
    answer = client.completions.create(
        model=MODEL_NAME, prompt="Once upon a time", max_tokens=3, temperature=0,
        logit_bias={str(forced): 100}, extra_body={"return_token_ids": True},
    )
    assert answer.choices[0].model_extra["token_ids"] == [forced] * 3


_BAD_CONSTRAINTS = [
    ("structured_outputs", {"structured_outputs": {"regex": "(unclosed"}}),
    ("structured_outputs", {"structured_outputs": {"grammar": "start: missing_rule"}}),
    ("structured_outputs", {"structured_outputs": {"json": {"type": "no-such-type"}}}),
    ("structured_outputs", {"structured_outputs": {"json": "{not json"}}),
    ("structured_outputs", {"structured_outputs": {"choice": []}}),
    ("structured_outputs", {"structured_outputs": {"regex": "a", "choice": ["a"]}}),
    ("structured_outputs", {"structured_outputs": {}}),
    ("structured_outputs", {"structured_outputs": {"regex": "a"},
                            "response_format": {"type": "json_object"}}),
    ("response_format", {"response_format": {"type": "json_schema"}}),
    ("response_format", {"response_format": {"type": "xml"}}),
    ("response_format", {"response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": 5}}}}),
    ("response_format", {"response_format": {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(("}}}}),
]


@pytest.mark.parametrize("endpoint", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize(("param", "constraint"), _BAD_CONSTRAINTS)
def test_a_bad_constraint_is_a_400_before_anything_is_scheduled(stack, endpoint, param,
                                                               constraint):
    base = {"prompt": "hi"} if endpoint == "/v1/completions" else {"messages": CHAT}
    before = pod_stats(stack.decode_addresses[0]).prefix_cache_queried_tokens
    _assert_400(_post(stack, endpoint, {**base, "max_tokens": 2, **constraint}), param)
    assert pod_stats(stack.decode_addresses[0]).prefix_cache_queried_tokens == before


def test_a_good_constraint_is_accepted(client):
    schema = {"type": "object", "properties": {"city": {"type": "string"}}}
    answer = client.chat.completions.create(
        model=MODEL_NAME,
        messages=CHAT,
        max_completion_tokens=4,
        temperature=0,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
    )
    assert answer.choices[0].finish_reason in ("length", "stop")
    answer = client.completions.create(
        model=MODEL_NAME,
        prompt="Yes or no?",
        max_tokens=4,
        temperature=0,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert answer.choices[0].finish_reason in ("length", "stop")


@pytest.mark.parametrize(
    "constraint",
    [
        generate_pb2.StructuredOutput(kind="regex", spec="(unclosed"),
        generate_pb2.StructuredOutput(kind="json", spec='{"type": "no-such-type"}'),
        generate_pb2.StructuredOutput(kind="grammar", spec="start: missing_rule"),
        generate_pb2.StructuredOutput(kind="cobol", spec="x"),
    ],
)
def test_grpc_refuses_a_bad_constraint_before_scheduling(stack, constraint):
    before = pod_stats(stack.decode_addresses[0]).prefix_cache_queried_tokens
    sampling = generate_pb2.SamplingOptions(max_tokens=2)
    sampling.structured_output.CopyFrom(constraint)
    request = generate_pb2.GenerateRequest(text="hi", sampling=sampling)
    with sync_channel(stack.grpc_address) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.Generate(request, timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "structured_output" in info.value.details()
    assert pod_stats(stack.decode_addresses[0]).prefix_cache_queried_tokens == before


def test_grpc_refuses_a_logit_bias_outside_the_vocabulary(stack, tokenizer):
    sampling = generate_pb2.SamplingOptions(max_tokens=2)
    sampling.logit_bias[tokenizer.vocab_size] = 1.0
    with sync_channel(stack.grpc_address) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            stub.Generate(generate_pb2.GenerateRequest(text="hi", sampling=sampling), timeout=30)
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.details().startswith("logit_bias")


def test_models_by_id(client):
    assert client.models.retrieve(MODEL_NAME).id == MODEL_NAME
    with pytest.raises(openai.NotFoundError) as info:
        client.models.retrieve("gpt-4")
    assert info.value.body["code"] == "model_not_found"


def test_tokenize_and_detokenize_round_trip(stack, client, tokenizer):
    text = "The capital of France is Paris."
    got = _post(stack, "/tokenize", {"prompt": text, "return_token_strs": True})
    assert got.status == 200, got.body
    assert got.body["tokens"] == tokenizer.encode(text)
    assert got.body["count"] == len(got.body["tokens"])
    assert got.body["max_model_len"] == pod_stats(stack.decode_addresses[0]).max_model_len
    assert got.body["token_strs"] == tokenizer.convert_ids_to_tokens(got.body["tokens"])
    back = _post(stack, "/detokenize", {"tokens": got.body["tokens"]})
    assert back.status == 200 and back.body == {"prompt": tokenizer.decode(got.body["tokens"])}
    assert back.body["prompt"] == text
    # Messages count exactly what a chat completion's prompt is.
    chat = _post(stack, "/tokenize", {"messages": CHAT})
    answer = client.chat.completions.create(
        model=MODEL_NAME, messages=CHAT, max_completion_tokens=1
    )
    assert chat.body["count"] == answer.usage.prompt_tokens
    without = _post(stack, "/tokenize", {"messages": CHAT, "add_generation_prompt": False})
    assert without.body["count"] < chat.body["count"]
    _assert_400(_post(stack, "/tokenize", {}), "prompt")
    _assert_400(_post(stack, "/detokenize", {"tokens": [tokenizer.vocab_size]}), "tokens")
    unknown = _post(stack, "/tokenize", {"prompt": "x", "model": "nope"})
    assert unknown.status == 404 and unknown.body["error"]["code"] == "model_not_found"


def test_echo_puts_the_prompt_first(client, stack):
    prompt = "The capital of France is"
    plain = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4,
                                      temperature=0)
    echoed = client.completions.create(model=MODEL_NAME, prompt=[prompt, "Once upon"],
                                       max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text == prompt + plain.choices[0].text
    assert echoed.choices[1].text.startswith("Once upon")
    stream = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=4,
                                       temperature=0, echo=True, stream=True)
    assert "".join(chunk.choices[0].text for chunk in stream) == echoed.choices[0].text
    _assert_400(_post(stack, "/v1/completions", {"prompt": prompt, "echo": True,
                                                 "logprobs": 1}), "echo")


def test_cached_tokens_count_prefix_cache_hits_through_the_prefill_pod(client):
    """The first request is prefilled on the prefill pod; the second finds the prompt's full
    blocks cached and says so in its usage."""
    prompt = "[cached-tokens test] " + LONG_PROMPT
    first = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2,
                                      temperature=0)
    second = client.completions.create(model=MODEL_NAME, prompt=prompt, max_tokens=2,
                                       temperature=0)
    assert first.usage.prompt_tokens > 32  # long enough for the prefill pod
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < cached <= second.usage.prompt_tokens


def test_continuous_usage_stats_on_every_chunk(client):
    stream = client.chat.completions.create(
        model=MODEL_NAME,
        messages=CHAT,
        max_completion_tokens=5,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"stream_options": {"include_usage": True, "continuous_usage_stats": True}},
    )
    chunks = list(stream)
    assert all(chunk.usage is not None for chunk in chunks)
    completion_tokens = [chunk.usage.completion_tokens for chunk in chunks if chunk.choices]
    assert completion_tokens == sorted(completion_tokens) and completion_tokens[-1] == 5
    prompt_tokens = {chunk.usage.prompt_tokens for chunk in chunks}
    assert len(prompt_tokens) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 5


def test_stream_options_without_a_stream_is_a_400(stack):
    body = {"prompt": "hi", "stream_options": {"include_usage": True}}
    _assert_400(_post(stack, "/v1/completions", body), "stream_options")


def test_responses_text_in_and_out(client):
    chat = client.chat.completions.create(
        model=MODEL_NAME,
        messages=[{"role": "system", "content": "Be brief."}, *CHAT],
        max_completion_tokens=6,
        temperature=0,
    )
    response = client.responses.create(
        model=MODEL_NAME, instructions="Be brief.", input=CHAT[0]["content"],
        max_output_tokens=6, temperature=0,
    )
    assert response.output_text == chat.choices[0].message.content
    assert response.output[0].type == "message" and response.output[0].role == "assistant"
    assert response.status == "incomplete"  # stopped by max_output_tokens
    assert response.usage.input_tokens == chat.usage.prompt_tokens
    assert response.usage.output_tokens == 6
    items = client.responses.create(
        model=MODEL_NAME, input=[{"role": "system", "content": "Be brief."}, *CHAT],
        max_output_tokens=6, temperature=0,
    )
    assert items.output_text == response.output_text


def test_responses_stream(client):
    events = list(client.responses.create(
        model=MODEL_NAME, input="Say hello.", max_output_tokens=5, temperature=0, stream=True
    ))
    kinds = [event.type for event in events]
    assert kinds[0] == "response.created"
    assert kinds[-1] in ("response.completed", "response.incomplete")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert events[-1].response.output_text == text
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_responses_follow_a_json_schema(client):
    schema = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
              "required": ["city"]}
    response = client.responses.create(
        model=MODEL_NAME, input="Name a city in JSON.", max_output_tokens=30, temperature=0,
        text={"format": {"type": "json_schema", "name": "city", "schema": schema}},
    )
    assert response.status == "completed", response.output_text
    assert set(json.loads(response.output_text)) == {"city"}


def test_responses_refuse_what_they_do_not_serve(stack):
    result = _post(stack, "/v1/responses", {"input": "hi", "previous_response_id": "resp_1"})
    _assert_400(result, "previous_response_id", "unsupported_parameter")
    _assert_400(_post(stack, "/v1/responses", {"input": []}), "input")


def test_the_gateway_still_imports_no_torch(stack):
    with urllib.request.urlopen(f"{stack.base_url}/health", timeout=10) as response:
        assert json.load(response)["torch_imported"] is False


# ---- prompt caching controls (issue 18) ------------------------------------------------------


def test_cache_salts_keep_tenants_apart_through_the_gateway(client):
    prompt = "[salt test] " + LONG_PROMPT

    def cached(salt: str) -> int:
        answer = client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=1, temperature=0,
            extra_body={"cache_salt": salt},
        )
        return answer.usage.prompt_tokens_details.cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-a") > 0
    assert cached("tenant-b") == 0


def test_retention_fields_are_accepted_and_bad_values_are_400s(stack, client):
    chat = {"model": MODEL_NAME, "max_tokens": 1}
    user = {"role": "user", "content": "Hi"}
    ok = [
        {**chat, "messages": [user], "prompt_cache_retention": "24h"},
        {**chat, "messages": [user], "prompt_cache_retention": "in_memory"},
        {**chat, "messages": [{**user, "cache_control": {"type": "ephemeral", "ttl": "1h"}}]},
        {**chat, "messages": [{"role": "user", "content": [
            {"type": "text", "text": "Hi", "cache_control": {"type": "ephemeral"}}]}]},
    ]
    for body in ok:
        assert _post(stack, "/v1/chat/completions", body).status == 200, body
    _assert_400(
        _post(stack, "/v1/chat/completions",
              {**chat, "messages": [user], "prompt_cache_retention": "1w"}),
        "prompt_cache_retention",
    )
    bad_ttl = _post(stack, "/v1/chat/completions", {
        **chat, "messages": [{**user, "cache_control": {"type": "ephemeral", "ttl": "2h"}}]})
    assert bad_ttl.status == 400 and bad_ttl.body["error"]["param"].startswith("messages")
    # Longer than the pods' --max-retention (24 h by default): the pod refuses it.
    _assert_400(
        _post(stack, "/v1/completions",
              {"model": MODEL_NAME, "prompt": "Hi", "max_tokens": 1, "cache_retention_s": 1e6}),
        "cache_retention_s",
    )
