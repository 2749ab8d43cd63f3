"""The contract for "the output must match this": a kind and its text, as a request carries it
from the OpenAI API through gRPC to the engine. Torch-free and free of the grammar engine."""

from __future__ import annotations

import json
from dataclasses import dataclass

# json: a JSON schema (text); json_object: any JSON object (spec unused); regex: a regular
# expression (Rust regex syntax); choice: a JSON array of strings, exactly one of which is the
# output; grammar: a Lark grammar or a GBNF one (llama.cpp's), told apart by the grammar engine.
KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class StructuredOutput:
    kind: str
    spec: str = ""

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(
                f"structured_output kind must be one of {', '.join(KINDS)}, got {self.kind!r}"
            )
        if not isinstance(self.spec, str):
            raise ValueError(f"structured_output spec must be a string, got {self.spec!r}")
        if self.kind != "json_object" and not self.spec:
            raise ValueError(f"structured_output {self.kind} needs a non-empty spec")

    @classmethod
    def json_schema(cls, schema: dict | str) -> StructuredOutput:
        # Key order is kept: the grammar emits an object's properties in the schema's order.
        text = schema if isinstance(schema, str) else json.dumps(schema)
        return cls("json", text)

    @classmethod
    def choice(cls, options: list[str]) -> StructuredOutput:
        return cls("choice", json.dumps(list(options)))
