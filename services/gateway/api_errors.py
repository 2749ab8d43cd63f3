"""Bad input as OpenAI's 400 body: `RequestError`, and pydantic's validation errors turned into
one whose `param` names the offending field and whose message starts with it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from splitserve.engine.sampling_params import COMPOSITE_FIELDS, FIELD_TYPES
from splitserve.gateway.tools.request import ToolError

# Names a ValueError's message may start with that are request fields.
_PARAM_NAMES = frozenset({*FIELD_TYPES, *COMPOSITE_FIELDS, "prompt", "messages"})
# Fields whose list items are reported as the param ("messages[2]"), as they were before the
# bodies had schemas; other lists report the field itself.
_ITEM_PARAMS = frozenset({"messages", "input"})
# Several alternatives' errors for one field (a union) say what the field may be instead.
_EXPECTED = {
    "prompt": "a string, a list of token ids, or a non-empty list of either",
    "stop": "a string or a list of strings",
    "content": "a string or a list of text parts",
    "input": "a string or a list of message items",
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
    if isinstance(error, RequestError | ToolError):
        return error.param
    first = str(error).split(" ", 1)[0]
    return first if first in _PARAM_NAMES else None


def from_validation(errors: Sequence[dict[str, Any]], body: object) -> RequestError:
    """The first offending field of pydantic's `errors` (locations relative to `body`) as one
    RequestError; several errors of one field (the alternatives of a union) become one."""
    if not errors:
        return RequestError("the request is invalid", code="invalid_value")
    first = errors[0]
    kind = first["type"]
    if kind == "json_invalid":
        detail = first.get("ctx", {}).get("error", first["msg"])
        return RequestError(f"the request body is not valid JSON: {detail}", code="invalid_json")
    path = _path(first["loc"], body)
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
    same_field = [e for e in errors if _path(e["loc"], body)[:1] == path[:1]]
    field = str(path[-1]) if isinstance(path[-1], str) else str(path[0])
    if len(same_field) > 1 and field in _EXPECTED:
        return RequestError(f"{name} must be {_EXPECTED[field]}", param, "invalid_type")
    code = "invalid_type" if kind.endswith("_type") or kind == "model_type" else "invalid_value"
    return RequestError(f"{name}: {first['msg']}", param, code)


def _path(loc: Sequence[str | int], body: object) -> list[str | int]:
    """`loc` without FastAPI's "body" head and pydantic's union tags ("list[int]", ...): the
    keys and indexes that exist in `body`, plus a missing field's name at the end."""
    parts = list(loc[1:] if loc[:1] == ("body",) else loc)
    path: list[str | int] = []
    node = body
    for i, part in enumerate(parts):
        if _holds(node, part):
            node = node[part]  # type: ignore[index]
        elif i == len(parts) - 1 and isinstance(node, dict) and isinstance(part, str):
            pass  # a missing field: named, though absent
        else:
            continue  # a union's tag, not a place in the body
        path.append(part)
    return path


def _holds(node: object, part: str | int) -> bool:
    if isinstance(node, dict):
        return part in node
    return isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node)


def _name(path: list[str | int]) -> str:
    text = str(path[0])
    for part in path[1:]:
        text += f"[{part}]" if isinstance(part, int) else f".{part}"
    return text


def _param(path: list[str | int]) -> str:
    if path[0] in _ITEM_PARAMS and len(path) > 1 and isinstance(path[1], int):
        return f"{path[0]}[{path[1]}]"
    return str(path[0])
