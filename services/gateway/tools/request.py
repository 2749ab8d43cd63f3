"""Tool calling: the request's `tools`, `tool_choice` and `parallel_tool_calls` parsed and
validated into a `ToolRequest`, and the constraint that makes the model's answer a valid call
when the choice demands one.

The call format (what the prompt asks for, `prompt.py`; what the grammar allows; what
`calls.py` reads back) is plain JSON, because SmolLM2's template has no tool syntax:

    {"name": "<tool name>", "arguments": {<arguments>}}

and, with `parallel_tool_calls`, also a JSON array of such objects. Enforcement by choice:
- "required": the answer is a call of one of the tools (an array of calls when parallel),
  each call's arguments matching that tool's `parameters` schema.
- a named function: exactly one call of that function.
- "auto": free text or a call. Unconstrained unless a tool sets `strict: true`; then a grammar
  allows either text that starts with neither `{`, `[` nor whitespace, or valid calls (any
  JSON answer is then a valid call, and text cannot smuggle one in after leading blanks).
- "none": tools are neither rendered nor parsed; the answer is plain text.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass

from pydantic import ValidationError

from splitserve.engine.structured_output.grammar import GrammarError, grammar_for
from splitserve.engine.structured_output.spec import StructuredOutput
from splitserve.gateway.errors import RequestError, from_validation
from splitserve.gateway.tools.schema import FunctionTool, NamedToolChoice, ToolFields

# A function without `parameters` takes no arguments: its call carries `{}`.
_NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
# The same compact JSON the grammar engine produces for the "json" kind (grammar.py), for the
# `%json` embedded in the auto grammar: no free whitespace a small model could pad with.
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Text in strict auto mode: anything not starting with a call's first character or a blank.
_AUTO_TEXT = r"/[^\s{\[](?s:.*)/"


class ToolError(RequestError):
    """A bad `tools` / `tool_choice` / `parallel_tool_calls` value or tool turn (HTTP 400
    naming `param`)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message, param)


@dataclass(frozen=True)
class Tool:
    name: str
    description: str | None
    parameters: dict  # JSON schema of the arguments object
    strict: bool


@dataclass(frozen=True)
class ToolRequest:
    tools: tuple[Tool, ...]
    choice: str  # "none", "auto", "required" or "function" (a named one)
    function_name: str | None  # the named function, when choice == "function"
    parallel: bool  # several calls in one answer (parallel_tool_calls)

    def tool(self, name: str) -> Tool | None:
        return next((tool for tool in self.tools if tool.name == name), None)

    @property
    def callable_tools(self) -> tuple[Tool, ...]:
        """The tools an answer may call: the named one only, or all."""
        if self.choice == "function":
            return tuple(tool for tool in self.tools if tool.name == self.function_name)
        return () if self.choice == "none" else self.tools

    @property
    def is_parsed(self) -> bool:
        """Whether answers are read for tool calls at all."""
        return self.choice != "none"

    @property
    def is_strict_auto(self) -> bool:
        return self.choice == "auto" and any(tool.strict for tool in self.tools)

    @property
    def is_enforced(self) -> bool:
        """Whether a grammar constrains the answer (`constraint`)."""
        return self.choice in ("required", "function") or self.is_strict_auto

    @property
    def allows_many(self) -> bool:
        """Whether one answer may hold several calls (a named choice is one call)."""
        return self.parallel and self.choice != "function"


# ---- parsing --------------------------------------------------------------------------------


def parse_tool_request(
    tools: object, tool_choice: object, parallel_tool_calls: object
) -> ToolRequest | None:
    """The request's tool fields (the body's models, or plain JSON), validated; None without
    tools. Raises ToolError naming the field."""
    fields = _tool_fields(tools, tool_choice, parallel_tool_calls)
    parallel = True if fields.parallel_tool_calls is None else fields.parallel_tool_calls
    if fields.tools is None:
        # "none" and "auto" mean the same without tools: answer in text.
        if fields.tool_choice not in (None, "none", "auto"):
            raise ToolError("tool_choice requires tools, unless it is none or auto", "tool_choice")
        return None
    parsed = _tools(fields.tools)
    choice, name = _choice(fields.tool_choice, parsed)
    return ToolRequest(parsed, choice, name, parallel)


def _tool_fields(tools: object, tool_choice: object, parallel_tool_calls: object) -> ToolFields:
    """The fields as their models (tools/schema.py): shapes and types are checked there only,
    with the same messages a chat body's validation gives."""
    raw = {"tools": tools, "tool_choice": tool_choice, "parallel_tool_calls": parallel_tool_calls}
    try:
        return ToolFields.model_validate(raw)
    except ValidationError as error:
        problem = from_validation(error.errors(), raw)
        raise ToolError(str(problem), problem.param or "tools") from None


def _tools(tools: list[FunctionTool]) -> tuple[Tool, ...]:
    parsed = tuple(_tool(i, tool) for i, tool in enumerate(tools))
    names = [tool.name for tool in parsed]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ToolError(f"tools has duplicate function names: {', '.join(duplicates)}", "tools")
    return parsed


def _tool(i: int, tool: FunctionTool) -> Tool:
    function = tool.function
    parameters = _parameters(function.parameters, f"tools[{i}].function.parameters")
    return Tool(function.name, function.description, parameters, bool(function.strict))


def _parameters(value: dict | None, where: str) -> dict:
    """A tool's parameters schema, compiled on its own, so an error names the tool."""
    if value is None:
        return dict(_NO_PARAMETERS)
    if value.get("type", "object") != "object":
        raise ToolError(f'{where} must describe an object ("type": "object")', "tools")
    try:
        grammar_for(StructuredOutput("json", json.dumps(value)))
    except GrammarError as error:
        raise ToolError(f"{where} cannot be enforced: {error}", "tools") from None
    return value


def _choice(value: str | NamedToolChoice | None, tools: tuple[Tool, ...]) -> tuple[str, str | None]:
    if value is None:
        return "auto", None
    if isinstance(value, str):
        return value, None
    name = value.function.name
    if all(tool.name != name for tool in tools):
        raise ToolError(
            f"tool_choice names the function {name!r}, which is not in tools", "tool_choice"
        )
    return "function", name


# ---- the constraint -------------------------------------------------------------------------


def constraint(request: ToolRequest) -> StructuredOutput | None:
    """What the answer must match for `request` (None: free text). Compiled once, with the rest
    of the request's parameters, by the request core (a 400 naming `tools` if it does not)."""
    if not request.is_enforced:
        return None
    if request.is_strict_auto:
        schema = {**calls_schema(request), "x-guidance": _JSON_STYLE}
        return StructuredOutput(
            "grammar",
            f"start: TEXT | calls\nTEXT: {_AUTO_TEXT}\ncalls: %json {json.dumps(schema)}\n",
        )
    return StructuredOutput("json", json.dumps(calls_schema(request)))


def calls_schema(request: ToolRequest) -> dict:
    """A JSON schema whose instances are exactly the valid answers made of calls: one call of
    a callable tool (its arguments matching the tool's parameters), or, when several calls
    are allowed, also a non-empty array of them. Parameter schemas keep their `$defs`, moved
    to the root under `<tool name>.<def name>`, their `$ref`s rewritten to match."""
    defs: dict[str, object] = {}
    calls = [_call_schema(tool, defs) for tool in request.callable_tools]
    one = calls[0] if len(calls) == 1 else {"anyOf": calls}
    schema: dict = {"anyOf": [one, {"type": "array", "items": one, "minItems": 1}]}
    if not request.allows_many:
        schema = one
    return {**schema, "$defs": defs} if defs else schema


def _call_schema(tool: Tool, defs: dict[str, object]) -> dict:
    return {
        "type": "object",
        "properties": {"name": {"const": tool.name}, "arguments": _embedded(tool, defs)},
        "required": ["name", "arguments"],
        "additionalProperties": False,
    }


def _embedded(tool: Tool, defs: dict[str, object]) -> dict:
    """The tool's parameters schema, fit to sit inside a larger schema."""
    parameters = copy.deepcopy(tool.parameters)
    local = {**parameters.pop("definitions", {}), **parameters.pop("$defs", {})}
    refers_to_root = _rewrite_refs(parameters, tool.name)
    for name, schema in local.items():
        refers_to_root |= _rewrite_refs(schema, tool.name)
        defs[f"{tool.name}.{name}"] = schema
    if refers_to_root:  # "#" or "#/properties/..." within the parameters
        defs[tool.name] = parameters
    return parameters


def _rewrite_refs(node: object, prefix: str) -> bool:
    """Points local `$ref`s at the root `$defs` (in place); True if one targets the
    parameters' own root. Remote refs stay as they are (the grammar engine refuses them)."""
    found = False
    if isinstance(node, list):
        for item in node:
            found |= _rewrite_refs(item, prefix)
    elif isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith("#"):
            pointer = ref[1:]
            for defs_key in ("/$defs/", "/definitions/"):
                if pointer.startswith(defs_key):
                    node["$ref"] = f"#/$defs/{prefix}.{pointer[len(defs_key) :]}"
                    break
            else:
                node["$ref"] = f"#/$defs/{prefix}{pointer}"
                found = True
        for key, value in node.items():
            if key != "$ref":
                found |= _rewrite_refs(value, prefix)
    return found
