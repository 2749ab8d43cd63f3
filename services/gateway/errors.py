"""Bad input, for every part of the gateway: `RequestError` (a ValueError naming the request field
at fault), OpenAI's error body, and pydantic's validation errors turned into one RequestError
whose `param` names the offending field and whose message starts with it. At the package root,
below `api/`, `tools/`, `structured/` and the request core, which all raise it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from pydantic_core import ErrorDetails

from splitserve.engine.sampling_params import COMPOSITE_FIELDS, FIELD_TYPES

# Names a ValueError's message may start with that are request fields.
_PARAM_NAMES = frozenset({*FIELD_TYPES, *COMPOSITE_FIELDS, "prompt", "messages"})
# Fields whose list items are reported as the param ("messages[2]"), as they were before the
# bodies had schemas; other lists report the field itself.
_ITEM_PARAMS = frozenset({"messages", "input"})
# What a field may be, by its place in the body (an index as "[]") or its name alone: an error at
# the field itself (every alternative of a union failing, or a value of the wrong shape) says so
# instead of pydantic's words for one alternative.
_EXPECTED = {
    "prompt": "a string, a list of token ids, or a non-empty list of either",
    "stop": "a string or a list of strings",
    "content": "a string or a list of text parts",
    "input": "a string or a list of message items",
    "tools": "a non-empty array of function tools",
    "tools[].type": '"function": a tool is {"type": "function", "function": {"name": ...}}',
    "tools[].function": 'an object {"name": ..., "description": ..., "parameters": ..., '
    '"strict": ...}',
    "tools[].function.name": "1 to 64 letters, digits, '_' or '-'",
    "tool_choice": 'one of the strings "none", "auto", "required", or a named function '
    '{"type": "function", "function": {"name": ...}}',
}


class RequestError(ValueError):
    """Bad input: HTTP 400 with OpenAI's error body."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_value"):
        super().__init__(message)
        self.param = param
        self.code = code


def error_body(message: str, error_type: str, param: str | None, code: str | None) -> dict:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def param_of(error: ValueError) -> str | None:
    """The parameter a ValueError names: by house rule its message starts with it."""
    if isinstance(error, RequestError):
        return error.param
    first = str(error).split(" ", 1)[0]
    return first if first in _PARAM_NAMES else None


def from_validation(
    errors: Sequence[ErrorDetails], body: object, expected: Mapping[str, str] | None = None
) -> RequestError:
    """The first offending field of pydantic's `errors` (locations relative to `body`) as one
    RequestError; several errors of one field (the alternatives of a union) become one.
    `expected`: what each field may be, for an API whose fields differ from OpenAI's."""
    if not errors:
        return RequestError("the request is invalid", code="invalid_value")
    first = errors[0]
    kind = first["type"]
    if kind == "json_invalid":
        detail = first.get("ctx", {}).get("error", first["msg"])
        return RequestError(f"the request body is not valid JSON: {detail}", code="invalid_json")
    path = _path(first["loc"], body, kind)
    if not path:
        return RequestError(
            "the request body must be a JSON object (sent as Content-Type: application/json)",
            code="invalid_type",
        )
    name = _name(path)
    param = _param(path)
    if kind == "extra_forbidden":
        return RequestError(f"{name} is not a recognized parameter", param, "unknown_parameter")
    if kind == "missing":
        code = "missing_required_parameter" if len(path) == 1 else "invalid_type"
        return RequestError(f"{name} is required", param, code)
    field = _field(path)
    shapes = _EXPECTED if expected is None else expected
    shape = shapes.get(_pattern(field)) or shapes.get(str(field[-1]))
    if shape is not None:
        return RequestError(f"{_name(field)} must be {shape}", param, "invalid_type")
    code = "invalid_type" if kind.endswith("_type") or kind == "model_type" else "invalid_value"
    return RequestError(f"{name}: {first['msg']}", param, code)


def _path(loc: Sequence[str | int], body: object, kind: str) -> list[str | int]:
    """`loc` without FastAPI's "body" head and pydantic's union tags ("list[int]", ...): the
    keys and indexes that exist in `body`, plus a missing field's name at the end (`kind`
    "missing")."""
    parts = list(loc[1:] if loc[:1] == ("body",) else loc)
    path: list[str | int] = []
    node = body
    for i, part in enumerate(parts):
        if _holds(node, part):
            node = node[part]  # type: ignore[index]
        elif kind == "missing" and i == len(parts) - 1 and isinstance(node, dict):
            pass  # a missing field: named, though absent
        else:
            continue  # a union's tag, not a place in the body
        path.append(part)
    return path


def _holds(node: object, part: str | int) -> bool:
    if isinstance(node, dict):
        return part in node
    return isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node)


def _field(path: list[str | int]) -> list[str | int]:
    """The field an error's `path` lies in: the path without the list indexes at its end (an
    item of `stop` is reported as `stop`, whose expected shape says what its items may be)."""
    end = len(path)
    while end > 1 and isinstance(path[end - 1], int):
        end -= 1
    return path[:end]


def _pattern(path: list[str | int]) -> str:
    """`path` with its indexes as "[]": "tools[].function" for tools[2].function."""
    return "".join("[]" if isinstance(part, int) else f".{part}" for part in path).lstrip(".")


def _name(path: list[str | int]) -> str:
    text = str(path[0])
    for part in path[1:]:
        text += f"[{part}]" if isinstance(part, int) else f".{part}"
    return text


def _param(path: list[str | int]) -> str:
    if path[0] in _ITEM_PARAMS and len(path) > 1 and isinstance(path[1], int):
        return f"{path[0]}[{path[1]}]"
    return str(path[0])
