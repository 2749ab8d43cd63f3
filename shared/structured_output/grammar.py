"""A `StructuredOutput` turned into llguidance's grammar and checked, without a tokenizer or
torch, so the gateway refuses a bad schema, regex or grammar with a 400 before anything is
scheduled, and the engine checks the same way when a request reaches it directly.

llguidance (rather than xgrammar): it needs neither torch nor transformers, so the torch-free
gateway can validate; it compiles JSON schemas lazily (no ahead-of-time cost per schema), rolls
back consumed tokens (speculative decoding needs that) and reads GBNF as well as Lark.
"""

from __future__ import annotations

import functools
import json
from typing import TYPE_CHECKING

import llguidance

from splitserve.engine.structured_output.spec import StructuredOutput

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions  # declared in the stubs only

# Compact JSON with OpenAI's separators and no free whitespace: a small model given room for
# whitespace can pad with newlines until max_tokens, and the text reads as `{"a": 1, "b": 2}`.
_JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}
_ANY_OBJECT = {"type": "object"}


class GrammarError(ValueError):
    """The request's constraint cannot be compiled; the message names it (HTTP 400)."""


@functools.lru_cache(maxsize=256)
def grammar_for(output: StructuredOutput) -> str:
    """llguidance's grammar for `output`, validated; cached by the spec's text, so a schema
    many requests share is converted once. Raises GrammarError."""
    grammar = _convert(output)
    problem = llguidance.LLMatcher.validate_grammar(grammar)
    if problem:
        raise GrammarError(f"structured_output {output.kind} is invalid: {problem.strip()}")
    return grammar


def _convert(output: StructuredOutput) -> str:
    matcher = llguidance.LLMatcher
    try:
        if output.kind == "json":
            schema = json.loads(output.spec)
            if not isinstance(schema, dict | bool):
                raise GrammarError("structured_output json must be a JSON schema object")
            # The text itself: llguidance takes a schema as text or a dict (true/false too).
            return matcher.grammar_from_json_schema(output.spec, defaults=_JSON_OPTIONS)
        if output.kind == "json_object":
            return matcher.grammar_from_json_schema(_ANY_OBJECT, defaults=_JSON_OPTIONS)
        if output.kind == "choice":
            return _choice_grammar(json.loads(output.spec))
        if output.kind == "regex":
            return matcher.grammar_from_regex(output.spec)
        return llguidance.grammar_from("grammar", output.spec)
    except json.JSONDecodeError as error:
        raise GrammarError(f"structured_output {output.kind} is not valid JSON: {error}") from None
    except GrammarError:
        raise
    except ValueError as error:  # llguidance's GBNF converter and JSON option checks
        raise GrammarError(f"structured_output {output.kind} is invalid: {error}") from None


def _choice_grammar(options: object) -> str:
    if (
        not isinstance(options, list)
        or not options
        or not all(isinstance(option, str) and option for option in options)
    ):
        raise GrammarError("structured_output choice must be a non-empty list of non-empty strings")
    # Lark string literals take JSON's escapes, so json.dumps quotes any text safely.
    return llguidance.LLMatcher.grammar_from_lark(
        "start: " + " | ".join(json.dumps(option) for option in options)
    )
