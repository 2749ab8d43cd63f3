"""Tool calling's pure parts, on strings: the request's tool fields validated, the tools and
earlier turns rendered into SmolLM2's prompt, the grammar that enforces calls (checked with
llguidance on a byte-level tokenizer: which texts it accepts), and answers read back as
content and tool calls, streamed piece by piece or whole.

End to end through a gateway and pods: tests/test_gateway_tools.py.
"""

from __future__ import annotations

import json

import llguidance
import pydantic
import pytest

from splitserve.engine.model_paths import default_model_path
from splitserve.engine.structured_output.grammar import grammar_for
from splitserve.engine.tokenizer import Tokenizer
from splitserve.gateway.api.chat import parse_chat
from splitserve.gateway.errors import param_of
from splitserve.gateway.tools.calls import ToolCallParser, ToolDelta, assemble, parse_answer
from splitserve.gateway.tools.hooks import ToolOutputs, prepare_chat
from splitserve.gateway.tools.prompt import tools_section
from splitserve.gateway.tools.request import ToolError, constraint, parse_tool_request
from splitserve.gateway.tools.schema import FunctionTool, NamedToolChoice, ToolCall

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string"},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters
STRICT_ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "strict": True,
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
PARIS = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
NOW = '{"name": "get_time", "arguments": {}}'
USER = [{"role": "user", "content": "What is the weather in Paris?"}]


def request(tools=(WEATHER, TIME), tool_choice=None, parallel=None):
    return parse_tool_request(list(tools), tool_choice, parallel)


def named(name: str) -> dict:
    return {"type": "function", "function": {"name": name}}


# ---- validation -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "tools, tool_choice, parallel, param, words",
    [
        ([], None, None, "tools", "non-empty"),
        ({"type": "function"}, None, None, "tools", "non-empty array"),
        ([{"type": "retrieval"}], None, None, "tools", '"type": "function"'),
        ([{"type": "function", "function": "f"}], None, None, "tools", "function must be"),
        ([{"type": "function", "function": {"name": "a b"}}], None, None, "tools", "name"),
        ([{"type": "function", "function": {"name": "f", "x": 1}}], None, None, "tools", "x"),
        ([{"type": "function", "function": {"name": "f"}, "extra": 1}], None, None, "tools", "ex"),
        ([WEATHER, WEATHER], None, None, "tools", "duplicate function names: get_weather"),
        (
            [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
            None,
            None,
            "tools",
            "object",
        ),
        (
            [
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {"type": "object", "properties": {"a": {"type": "nope"}}},
                    },
                }
            ],
            None,
            None,
            "tools",
            "cannot be enforced",
        ),
        (
            [
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {"properties": {"a": {"$ref": "https://example.com/s"}}},
                    },
                }
            ],
            None,
            None,
            "tools",
            "cannot be enforced",
        ),
        (
            [{"type": "function", "function": {"name": "f", "strict": "yes"}}],
            None,
            None,
            "tools",
            "strict",
        ),
        ([WEATHER], "sometimes", None, "tool_choice", "one of"),
        ([WEATHER], named("get_time"), None, "tool_choice", "not in tools"),
        ([WEATHER], {"type": "function", "name": "get_weather"}, None, "tool_choice", "string"),
        ([WEATHER], 3, None, "tool_choice", "string"),
        (None, "required", None, "tool_choice", "requires tools"),
        (None, named("get_weather"), None, "tool_choice", "requires tools"),
        ([WEATHER], None, "yes", "parallel_tool_calls", "boolean"),
    ],
)
def test_bad_tool_fields_name_the_field(tools, tool_choice, parallel, param, words):
    with pytest.raises(ToolError) as info:
        parse_tool_request(tools, tool_choice, parallel)
    assert info.value.param == param
    assert words in str(info.value)


def test_defaults_follow_openai():
    parsed = request()
    assert (parsed.choice, parsed.parallel, parsed.function_name) == ("auto", True, None)
    assert parse_tool_request(None, None, None) is None
    assert parse_tool_request(None, "none", False) is None  # "none" and "auto" need no tools
    assert parse_tool_request(None, "auto", None) is None
    assert request(tool_choice=named("get_time")).function_name == "get_time"
    no_parameters = request().tool("get_time").parameters
    assert no_parameters["properties"] == {} and no_parameters["additionalProperties"] is False


def test_parse_chat_refuses_bad_tools_as_a_400_naming_the_field():
    body = {"messages": USER, "tools": [WEATHER], "tool_choice": named("nope")}
    with pytest.raises(ValueError) as info:
        parse_chat(body, "m")
    assert param_of(info.value) == "tool_choice"


@pytest.mark.parametrize(
    "extra",
    [
        {"response_format": {"type": "json_object"}},
        {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {}}}},
        {"structured_outputs": {"regex": "a+"}},
    ],
)
@pytest.mark.parametrize("tool_choice", ["required", named("get_weather")])
def test_a_second_constraint_beside_an_enforced_call_is_refused(extra, tool_choice):
    body = {"messages": USER, "tools": [WEATHER], "tool_choice": tool_choice, **extra}
    with pytest.raises(ToolError) as info:
        parse_chat(body, "m")
    assert info.value.param == "tool_choice"


def test_text_response_format_and_unconstrained_auto_combine_with_tools():
    body = {"messages": USER, "tools": [WEATHER], "response_format": {"type": "text"}}
    assert parse_chat({**body, "tool_choice": "required"}, "m").tools.choice == "required"
    auto = parse_chat({**body, "response_format": {"type": "json_object"}}, "m")
    assert auto.tools.choice == "auto"


def test_the_constraint_goes_into_the_sampling_parameters():
    body = {"messages": USER, "tools": [WEATHER, TIME]}
    assert "structured_output" not in parse_chat(body, "m").options.sampling
    for choice in ("required", named("get_time")):
        sampling = parse_chat({**body, "tool_choice": choice}, "m").options.sampling
        assert sampling["structured_output"].kind == "json"
    strict = parse_chat({**body, "tools": [WEATHER, STRICT_ADD]}, "m").options.sampling
    assert strict["structured_output"].kind == "grammar"
    none = parse_chat({**body, "tool_choice": "none"}, "m")
    assert "structured_output" not in none.options.sampling
    assert none.messages == USER  # not rendered either


# ---- the grammar ----------------------------------------------------------------------------

_BYTES = llguidance.LLTokenizer("byte")  # token id = byte value


def accepts(tool_request, text: str) -> bool:
    matcher = llguidance.LLMatcher(_BYTES, grammar_for(constraint(tool_request)))
    tokens = list(text.encode())
    if matcher.validate_tokens(tokens) != len(tokens):
        return False
    return matcher.consume_tokens(tokens) and matcher.is_accepting()


def test_required_accepts_calls_of_any_tool_and_nothing_else():
    parsed = request(tool_choice="required", parallel=False)
    assert accepts(parsed, PARIS)
    assert accepts(parsed, NOW)
    assert not accepts(parsed, f"[{PARIS}]")  # one call only
    assert not accepts(parsed, "It is sunny.")
    assert not accepts(parsed, '{"name": "get_weather", "arguments": {"city": "Paris"}}')
    assert not accepts(parsed, '{"name": "get_weather", "arguments": {"city": 3, "unit": "k"}}')
    assert not accepts(parsed, '{"name": "get_time", "arguments": {"x": 1}}')
    assert not accepts(parsed, '{"name": "nope", "arguments": {}}')
    assert not accepts(parsed, '{"arguments": {}, "name": "get_time"}')  # name first
    assert not accepts(parsed, '{"name":"get_time","arguments":{}}')  # compact, one way


def test_parallel_required_accepts_one_call_or_a_non_empty_array():
    parsed = request(tool_choice="required")
    assert accepts(parsed, PARIS)
    assert accepts(parsed, f"[{PARIS}, {NOW}]")
    assert not accepts(parsed, "[]")


def test_a_named_choice_accepts_exactly_one_call_of_that_function():
    parsed = request(tool_choice=named("get_weather"))  # parallel by default: still one
    assert accepts(parsed, PARIS)
    assert not accepts(parsed, NOW)
    assert not accepts(parsed, f"[{PARIS}]")


def test_strict_auto_accepts_text_or_valid_calls():
    parsed = request(tools=(WEATHER, STRICT_ADD))
    assert accepts(parsed, "It is sunny in Paris.\nEnjoy!")
    assert accepts(parsed, '{"name": "add", "arguments": {"a": 1, "b": 2}}')
    assert accepts(parsed, f'[{PARIS}, {{"name": "add", "arguments": {{"a": 1, "b": 2}}}}]')
    assert not accepts(parsed, '{"name": "add", "arguments": {"a": "1", "b": 2}}')
    # Compact JSON as for required (no room to pad with whitespace).
    assert not accepts(parsed, '{"name":"add","arguments":{"a":1,"b":2}}')
    assert not accepts(parsed, '{"name": "add", "arguments": {"a": 1,\n "b": 2}}')
    assert not accepts(parsed, '{"answer": 42}')
    # Text may not start where a call would: blanks, "{" or "[" lead only to calls.
    assert not accepts(parsed, ' {"name": "add", "arguments": {"a": "x"}}')
    assert not accepts(parsed, "[1, 2]")


def test_parameter_schemas_with_defs_and_refs_are_enforced():
    tree = {
        "type": "function",
        "function": {
            "name": "plant",
            "parameters": {
                "type": "object",
                "properties": {"root": {"$ref": "#/$defs/node"}},
                "required": ["root"],
                "additionalProperties": False,
                "$defs": {
                    "node": {
                        "type": "object",
                        "properties": {
                            "v": {"type": "integer"},
                            "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}},
                        },
                        "required": ["v"],
                        "additionalProperties": False,
                    }
                },
            },
        },
    }
    parsed = request(tools=(tree, WEATHER), tool_choice="required", parallel=False)
    good = '{"name": "plant", "arguments": {"root": {"v": 1, "kids": [{"v": 2}]}}}'
    assert accepts(parsed, good)
    assert not accepts(parsed, '{"name": "plant", "arguments": {"root": {"v": "x"}}}')
    assert not accepts(parsed, '{"name": "plant", "arguments": {"root": {"kids": []}}}')
    assert tree["function"]["parameters"]["$defs"]  # the request's schema is left as it was


# ---- the prompt -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf(default_model_path())


def render(tokenizer: Tokenizer, body: dict) -> str:
    parsed = parse_chat(body, "m")
    return tokenizer.apply_chat_template(parsed.messages, add_generation_prompt=True)


def test_tools_become_a_system_message_when_there_is_none(tokenizer):
    prompt = render(tokenizer, {"messages": USER, "tools": [WEATHER]})
    section = tools_section(request(tools=(WEATHER,)))
    assert prompt.startswith(f"<|im_start|>system\n{section}<|im_end|>\n<|im_start|>user\n")
    assert json.dumps(WEATHER["function"]["parameters"]) in section
    assert "If no tool is needed, reply in plain text." in section


def test_tools_follow_the_text_of_an_existing_system_message(tokenizer):
    messages = [{"role": "system", "content": "Be brief."}, *USER]
    body = {"messages": messages, "tools": [WEATHER], "tool_choice": named("get_weather")}
    prompt = render(tokenizer, body)
    assert prompt.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    assert "Call the tool 'get_weather' now" in prompt
    assert prompt.count("<|im_start|>system") == 1


def test_earlier_calls_and_their_results_render_as_text(tokenizer):
    arguments = json.dumps({"city": "Paris", "unit": "celsius"})
    messages = [
        *USER,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": arguments},
                },
                {
                    "id": "call_2",
                    "type": "function",
                    "function": {"name": "get_time", "arguments": "{}"},
                },
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees"},
        {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "9:00"}]},
    ]
    prompt = render(tokenizer, {"messages": messages, "tools": [WEATHER, TIME]})
    assert f"<|im_start|>assistant\n[{PARIS}, {NOW}]<|im_end|>\n" in prompt
    assert "<|im_start|>tool\nResult of get_weather (call_1):\n18 degrees<|im_end|>\n" in prompt
    assert "<|im_start|>tool\nResult of get_time (call_2):\n9:00<|im_end|>\n" in prompt
    assert prompt.endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize(
    "message, words",
    [
        ({"role": "tool", "content": "18"}, "tool_call_id"),
        ({"role": "assistant", "content": None, "tool_calls": "x"}, "tool_calls"),
        ({"role": "user", "content": "x", "tool_calls": [{"id": "c"}]}, "tool_calls"),
        ({"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": "f"}}]}, "function"),
    ],
)
def test_bad_tool_turns_are_refused_naming_the_message(message, words):
    with pytest.raises(ValueError) as info:
        parse_chat({"messages": [*USER, message]}, "m")
    assert param_of(info.value) == "messages[1]"
    assert words in str(info.value)


# ---- reading answers ------------------------------------------------------------------------


def streamed(tool_request, text: str, size: int = 1) -> tuple[ToolDelta, list[ToolDelta]]:
    """`text` fed `size` characters at a time: everything merged, and the pieces."""
    parser = ToolCallParser(tool_request)
    pieces = [parser.feed(text[i : i + size]) for i in range(0, len(text), size)]
    pieces.append(parser.finish())
    merged = ToolDelta()
    for piece in pieces:
        merged.extend(piece)
    return merged, pieces


def calls_of(answer) -> list[tuple[str, str]]:
    return [(c["function"]["name"], c["function"]["arguments"]) for c in answer.tool_calls]


ANSWERS = [
    # text, (content, [(name, arguments)]) read with tool_choice "auto"
    (PARIS, (None, [("get_weather", '{"city": "Paris", "unit": "celsius"}')])),
    (f"\n  {PARIS}\n", (None, [("get_weather", '{"city": "Paris", "unit": "celsius"}')])),
    (
        f"[{PARIS}, {NOW}]",
        (None, [("get_weather", '{"city": "Paris", "unit": "celsius"}'), ("get_time", "{}")]),
    ),
    ('{"name": "get_time"}', (None, [("get_time", "{}")])),
    (
        '{"arguments": {"x": [1, {"y": "}"}]}, "name": "get_time"}',
        (None, [("get_time", '{"x": [1, {"y": "}"}]}')]),
    ),
    # A copied tool card is no call (nor is Llama's "parameters" spelling).
    ('{"name": "get_time", "parameters": {}}', ('{"name": "get_time", "parameters": {}}', [])),
    (
        '{"name": "get_time", "description": "now", "parameters": {}}',
        ('{"name": "get_time", "description": "now", "parameters": {}}', []),
    ),
    (
        '<tool_call>{"name": "get_time", "id": 1}</tool_call>',
        ('<tool_call>{"name": "get_time", "id": 1}</tool_call>', []),
    ),
    (f"{PARIS} That is all.", (None, [("get_weather", '{"city": "Paris", "unit": "celsius"}')])),
    ("It is sunny.", ("It is sunny.", [])),
    ("  It is sunny.", ("  It is sunny.", [])),
    ("", ("", [])),
    ('{"answer": 42}', ('{"answer": 42}', [])),
    ('{"name": "nope", "arguments": {}}', ('{"name": "nope", "arguments": {}}', [])),
    ('{"name": "get_time", "arguments": "now"}', ('{"name": "get_time", "arguments": "now"}', [])),
    ("[1, 2]", ("[1, 2]", [])),
    ('{"name": "get_ti', ('{"name": "get_ti', [])),  # cut short before a call committed
    (
        '{"name": "get_weather", "arguments": {"city": "Pa',
        (None, [("get_weather", '{"city": "Pa')]),
    ),  # cut short after: what was generated
    (
        f"Let me check.\n<tool_call>{PARIS}</tool_call>",
        ("Let me check.\n", [("get_weather", '{"city": "Paris", "unit": "celsius"}')]),
    ),
    (f"```json\n{NOW}\n```\n", (None, [("get_time", "{}")])),
    (f"<tool_call>{NOW}", (None, [("get_time", "{}")])),  # unclosed at the end
    (f"<tool_call>{NOW}</tool_call> and more", (f"<tool_call>{NOW}</tool_call> and more", [])),
    ("Use <b>bold</b> and ```python\nx```", ("Use <b>bold</b> and ```python\nx```", [])),
    ("<tool_call>not json</tool_call>", ("<tool_call>not json</tool_call>", [])),
]


@pytest.mark.parametrize("text, expected", ANSWERS)
def test_answers_read_the_same_whole_and_streamed(text, expected):
    parsed = request()
    whole = parse_answer(parsed, text)
    assert (whole.content, calls_of(whole)) == expected
    for size in (1, 3, 7):
        merged, _ = streamed(parsed, text, size)
        again = assemble(merged)
        assert (again.content, calls_of(again)) == expected


def test_a_call_streams_its_name_first_then_argument_fragments():
    merged, pieces = streamed(request(), PARIS, 4)
    entries = [entry for piece in pieces for entry in piece.tool_calls]
    header, fragments = entries[0], entries[1:]
    assert header["id"].startswith("call_") and len(header["id"]) == 5 + 24
    assert header["type"] == "function" and header["function"]["name"] == "get_weather"
    assert len(fragments) > 3
    assert all(
        set(f) == {"index", "function"} and set(f["function"]) == {"arguments"} for f in fragments
    )
    arguments = header["function"]["arguments"] + "".join(
        f["function"]["arguments"] for f in fragments
    )
    assert json.loads(arguments) == {"city": "Paris", "unit": "celsius"}
    assert merged.content == ""


def test_text_streams_as_it_comes_and_holds_back_a_possible_tag():
    _, pieces = streamed(request(), "Sure <tool", 5)
    assert [p.content for p in pieces] == ["Sure ", "", "<tool"]  # the tag never came
    _, pieces = streamed(request(tools=(STRICT_ADD,)), "Sure <tool", 5)
    assert [p.content for p in pieces] == ["Sure ", "<tool", ""]  # strict: tags are text


def test_strict_auto_reads_tags_as_text():
    text = f"<tool_call>{NOW}</tool_call>"
    answer = parse_answer(request(tools=(STRICT_ADD, TIME)), text)
    assert (answer.content, answer.tool_calls) == (text, [])


def test_without_parallel_calls_only_the_first_counts():
    answer = parse_answer(request(parallel=False), f"[{NOW}, {PARIS}]")
    assert calls_of(answer) == [("get_time", "{}")]
    tagged = f"<tool_call>{NOW}</tool_call><tool_call>{PARIS}</tool_call>"
    assert calls_of(parse_answer(request(parallel=False), tagged)) == [("get_time", "{}")]


def test_a_named_choice_reads_only_that_function():
    answer = parse_answer(request(tool_choice=named("get_weather")), NOW)
    assert (answer.content, answer.tool_calls) == (NOW, [])


def test_finish_reason_is_tool_calls_only_for_a_call_that_ended_normally():
    outputs = ToolOutputs(request())
    message, finish = outputs.message(PARIS, "stop")
    assert finish == "tool_calls" and message["content"] is None
    assert message["tool_calls"][0]["function"]["name"] == "get_weather"
    assert outputs.message(PARIS[:-3], "length")[1] == "length"
    message, finish = outputs.message("Hello", "stop")
    assert (message, finish) == ({"role": "assistant", "content": "Hello"}, "stop")


def test_stream_deltas_of_several_choices_stay_apart():
    outputs = ToolOutputs(request())
    first, _ = outputs.delta(0, PARIS[:45], None)
    other, _ = outputs.delta(1, "Hi", None)
    rest, finish = outputs.delta(0, PARIS[45:], "stop")
    _, other_finish = outputs.delta(1, "!", "stop")
    assert first["tool_calls"][0]["index"] == 0 and "content" not in first
    assert other == {"content": "Hi"}
    assert (finish, other_finish) == ("tool_calls", "stop")
    assert (
        "".join(d["function"]["arguments"] for d in first["tool_calls"] + rest["tool_calls"])
        == '{"city": "Paris", "unit": "celsius"}'
    )


# ---- typed fields (tools/schema.py, for request models) ------------------------------------


def test_typed_tool_fields_read_as_their_json():
    tools = [FunctionTool.model_validate(WEATHER), FunctionTool.model_validate(TIME)]
    choice = NamedToolChoice.model_validate(named("get_weather"))
    fields = {"tools": tools, "tool_choice": choice, "parallel_tool_calls": False}
    sampling: dict[str, object] = {}
    messages, parsed = prepare_chat(fields.get, USER, sampling)
    assert (parsed.choice, parsed.function_name, parsed.parallel) == (
        "function",
        "get_weather",
        False,
    )
    assert parsed.tool("get_time").parameters["properties"] == {}
    assert sampling["structured_output"] == constraint(request(tool_choice=named("get_weather")))
    assert messages[0]["role"] == "system" and messages[1:] == USER


@pytest.mark.parametrize(
    "model, value",
    [
        (FunctionTool, {"type": "retrieval", "function": {"name": "f"}}),
        (FunctionTool, {"type": "function", "function": {"name": "a b"}}),
        (FunctionTool, {"type": "function", "function": {"name": "f", "extra": 1}}),
        (NamedToolChoice, {"type": "function", "function": {"name": 3}}),
        (ToolCall, {"id": "c", "function": {"name": "f"}}),
    ],
)
def test_typed_tool_fields_refuse_bad_shapes(model, value):
    with pytest.raises(pydantic.ValidationError):
        model.model_validate(value)


def test_an_empty_tool_calls_list_is_no_calls():
    message = {"role": "user", "content": "hi", "tool_calls": []}
    assert parse_chat({"messages": [message]}, "m").messages == [{"role": "user", "content": "hi"}]
