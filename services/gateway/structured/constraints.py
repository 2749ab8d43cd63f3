"""What a request asks of the tokens beyond sampling, parsed from the OpenAI body into engine
terms: `logit_bias` (token ids as integers) and the structured output of `response_format` or
vLLM's `structured_outputs`, with the field it came from. A malformed field is a 400 naming it
here; whether the ids fit the vocabulary and the constraint compiles is the engine's one check
(`splitserve.engine.params_check`), which the request core runs before anything is scheduled
and names the same field in its 400 (`GenerationRequest.structured_output_param`)."""

from __future__ import annotations

import json
from typing import Any, overload

from splitserve.engine.structured_output.spec import StructuredOutput
from splitserve.gateway.errors import RequestError
from splitserve.gateway.structured.schema import ResponseFormat, StructuredOutputs


def parse_logit_bias(raw: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's {"token id": bias} as SamplingParams takes it (ranges checked there)."""
    if not raw:
        return None
    bias: dict[int, float] = {}
    for key, value in raw.items():
        if not (key.isascii() and key.isdigit()):
            raise RequestError(
                f"logit_bias keys must be token ids (non-negative integers), got {key!r}",
                "logit_bias",
            )
        bias[int(key)] = value
    return bias


def parse_structured_output(
    response_format: ResponseFormat | None, structured_outputs: StructuredOutputs | None
) -> tuple[StructuredOutput, str] | None:
    """The constraint the body asks for, with the field it came from (for errors); None for
    free text. Raises RequestError naming the field."""
    from_format = _from_response_format(response_format)
    from_extension = _from_structured_outputs(structured_outputs)
    if from_format is not None and from_extension is not None:
        raise RequestError(
            "structured_outputs cannot be combined with a constraining response_format",
            "structured_outputs",
        )
    if from_format is not None:
        return from_format, "response_format"
    if from_extension is not None:
        return from_extension, "structured_outputs"
    return None


# Keywords whose value is one subschema, a list of them, or a name -> subschema mapping.
_SUBSCHEMA = ("items", "additionalProperties", "not", "if", "then", "else", "contains")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")


@overload
def closed_objects(schema: dict[str, Any]) -> dict[str, Any]: ...
@overload
def closed_objects(schema: object) -> object: ...
def closed_objects(schema: object) -> object:
    """`schema` with `additionalProperties: false` on every object that lists `properties` and
    says nothing about others, as OpenAI's strict mode requires and vLLM's default grammar
    backend assumes: otherwise a model may append keys of its own until max_tokens. Free-form
    objects (no `properties`) stay open. Returns a copy."""
    if isinstance(schema, list):
        return [closed_objects(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = dict(schema)
    for key in _SUBSCHEMA:
        if isinstance(closed.get(key), dict | list):
            closed[key] = closed_objects(closed[key])
    for key in _SUBSCHEMA_LISTS:
        if isinstance(closed.get(key), list):
            closed[key] = closed_objects(closed[key])
    for key in _SUBSCHEMA_MAPS:
        if isinstance(closed.get(key), dict):
            closed[key] = {name: closed_objects(sub) for name, sub in closed[key].items()}
    if isinstance(closed.get("properties"), dict) and "additionalProperties" not in closed:
        closed["additionalProperties"] = False
    return closed


def _json_schema(schema: dict | str, param: str) -> StructuredOutput:
    """A JSON-schema constraint (objects closed, see `closed_objects`); a schema given as text
    must parse."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as error:
            raise RequestError(f"{param}: the schema is not valid JSON: {error}", param) from None
    if not isinstance(schema, dict):
        raise RequestError(f"{param}: the schema must be a JSON object", param)
    return StructuredOutput.json_schema(closed_objects(schema))


def _from_response_format(response_format: ResponseFormat | None) -> StructuredOutput | None:
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return StructuredOutput("json_object")
    spec = response_format.json_schema
    if spec is None or spec.schema_ is None:
        raise RequestError(
            "response_format.json_schema.schema is required with type json_schema",
            "response_format",
        )
    return _json_schema(spec.schema_, "response_format")


def _from_structured_outputs(body: StructuredOutputs | None) -> StructuredOutput | None:
    if body is None:
        return None
    candidates = {
        "json": body.json_,
        "regex": body.regex,
        "choice": body.choice,
        "grammar": body.grammar,
        "json_object": body.json_object or None,
    }
    chosen = {kind: value for kind, value in candidates.items() if value is not None}
    if len(chosen) != 1:
        raise RequestError(
            "structured_outputs must set exactly one of json, regex, choice, grammar, "
            f"json_object; got {sorted(chosen) or 'none'}",
            "structured_outputs",
        )
    (kind,) = chosen
    try:
        return _chosen_structured_output(body)
    except RequestError:
        raise
    except ValueError as error:
        raise RequestError(f"structured_outputs.{kind}: {error}", "structured_outputs") from None


def _chosen_structured_output(body: StructuredOutputs) -> StructuredOutput:
    """The constraint of the one field `body` sets (`_from_structured_outputs` checked that)."""
    if body.json_ is not None:
        return _json_schema(body.json_, "structured_outputs")
    if body.choice is not None:
        return StructuredOutput.choice(body.choice)
    if body.json_object:
        return StructuredOutput("json_object")
    if body.regex is not None:
        return StructuredOutput("regex", body.regex)
    assert body.grammar is not None, "exactly one field is set"
    return StructuredOutput("grammar", body.grammar)
