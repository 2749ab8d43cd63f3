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
import re
from dataclasses import dataclass

from splitserve.engine.structured_output.grammar import GrammarError, grammar_for
from splitserve.engine.structured_output.spec import StructuredOutput

CHOICES = ("none", "auto", "required")
# OpenAI's rule for function names; names go into the prompt, the grammar and the answer.
_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_TOOL_KEYS = frozenset({"type", "function"})
_FUNCTION_KEYS = frozenset({"name", "description", "parameters", "strict"})
# A function without `parameters` takes no arguments: its call carries `{}`.
_NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}
# The same compact JSON the grammar engine produces for the "json" kind (grammar.py), for the
# `%json` embedded in the auto grammar: no free whitespace a small model could pad with.
_JSON_STYLE = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
# Text in strict auto mode: anything not starting with a call's first character or a blank.
_AUTO_TEXT = r"/[^\s{\[](?s:.*)/"


class ToolError(ValueError):
    """A bad `tools` / `tool_choice` / `parallel_tool_calls` value (HTTP 400 naming `param`)."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


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
    def allows_many(self) -> bool:
        """Whether one answer may hold several calls (a named choice is one call)."""
        return self.parallel and self.choice != "function"


# ---- parsing --------------------------------------------------------------------------------


def parse_tool_request(
    tools: object, tool_choice: object, parallel_tool_calls: object
) -> ToolRequest | None:
    """The request's tool fields, validated (ToolError names the field); None without tools."""
    parallel = _parallel(parallel_tool_calls)
    if tools is None:
        # "none" and "auto" mean the same without tools: answer in text.
        if tool_choice not in (None, "none", "auto"):
            raise ToolError("tool_choice requires tools, unless it is none or auto", "tool_choice")
        return None
    parsed = _tools(tools)
    choice, name = _choice(tool_choice, parsed)
    request = ToolRequest(parsed, choice, name, parallel)
    _check_constraint(request)
    return request


def _parallel(value: object) -> bool:
    if value is None:
        return True  # OpenAI's default
    if not isinstance(value, bool):
        raise ToolError("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    return value


def _tools(value: object) -> tuple[Tool, ...]:
    if not isinstance(value, list) or not value:
        raise ToolError("tools must be a non-empty array of function tools", "tools")
    tools = tuple(_tool(i, item) for i, item in enumerate(value))
    names = [tool.name for tool in tools]
    duplicates = sorted({name for name in names if names.count(name) > 1})
    if duplicates:
        raise ToolError(f"tools has duplicate function names: {', '.join(duplicates)}", "tools")
    return tools


def _tool(i: int, item: object) -> Tool:
    where = f"tools[{i}]"
    if not isinstance(item, dict) or item.get("type") != "function":
        raise ToolError(f'{where} must be an object with "type": "function"', "tools")
    _no_unknown_keys(item, _TOOL_KEYS, where)
    function = item.get("function")
    if not isinstance(function, dict):
        raise ToolError(f"{where}.function must be an object", "tools")
    _no_unknown_keys(function, _FUNCTION_KEYS, f"{where}.function")
    name = function.get("name")
    if not isinstance(name, str) or not _NAME.match(name):
        raise ToolError(
            f"{where}.function.name must be 1 to 64 letters, digits, '_' or '-', got {name!r}",
            "tools",
        )
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise ToolError(f"{where}.function.description must be a string", "tools")
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise ToolError(f"{where}.function.strict must be a boolean", "tools")
    parameters = _parameters(function.get("parameters"), f"{where}.function.parameters")
    return Tool(name, description, parameters, bool(strict))


def _no_unknown_keys(item: dict, known: frozenset[str], where: str) -> None:
    unknown = sorted(set(item) - known)
    if unknown:
        raise ToolError(f"{where} has unsupported fields: {', '.join(unknown)}", "tools")


def _parameters(value: object, where: str) -> dict:
    if value is None:
        return dict(_NO_PARAMETERS)
    if not isinstance(value, dict):
        raise ToolError(f"{where} must be a JSON schema object", "tools")
    if value.get("type", "object") != "object":
        raise ToolError(f'{where} must describe an object ("type": "object")', "tools")
    try:
        grammar_for(StructuredOutput("json", json.dumps(value)))
    except GrammarError as error:
        raise ToolError(f"{where} cannot be enforced: {error}", "tools") from None
    return value


def _choice(value: object, tools: tuple[Tool, ...]) -> tuple[str, str | None]:
    if value is None:
        return "auto", None
    if isinstance(value, str):
        if value not in CHOICES:
            raise ToolError(
                f"tool_choice must be one of {', '.join(CHOICES)} or a named function, "
                f"got {value!r}",
                "tool_choice",
            )
        return value, None
    function = value.get("function") if isinstance(value, dict) else None
    if (
        not isinstance(value, dict)
        or value.get("type") != "function"
        or set(value) != {"type", "function"}
        or not isinstance(function, dict)
        or set(function) != {"name"}
        or not isinstance(function["name"], str)
    ):
        raise ToolError(
            'tool_choice must be a string or {"type": "function", "function": {"name": ...}}',
            "tool_choice",
        )
    name = function["name"]
    if all(tool.name != name for tool in tools):
        raise ToolError(
            f"tool_choice names the function {name!r}, which is not in tools", "tool_choice"
        )
    return "function", name


# ---- the constraint -------------------------------------------------------------------------


def constraint(request: ToolRequest) -> StructuredOutput | None:
    """What the answer must match for `request` (None: free text)."""
    if request.choice in ("required", "function"):
        return StructuredOutput("json", json.dumps(calls_schema(request)))
    if request.is_strict_auto:
        schema = {**calls_schema(request), "x-guidance": _JSON_STYLE}
        return StructuredOutput(
            "grammar",
            f"start: TEXT | calls\nTEXT: {_AUTO_TEXT}\ncalls: %json {json.dumps(schema)}\n",
        )
    return None


def _check_constraint(request: ToolRequest) -> None:
    output = constraint(request)
    if output is None:
        return
    try:
        grammar_for(output)
    except GrammarError as error:
        raise ToolError(f"tools cannot be enforced together: {error}", "tools") from None


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
