"""The body fields that constrain the tokens, as pydantic models for the request schemas
(/openapi.json) to declare: `logit_bias`, `response_format` and vLLM's `structured_outputs`.
They check shapes and types; `constraints.py` turns them into engine terms."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from splitserve.engine.sampling_params import MAX_LOGIT_BIAS
from splitserve.gateway.strict_model import StrictModel


class JsonSchemaFormat(StrictModel):
    name: str = Field(description="The schema's name (as OpenAI requires one).")
    schema_: dict[str, Any] | None = Field(
        None, alias="schema", description="A JSON Schema the output must match."
    )
    strict: bool | None = Field(
        None, description="Accepted; the output always matches the schema exactly, strict or not."
    )
    description: str | None = Field(
        None, description="What the output is for (does not change the output)."
    )


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"] = Field(
        description="text: free text; json_object: any JSON object; json_schema: JSON matching "
        "`json_schema.schema`."
    )
    json_schema: JsonSchemaFormat | None = Field(
        None, description="Required with type json_schema."
    )


class StructuredOutputs(StrictModel):
    """vLLM's `structured_outputs` extension: exactly one of its constraint fields."""

    json_: dict[str, Any] | str | None = Field(
        None, alias="json", description="A JSON Schema (object or its text) the output matches."
    )
    regex: str | None = Field(
        None, description="A regular expression (Rust regex syntax) the output matches."
    )
    choice: list[str] | None = Field(
        None, description="The output is exactly one of these strings."
    )
    grammar: str | None = Field(None, description="A Lark or GBNF grammar the output matches.")
    json_object: bool | None = Field(None, description="true: the output is any JSON object.")


class ConstraintFields(StrictModel):
    """The constraining fields both generation endpoints take."""

    logit_bias: dict[str, float] | None = Field(
        None,
        description="Token id (as a string) -> a bias added to that token's logit, in "
        f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]; -100 bans the token. Ids must be in the "
        "vocabulary.",
    )
    response_format: ResponseFormat | None = Field(
        None, description="Constrain the output to JSON (json_object) or to a JSON Schema."
    )
    structured_outputs: StructuredOutputs | None = Field(
        None,
        description="vLLM's extension (send it in `extra_body` with the openai client): "
        "constrain the output with exactly one of json, regex, choice, grammar or json_object. "
        "Not together with a constraining response_format.",
    )
