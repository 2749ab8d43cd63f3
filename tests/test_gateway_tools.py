"""Tool calling end to end: a real decode pod serving SmolLM2 and a real gateway, driven with
the official `openai` client. Required and named choices must always answer with calls whose
arguments validate against the tool's parameters (jsonschema), auto with a strict tool answers
in text or with such calls, streamed calls reassemble to the non-streamed ones, and earlier
calls with their results are accepted and rendered as the gateway documents
(services/gateway/tools/prompt.py).

The pure parts (validation, grammar, rendering, reading answers): tests/test_tool_calls.py.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from openai import OpenAI
from pydantic import BaseModel

from splitserve.engine.model_paths import default_model_path
from splitserve.engine.tokenizer import Tokenizer
from splitserve.gateway.api.chat import parse_chat
from tests.services_util import MODEL_NAME, Stack, post_raw, start_stack, wait_until_idle

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "description": "Add two integers",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": -1000, "maximum": 1000},
                "b": {"type": "integer", "minimum": -1000, "maximum": 1000},
            },
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
LOOKUP = {
    "type": "function",
    "function": {
        "name": "lookup",
        "description": "Look up facts about a country",
        "parameters": {
            "type": "object",
            "properties": {
                "country": {"type": "string", "maxLength": 24},
                "topics": {
                    "type": "array",
                    "items": {"enum": ["capital", "population", "currency"]},
                    "minItems": 1,
                    "maxItems": 3,
                },
                "details": {
                    "type": "object",
                    "properties": {"short": {"type": "boolean"}},
                    "required": ["short"],
                    "additionalProperties": False,
                },
            },
            "required": ["country", "topics", "details"],
            "additionalProperties": False,
        },
    },
}
TOOLS = [WEATHER, ADD, LOOKUP]
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in TOOLS}
QUESTIONS = [
    "What is the weather like in Paris today?",
    "What is 17 plus 25?",
    "Tell me the capital and the currency of Japan.",
]
# SmolLM2 answers the questions above in text when it may; asked this with tools [ADD, WEATHER]
# in auto mode (greedy), it calls get_weather.
CALL_REQUEST = "Call get_weather for Paris in celsius."
MAX_TOKENS = 120  # enough for any call of these tools (bounded strings, arrays, numbers)


def ask(question: str) -> list[dict]:
    return [{"role": "user", "content": question}]


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


@pytest.fixture(scope="module")
def stack() -> Stack:
    stack = start_stack()
    yield stack.wait_healthy()
    stack.stop()


@pytest.fixture(scope="module")
def client(stack: Stack) -> OpenAI:
    return OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def chat(client: OpenAI, question: str, **kwargs):
    kwargs = {"temperature": 0, "max_tokens": MAX_TOKENS, "tools": TOOLS, **kwargs}
    return client.chat.completions.create(model=MODEL_NAME, messages=ask(question), **kwargs)


def assert_valid_calls(choice, allowed: set[str]) -> list[tuple[str, dict]]:
    """The choice is calls only, each of an allowed tool with arguments matching its schema."""
    assert choice.finish_reason == "tool_calls", choice
    message = choice.message
    assert message.content is None and message.tool_calls, message
    calls = []
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in allowed
        arguments = json.loads(call.function.arguments)
        jsonschema.validate(arguments, SCHEMAS[call.function.name])
        calls.append((call.function.name, arguments))
    return calls


# ---- enforced choices -----------------------------------------------------------------------


# One question in make test, the other two in make test-slow (~5 s each).
@pytest.mark.parametrize(
    "question", [QUESTIONS[0], *(pytest.param(q, marks=pytest.mark.slow) for q in QUESTIONS[1:])]
)
def test_required_always_answers_with_valid_calls(client, question):
    response = chat(client, question, tool_choice="required")
    assert_valid_calls(response.choices[0], set(SCHEMAS))


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_a_named_choice_answers_with_one_call_of_that_function(client, name):
    response = chat(client, QUESTIONS[0], tool_choice=named(name))
    calls = assert_valid_calls(response.choices[0], {name})
    assert len(calls) == 1


def test_without_parallel_calls_required_answers_with_one_call(client):
    response = chat(client, QUESTIONS[2], tool_choice="required", parallel_tool_calls=False)
    assert len(assert_valid_calls(response.choices[0], set(SCHEMAS))) == 1


def test_sampled_choices_each_make_their_own_valid_calls(client):
    response = chat(client, QUESTIONS[1], tool_choice="required", n=4, temperature=1.0, seed=11)
    assert [choice.index for choice in response.choices] == [0, 1, 2, 3]
    for choice in response.choices:
        assert_valid_calls(choice, set(SCHEMAS))


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(6))
def test_seeded_sampled_required_calls_validate(client, seed):
    """24 sampled answers in all (4 a request), each of them valid calls."""
    response = chat(
        client, QUESTIONS[seed % 3], tool_choice="required", temperature=1.0, seed=seed, n=4
    )
    for choice in response.choices:
        assert_valid_calls(choice, set(SCHEMAS))


class Add(BaseModel):
    a: int
    b: int


def test_the_clients_parse_helper_reads_pydantic_tools(client):
    """`pydantic_function_tool` makes a strict tool; `parse` checks the arguments against the
    model and hands them back parsed."""
    completion = client.chat.completions.parse(
        model=MODEL_NAME,
        messages=ask(QUESTIONS[1]),
        tools=[openai.pydantic_function_tool(Add)],
        tool_choice="required",
        temperature=0,
        max_tokens=MAX_TOKENS,
    )
    (choice,) = completion.choices
    assert choice.finish_reason == "tool_calls"
    for call in choice.message.tool_calls:
        assert call.function.name == "Add"
        assert isinstance(call.function.parsed_arguments, Add)


@pytest.mark.parametrize("question", [*QUESTIONS, CALL_REQUEST])
def test_auto_with_a_strict_tool_answers_in_text_or_with_valid_calls(client, question):
    response = chat(client, question, tools=[ADD, WEATHER])
    choice = response.choices[0]
    if choice.message.tool_calls:
        assert_valid_calls(choice, {"add", "get_weather"})
    else:
        assert choice.finish_reason in ("stop", "length")
        assert choice.message.content and choice.message.content[0] not in "{[ \n\t"


def test_auto_with_a_strict_tool_calls_when_asked_to(client):
    response = chat(client, CALL_REQUEST, tools=[ADD, WEATHER])
    calls = assert_valid_calls(response.choices[0], {"add", "get_weather"})
    assert calls == [("get_weather", {"city": "Paris", "unit": "celsius"})]


def test_none_answers_in_text(client):
    response = chat(client, QUESTIONS[1], tool_choice="none", max_tokens=24)
    choice = response.choices[0]
    assert choice.message.tool_calls is None and choice.finish_reason in ("stop", "length")
    assert isinstance(choice.message.content, str)


# ---- streaming ------------------------------------------------------------------------------


def streamed_choices(client: OpenAI, question: str, **kwargs) -> dict[int, tuple]:
    """Choice index -> (content, [(name, arguments)], finish_reason), reassembled from the raw
    chunks."""
    kwargs = {"temperature": 0, "max_tokens": MAX_TOKENS, "tools": TOOLS, **kwargs}
    stream = client.chat.completions.create(
        model=MODEL_NAME, messages=ask(question), stream=True, **kwargs
    )
    contents: dict[int, str] = {}
    calls: dict[int, dict[int, list]] = {}
    finishes: dict[int, str] = {}
    for chunk in stream:
        (choice,) = chunk.choices
        index, delta = choice.index, choice.delta
        contents[index] = contents.get(index, "") + (delta.content or "")
        own = calls.setdefault(index, {})
        for entry in delta.tool_calls or []:
            if entry.id is not None:  # the first entry of a call: id, type and name
                assert entry.index not in own and entry.type == "function"
                own[entry.index] = [entry.function.name, entry.function.arguments or ""]
            else:
                assert entry.function.name is None
                own[entry.index][1] += entry.function.arguments
        if choice.finish_reason is not None:
            assert index not in finishes, "one finish per choice"
            finishes[index] = choice.finish_reason
    return {
        index: (
            contents[index] or None,
            [tuple(calls[index][k]) for k in sorted(calls[index])],
            finishes.get(index),
        )
        for index in contents
    }


def streamed(client: OpenAI, question: str, **kwargs) -> tuple[str | None, list, str]:
    (only,) = streamed_choices(client, question, **kwargs).values()
    return only


CASES = [
    (QUESTIONS[0], {"tool_choice": "required"}),
    (QUESTIONS[2], {"tool_choice": named("lookup")}),
    (QUESTIONS[1], {"tools": [ADD, WEATHER]}),  # auto, strict: text
    (CALL_REQUEST, {"tools": [ADD, WEATHER]}),  # auto, strict: a call
    (QUESTIONS[0], {"tools": [WEATHER]}),  # auto, unconstrained
    (QUESTIONS[1], {"tool_choice": "required", "temperature": 0.8, "seed": 3}),
]


# required, an auto call and unconstrained auto in make test; named, auto text and sampled in
# make test-slow.
SLOW_CASES = {1, 2, 5}


@pytest.mark.parametrize(
    "question, kwargs",
    [
        pytest.param(*case, marks=pytest.mark.slow) if i in SLOW_CASES else case
        for i, case in enumerate(CASES)
    ],
)
def test_streamed_calls_reassemble_to_the_non_streamed_ones(client, question, kwargs):
    whole = chat(client, question, **kwargs).choices[0]
    content, calls, finish = streamed(client, question, **kwargs)
    expected = [(c.function.name, c.function.arguments) for c in whole.message.tool_calls or []]
    assert (content, calls, finish) == (whole.message.content, expected, whole.finish_reason)


# make test stays well under 15 min: n > 1 streamed, ~5 s; one streamed case stays in make test
@pytest.mark.slow
def test_each_streamed_choice_reassembles_to_its_non_streamed_one(client):
    kwargs = {"tool_choice": "required", "temperature": 1.0, "seed": 21, "n": 3}
    whole = chat(client, QUESTIONS[2], **kwargs)
    choices = streamed_choices(client, QUESTIONS[2], **kwargs)
    assert sorted(choices) == [0, 1, 2]
    for choice in whole.choices:
        calls = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
        assert choices[choice.index] == (None, calls, "tool_calls")


def test_the_clients_stream_helper_assembles_the_calls(client):
    kwargs = {"temperature": 0, "max_tokens": MAX_TOKENS, "tools": TOOLS}
    whole = chat(client, QUESTIONS[1], tool_choice=named("add"))
    with client.chat.completions.stream(
        model=MODEL_NAME, messages=ask(QUESTIONS[1]), tool_choice=named("add"), **kwargs
    ) as stream:
        final = stream.get_final_completion()
    (choice,) = final.choices
    assert choice.finish_reason == "tool_calls"
    got = [(c.function.name, c.function.arguments) for c in choice.message.tool_calls]
    assert got == [
        (c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls
    ]


# ---- a conversation with tool results -------------------------------------------------------


def test_a_tool_result_round_trip(client, stack):
    """An earlier call (content null) and its result are accepted, and the model reads them
    as the gateway documents (compared token for token through the prompt's length)."""
    arguments = '{"a": 17, "b": 25}'
    call = {
        "id": "call_0123",
        "type": "function",
        "function": {"name": "add", "arguments": arguments},
    }
    messages = [
        *ask(QUESTIONS[1]),
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_0123", "content": "42"},
    ]
    prompt_tokens = {}
    for tool_choice in ("auto", "required"):
        response = client.chat.completions.create(
            model=MODEL_NAME,
            messages=messages,
            tools=[ADD],
            tool_choice=tool_choice,
            temperature=0,
            max_tokens=MAX_TOKENS,
        )
        prompt_tokens[tool_choice] = response.usage.prompt_tokens
        choice = response.choices[0]
        if tool_choice == "required" or choice.message.tool_calls:
            assert_valid_calls(choice, {"add"})
    tokenizer = Tokenizer.from_gguf(default_model_path())
    parsed = parse_chat({"messages": messages, "tools": [ADD]}, MODEL_NAME)
    prompt = tokenizer.apply_chat_template(parsed.messages, add_generation_prompt=True)
    assert "<|im_start|>tool\nResult of add (call_0123):\n42<|im_end|>" in prompt
    assert f'<|im_start|>assistant\n{{"name": "add", "arguments": {arguments}}}<|im_end|>' in prompt
    encoded = tokenizer.encode(prompt, add_special_tokens=False)
    assert prompt_tokens["auto"] == len(encoded)
    stats = wait_until_idle(stack.decode_addresses[0])
    assert stats.kv_blocks_free == stats.kv_blocks_total


# ---- disaggregated, with n-gram speculation ------------------------------------------------


@pytest.fixture(scope="module")
def split_client() -> OpenAI:
    """A second stack: every prompt prefilled on a prefill pod (whose first token the grammar
    must allow too), decoding with n-gram speculation (drafts from the prompt, which holds the
    schemas, checked against the grammar). Started after the first one's tests ran."""
    split = start_stack(
        num_prefill=1,
        decode_flags=["--local-prefill-threshold", "0", "--speculative-method", "ngram"],
    )
    try:
        split.wait_healthy()
        yield OpenAI(base_url=f"{split.base_url}/v1", api_key="unused", max_retries=0, timeout=120)
    finally:
        split.stop()


@pytest.mark.slow
@pytest.mark.parametrize(
    "question, kwargs",
    [
        (QUESTIONS[0], {"tool_choice": "required"}),
        (QUESTIONS[2], {"tool_choice": named("lookup")}),
        (QUESTIONS[1], {"tool_choice": "required", "temperature": 0.9, "seed": 5, "n": 2}),
        (CALL_REQUEST, {"tools": [ADD, WEATHER]}),
    ],
)
def test_disaggregated_and_speculative_calls_validate(split_client, question, kwargs):
    response = chat(split_client, question, **kwargs)
    for choice in response.choices:
        if kwargs.get("tool_choice") or choice.message.tool_calls:
            assert_valid_calls(choice, set(SCHEMAS))
        else:
            assert choice.message.content[0] not in "{[ \n\t"
    content, calls, finish = streamed(split_client, question, **{**kwargs, "n": 1})
    if kwargs.get("tool_choice"):
        assert finish == "tool_calls" and content is None and calls
        for name, arguments in calls:
            jsonschema.validate(json.loads(arguments), SCHEMAS[name])


# ---- bad input ------------------------------------------------------------------------------

UNCOMPILABLE = {
    "type": "function",
    "function": {
        "name": "f",
        "parameters": {"type": "object", "properties": {"x": {"type": "integr"}}},
    },
}
BAD = [
    ({"tools": [ADD], "tool_choice": named("nope")}, "tool_choice"),
    ({"tools": [ADD, ADD]}, "tools"),
    ({"tools": [UNCOMPILABLE]}, "tools"),
    ({"tools": [{"type": "function"}]}, "tools"),
    ({"tool_choice": "required"}, "tool_choice"),
    (
        {"tools": [ADD], "tool_choice": "required", "response_format": {"type": "json_object"}},
        "tool_choice",
    ),
    ({"tools": [ADD], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"messages": [{"role": "tool", "content": "3"}]}, "messages[0]"),
]


@pytest.mark.parametrize("fields, param", BAD)
def test_bad_tool_input_is_a_400_naming_the_field(stack, fields, param):
    body = {"model": MODEL_NAME, "messages": ask("hi"), **fields}
    result = post_raw(f"{stack.base_url}/v1/chat/completions", json.dumps(body).encode())
    assert result.status == 400, result.body
    error = result.body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"]) == ("invalid_request_error", param), error


def test_the_openai_client_sees_a_bad_tool_choice_as_bad_request(client):
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, "hi", tools=[ADD], tool_choice=named("subtract"))
    assert info.value.param == "tool_choice" and "subtract" in info.value.message
