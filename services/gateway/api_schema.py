"""The OpenAI HTTP API's request bodies as pydantic models: FastAPI validates against them and
serves them in /openapi.json, so every field a client may send is listed with its type, range
and meaning.

Validation is strict (no lax coercion: "max_tokens": "10" is refused) and closed: a field not
declared here is a 400 naming it (`extra="forbid"`). Three kinds of declared field:
- honoured fields, with their types; ranges appear in the schema as documentation only, since
  `SamplingParams` is the one place sampling ranges are checked (every entry point then refuses
  the same values with the same message);
- OpenAI's bookkeeping fields (`user`, `metadata`, ...), accepted and not changing the output;
- known fields this server does not honour (`UNSUPPORTED`): accepted only at their neutral value
  (null, false, ...), anything else is a 400 naming the field (checked in openai_protocol).
`tools`, `tool_choice` and `parallel_tool_calls` take the shapes of `tool_schema.py`; the
tool-calling code (`tools.py`) checks the rest.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field

from splitserve.engine.sampling_params import MAX_LOGIT_BIAS, MAX_LOGPROBS
from splitserve.gateway.tools.schema import (
    PARALLEL_DESCRIPTION,
    TOOL_CALL_ID_DESCRIPTION,
    TOOL_CALLS_DESCRIPTION,
    TOOL_CHOICE_DESCRIPTION,
    TOOLS_DESCRIPTION,
    FunctionTool,
    ToolCall,
    ToolChoice,
)


class StrictModel(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", populate_by_name=True)


def _doc(description: str, default: Any = None, **bounds: float) -> Any:
    """A field documented (and bounded) in the schema only; `bounds` are JSON Schema keywords
    (minimum, maximum, exclusiveMinimum) that SamplingParams enforces."""
    return Field(default, description=description, json_schema_extra=bounds or None)


def _unsupported(what: str) -> Any:
    return Field(None, description=f"Not supported: {what}. Any other value is a 400.")


def _bookkeeping(description: str) -> Any:
    return Field(None, description=f"{description} Accepted; does not change the output.")


# ---- shared pieces --------------------------------------------------------------------------


class StreamOptions(StrictModel):
    include_usage: bool | None = _doc("Send a last chunk with the whole request's usage.")
    continuous_usage_stats: bool | None = _doc(
        "vLLM's extension: every chunk carries the usage so far (prompt, completion and total "
        "tokens)."
    )


class JsonSchemaFormat(StrictModel):
    name: str = Field(description="The schema's name (as OpenAI requires one).")
    schema_: dict[str, Any] | None = Field(
        None, alias="schema", description="A JSON Schema the output must match."
    )
    strict: bool | None = _doc(
        "Accepted; the output always matches the schema exactly, strict or not."
    )
    description: str | None = _doc("What the output is for (does not change the output).")


class ResponseFormat(StrictModel):
    type: Literal["text", "json_object", "json_schema"] = Field(
        description="text: free text; json_object: any JSON object; json_schema: JSON matching "
        "`json_schema.schema`."
    )
    json_schema: JsonSchemaFormat | None = _doc("Required with type json_schema.")


class StructuredOutputs(StrictModel):
    """vLLM's `structured_outputs` extension: exactly one of its constraint fields."""

    json_: dict[str, Any] | str | None = Field(
        None, alias="json", description="A JSON Schema (object or its text) the output matches."
    )
    regex: str | None = _doc("A regular expression (Rust regex syntax) the output matches.")
    choice: list[str] | None = _doc("The output is exactly one of these strings.")
    grammar: str | None = _doc("A Lark or GBNF grammar the output matches.")
    json_object: bool | None = _doc("true: the output is any JSON object.")


_LOGIT_BIAS_DOC = (
    "Token id (as a string) -> a bias added to that token's logit, in "
    f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]; -100 bans the token. Ids must be in the "
    "vocabulary."
)
_STRUCTURED_DOC = (
    "vLLM's extension (send it in `extra_body` with the openai client): constrain the output "
    "with exactly one of json, regex, choice, grammar or json_object. Not together with a "
    "constraining response_format."
)
_RESPONSE_FORMAT_DOC = "Constrain the output to JSON (json_object) or to a JSON Schema."


class SamplingFields(StrictModel):
    """What both generation endpoints take: SamplingParams' fields under their own names
    (except max_tokens and logprobs, which each endpoint spells its own way)."""

    # Each SamplingParams field is here (tests/test_openai_schema.py checks).
    n: int | None = _doc("Sequences per prompt.", minimum=1, maximum=128)
    temperature: float | None = _doc("0 is greedy.", minimum=0, maximum=100)
    top_p: float | None = _doc("Nucleus sampling mass.", exclusiveMinimum=0, maximum=1)
    top_k: int | None = _doc("Keep the k likeliest tokens; 0 or -1 is off.", minimum=-1)
    min_p: float | None = _doc("Drop tokens below min_p x the top probability.", minimum=0,
                               maximum=1)
    seed: int | None = _doc("Seed of this request's sampling.", minimum=-(2**63),
                            maximum=2**63 - 1)
    presence_penalty: float | None = _doc("OpenAI's presence penalty.", minimum=-2, maximum=2)
    frequency_penalty: float | None = _doc("OpenAI's frequency penalty.", minimum=-2, maximum=2)
    repetition_penalty: float | None = _doc(
        "vLLM's repetition penalty (1 is off).", exclusiveMinimum=0, maximum=10
    )
    stop: str | list[str] | None = _doc("Strings that end a sequence (not included).")
    stop_token_ids: list[int] | None = _doc("Token ids that end a sequence.")
    ignore_eos: bool | None = _doc("Keep generating past EOS.")
    skip_special_tokens: bool | None = _doc("Leave special tokens out of the text.")
    min_tokens: int | None = _doc("Generate at least this many tokens.", minimum=0)
    cache_salt: str | None = _doc(
        "vLLM's extension: only requests with the same salt share cached prompt prefixes."
    )
    cache_retention_s: float | None = _doc(
        "How long this request's cached prompt blocks should stay after it (seconds).",
        exclusiveMinimum=0,
    )

    logit_bias: dict[str, float] | None = _doc(_LOGIT_BIAS_DOC)
    response_format: ResponseFormat | None = _doc(_RESPONSE_FORMAT_DOC)
    structured_outputs: StructuredOutputs | None = _doc(_STRUCTURED_DOC)

    model: str | None = _doc("The served model's id (GET /v1/models); may be left out.")
    stream: bool | None = _doc("Answer with server-sent events.")
    stream_options: StreamOptions | None = None
    return_token_ids: bool | None = _doc("vLLM's extension: each choice carries its token ids.")
    priority: int | None = _doc("vLLM's extension: lower is scheduled first.")

    user: str | None = _bookkeeping("An end-user id.")
    metadata: dict[str, str] | None = _bookkeeping("Tags for the request.")
    store: bool | None = Field(None, description="Only false: nothing is stored.")
    service_tier: Literal["auto", "default"] | None = _bookkeeping("auto or default.")
    prompt_cache_key: str | None = _doc(
        "Requests sharing this key are routed to the same decode pod (its prefix cache); does "
        "not change the output."
    )
    prompt_cache_retention: str | None = _doc(
        'OpenAI\'s: "in_memory" (the server\'s own window) or "24h": how long the prompt\'s '
        "cached blocks should be kept (a soft window, bounded by the server's maximum)."
    )
    safety_identifier: str | None = _bookkeeping("An end-user id.")

    # vLLM's and older OpenAI fields this server does not honour.
    prompt_logprobs: int | None = _unsupported("prompt logprobs")
    truncate_prompt_tokens: int | None = _unsupported("prompt truncation")
    include_stop_str_in_output: bool | None = _unsupported("false only")
    use_beam_search: bool | None = _unsupported("beam search (false only)")
    allowed_token_ids: list[int] | None = _unsupported("use logit_bias")
    bad_words: list[str] | None = _unsupported("use logit_bias")
    guided_json: Any = _unsupported("vLLM's old name; use structured_outputs.json")
    guided_regex: Any = _unsupported("vLLM's old name; use structured_outputs.regex")
    guided_choice: Any = _unsupported("vLLM's old name; use structured_outputs.choice")
    guided_grammar: Any = _unsupported("vLLM's old name; use structured_outputs.grammar")

    # field -> the values that ask for nothing (accepted); anything else is a 400.
    UNSUPPORTED: ClassVar[dict[str, tuple[object, ...]]] = {
        "prompt_logprobs": (None,),
        "truncate_prompt_tokens": (None,),
        "include_stop_str_in_output": (None, False),
        "use_beam_search": (None, False),
        "allowed_token_ids": (None,),
        "bad_words": (None, []),
        "guided_json": (None,),
        "guided_regex": (None,),
        "guided_choice": (None,),
        "guided_grammar": (None,),
        "store": (None, False),
    }


# ---- /v1/completions ------------------------------------------------------------------------

Prompt = str | list[int] | list[str] | list[list[int]]


class CompletionBody(SamplingFields):
    prompt: Prompt = Field(
        description="A text, a list of token ids, or a non-empty list of either (one choice "
        "per prompt and n)."
    )
    max_tokens: int | None = _doc("Tokens to generate (default 16).", minimum=1)
    logprobs: int | None = _doc(
        "Top alternatives per generated token.", minimum=0, maximum=MAX_LOGPROBS
    )
    echo: bool | None = _doc(
        "Put the prompt's text before each choice's text (not together with logprobs: prompt "
        "logprobs are not computed)."
    )
    best_of: int | None = _doc("Only equal to n (no beam search).", minimum=1)
    add_special_tokens: bool | None = _doc(
        "vLLM's extension: tokenize a text prompt with the model's BOS/EOS (default true)."
    )
    suffix: str | None = _unsupported("insertion (suffix); null or empty only")

    UNSUPPORTED: ClassVar[dict[str, tuple[object, ...]]] = {
        **SamplingFields.UNSUPPORTED,
        "suffix": (None, ""),
    }


# ---- /v1/chat/completions -------------------------------------------------------------------


class CacheControl(StrictModel):
    """Anthropic's prompt-caching marker: keep this prompt's cached blocks for the ttl."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None


_CACHE_CONTROL_DOC = 'Keep the prompt cached for ttl ("5m" default, or "1h"), a soft window.'


class TextPart(StrictModel):
    type: Literal["text"] = Field(description="Only text parts: the model reads text only.")
    text: str
    cache_control: CacheControl | None = _doc(_CACHE_CONTROL_DOC)


class ChatMessage(StrictModel):
    role: str = Field(
        description="system, user, assistant, tool, ...", json_schema_extra={"minLength": 1}
    )
    content: str | list[TextPart] | None = None
    name: str | None = _doc("A participant's name (not rendered by every template).")
    tool_calls: list[ToolCall] | None = _doc(TOOL_CALLS_DESCRIPTION)
    tool_call_id: str | None = _doc(TOOL_CALL_ID_DESCRIPTION)
    cache_control: CacheControl | None = _doc(_CACHE_CONTROL_DOC)
    # What the openai client echoes back from an earlier answer's message; ignored.
    refusal: str | None = None
    annotations: Any = None
    audio: Any = None
    function_call: Any = None
    reasoning_content: str | None = None


class ChatBody(SamplingFields):
    messages: list[ChatMessage] = Field(
        description="The conversation so far (non-empty).", json_schema_extra={"minItems": 1}
    )
    max_completion_tokens: int | None = _doc(
        "Tokens to generate (default: the rest of the context).", minimum=1
    )
    max_tokens: int | None = _doc("The older name of max_completion_tokens.", minimum=1)
    logprobs: bool | None = _doc("Return the generated tokens' logprobs.")
    top_logprobs: int | None = _doc(
        "Top alternatives per token (needs logprobs).", minimum=0, maximum=MAX_LOGPROBS
    )
    add_generation_prompt: bool | None = _doc(
        "vLLM's extension: end the rendered prompt with the assistant's header (default true)."
    )

    tools: list[FunctionTool] | None = _doc(TOOLS_DESCRIPTION)
    tool_choice: ToolChoice | None = _doc(TOOL_CHOICE_DESCRIPTION)
    parallel_tool_calls: bool | None = _doc(PARALLEL_DESCRIPTION)

    modalities: list[Literal["text"]] | None = _doc("Only [\"text\"].")
    audio: Any = _unsupported("audio output")
    prediction: Any = _unsupported("predicted outputs")
    web_search_options: Any = _unsupported("web search")
    reasoning_effort: str | None = _unsupported("reasoning effort (not a reasoning model)")
    verbosity: str | None = _unsupported("verbosity")
    functions: Any = _unsupported("the deprecated functions; use tools")
    function_call: Any = _unsupported("the deprecated function_call; use tool_choice")
    echo: bool | None = _unsupported("vLLM's chat echo (false only)")
    continue_final_message: bool | None = _unsupported("false only")
    chat_template: str | None = _unsupported("the model's own template is used")
    chat_template_kwargs: dict[str, Any] | None = _unsupported("template arguments")

    UNSUPPORTED: ClassVar[dict[str, tuple[object, ...]]] = {
        **SamplingFields.UNSUPPORTED,
        "audio": (None,),
        "prediction": (None,),
        "web_search_options": (None,),
        "reasoning_effort": (None,),
        "verbosity": (None,),
        "functions": (None,),
        "function_call": (None,),
        "echo": (None, False),
        "continue_final_message": (None, False),
        "chat_template": (None,),
        "chat_template_kwargs": (None, {}),
    }
