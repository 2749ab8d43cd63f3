"""What a request asks of the tokens beyond sampling, parsed from the OpenAI body and checked
before anything is scheduled: `logit_bias` (token ids within the vocabulary) and the structured
output of `response_format` or vLLM's `structured_outputs` (compiled by the grammar engine, so a
bad schema, regex or grammar is a 400 naming the field it came from).

`check_params` is the same check for a `SamplingParams` from any entry point (the gRPC API)."""

from __future__ import annotations

import json

from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.structured_output.grammar import grammar_for
from splitserve.engine.structured_output.spec import StructuredOutput
from splitserve.gateway.api_errors import RequestError
from splitserve.gateway.api_schema import ResponseFormat, StructuredOutputs


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
    return StructuredOutput.json_schema(closed_objects(schema))  # type: ignore[arg-type]


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
    (kind, value), = chosen.items()
    try:
        if kind == "json":
            return _json_schema(value, "structured_outputs")  # type: ignore[arg-type]
        if kind == "choice":
            return StructuredOutput.choice(value)  # type: ignore[arg-type]
        if kind == "json_object":
            return StructuredOutput("json_object")
        return StructuredOutput(kind, value)  # type: ignore[arg-type]
    except RequestError:
        raise
    except ValueError as error:
        raise RequestError(f"structured_outputs.{kind}: {error}", "structured_outputs") from None


def check_structured_output(output: StructuredOutput, param: str) -> None:
    """Compiles `output` (cached by its text), so it fails here rather than on a pod."""
    try:
        grammar_for(output)
    except ValueError as error:  # GrammarError, and llguidance's own ValueErrors
        message = str(error).removeprefix("structured_output ")
        raise RequestError(f"{param}: {message}", param) from None


def check_params(params: SamplingParams, vocab_size: int) -> None:
    """What only the gateway can check of a SamplingParams before scheduling: logit_bias ids
    within the vocabulary, and a structured output that compiles. Raises ValueError."""
    for token_id, _ in params.logit_bias:
        if token_id >= vocab_size:
            raise RequestError(
                f"logit_bias token id {token_id} is outside the vocabulary "
                f"(size {vocab_size})",
                "logit_bias",
            )
    if params.structured_output is not None:
        check_structured_output(params.structured_output, "structured_output")

