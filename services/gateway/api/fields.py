"""What /v1/completions and /v1/chat/completions share: the body fields (`SamplingFields`, a
strict pydantic model FastAPI validates and serves in /openapi.json) and what they parse into
(`CommonOptions`).

Validation is strict (no lax coercion: "max_tokens": "10" is refused) and closed: a field not
declared is a 400 naming it (`extra="forbid"`). Three kinds of declared field:
- honoured fields, with their types; ranges appear in the schema as documentation only, since
  `SamplingParams` is the one place sampling ranges are checked (every entry point then refuses
  the same values with the same message);
- OpenAI's bookkeeping fields (`user`, `metadata`, ...), accepted and not changing the output;
- known fields this server does not honour (`UNSUPPORTED`): accepted only at their neutral value
  (null, false, ...), anything else is a 400 naming the field (`check_unsupported`).
The constraining fields (`logit_bias`, `response_format`, `structured_outputs`) are declared and
parsed in `structured/`; the rules that need more than a type are here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, TypeVar

from pydantic import BaseModel, Field, JsonValue, ValidationError

from splitserve.common.convert import is_int64
from splitserve.engine.sampling_params import FIELD_TYPES, SamplingParams
from splitserve.gateway.api.cache_options import CacheControl, cache_retention_s
from splitserve.gateway.core import GenerationRequest, ServedModels, served_models
from splitserve.gateway.errors import RequestError, from_validation, param_of
from splitserve.gateway.strict_model import StrictModel
from splitserve.gateway.structured.constraints import parse_logit_bias, parse_structured_output
from splitserve.gateway.structured.schema import ConstraintFields

Body = TypeVar("Body", bound=BaseModel)
# SamplingParams keyword arguments as the body gave them. Any: SamplingParams normalises them
# (a list to a tuple, a logit_bias dict to pairs) and checks each type itself.
SamplingKwargs = dict[str, Any]


def doc_field(description: str, default: Any = None, **bounds: float) -> Any:
    """A field documented (and bounded) in the schema only; `bounds` are JSON Schema keywords
    (minimum, maximum, exclusiveMinimum) that SamplingParams enforces."""
    extra: dict[str, JsonValue] = dict(bounds)
    return Field(default, description=description, json_schema_extra=extra or None)


def unsupported_field(what: str) -> Any:
    return Field(None, description=f"Not supported: {what}. Any other value is a 400.")


def bookkeeping_field(description: str) -> Any:
    return Field(None, description=f"{description} Accepted; does not change the output.")


class StreamOptions(StrictModel):
    include_usage: bool | None = doc_field("Send a last chunk with the whole request's usage.")
    continuous_usage_stats: bool | None = doc_field(
        "vLLM's extension: every chunk carries the usage so far (prompt, completion and total "
        "tokens)."
    )


class SamplingFields(ConstraintFields):
    """What both generation endpoints take: SamplingParams' fields under their own names
    (except max_tokens and logprobs, which each endpoint spells its own way)."""

    # Each SamplingParams field is here (tests/test_openai_schema.py checks).
    n: int | None = doc_field("Sequences per prompt.", minimum=1, maximum=128)
    temperature: float | None = doc_field("0 is greedy.", minimum=0, maximum=100)
    top_p: float | None = doc_field("Nucleus sampling mass.", exclusiveMinimum=0, maximum=1)
    top_k: int | None = doc_field("Keep the k likeliest tokens; 0 or -1 is off.", minimum=-1)
    min_p: float | None = doc_field(
        "Drop tokens below min_p x the top probability.", minimum=0, maximum=1
    )
    seed: int | None = doc_field(
        "Seed of this request's sampling.", minimum=-(2**63), maximum=2**63 - 1
    )
    presence_penalty: float | None = doc_field("OpenAI's presence penalty.", minimum=-2, maximum=2)
    frequency_penalty: float | None = doc_field(
        "OpenAI's frequency penalty.", minimum=-2, maximum=2
    )
    repetition_penalty: float | None = doc_field(
        "vLLM's repetition penalty (1 is off).", exclusiveMinimum=0, maximum=10
    )
    stop: str | list[str] | None = doc_field("Strings that end a sequence (not included).")
    stop_token_ids: list[int] | None = doc_field("Token ids that end a sequence.")
    ignore_eos: bool | None = doc_field("Keep generating past EOS.")
    skip_special_tokens: bool | None = doc_field("Leave special tokens out of the text.")
    min_tokens: int | None = doc_field("Generate at least this many tokens.", minimum=0)
    cache_salt: str | None = doc_field(
        "vLLM's extension: only requests with the same salt share cached prompt prefixes."
    )
    cache_retention_s: float | None = doc_field(
        "How long this request's cached prompt blocks should stay after it (seconds).",
        exclusiveMinimum=0,
    )

    model: str | None = doc_field("The served model's id (GET /v1/models); may be left out.")
    stream: bool | None = doc_field("Answer with server-sent events.")
    stream_options: StreamOptions | None = None
    return_token_ids: bool | None = doc_field(
        "vLLM's extension: each choice carries its token ids."
    )
    priority: int | None = doc_field(
        "vLLM's extension: lower is scheduled first.", minimum=-(2**29), maximum=2**29
    )

    user: str | None = bookkeeping_field("An end-user id.")
    metadata: dict[str, str] | None = bookkeeping_field("Tags for the request.")
    store: bool | None = Field(None, description="Only false: nothing is stored.")
    service_tier: Literal["auto", "default"] | None = bookkeeping_field("auto or default.")
    prompt_cache_key: str | None = doc_field(
        "Requests sharing this key are routed to the same decode pod (its prefix cache); does "
        "not change the output."
    )
    prompt_cache_retention: str | None = doc_field(
        'OpenAI\'s: "in_memory" (the server\'s own window) or "24h": how long the prompt\'s '
        "cached blocks should be kept (a soft window, bounded by the server's maximum)."
    )
    safety_identifier: str | None = bookkeeping_field("An end-user id.")

    # vLLM's and older OpenAI fields this server does not honour.
    prompt_logprobs: int | None = unsupported_field("prompt logprobs")
    truncate_prompt_tokens: int | None = unsupported_field("prompt truncation")
    include_stop_str_in_output: bool | None = unsupported_field("false only")
    use_beam_search: bool | None = unsupported_field("beam search (false only)")
    allowed_token_ids: list[int] | None = unsupported_field("use logit_bias")
    bad_words: list[str] | None = unsupported_field("use logit_bias")
    guided_json: Any = unsupported_field("vLLM's old name; use structured_outputs.json")
    guided_regex: Any = unsupported_field("vLLM's old name; use structured_outputs.regex")
    guided_choice: Any = unsupported_field("vLLM's old name; use structured_outputs.choice")
    guided_grammar: Any = unsupported_field("vLLM's old name; use structured_outputs.grammar")

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


# ---- parsing --------------------------------------------------------------------------------


def validate_body(model: type[Body], raw: object) -> Body:
    """`raw` (a parsed JSON body) as `model`; FastAPI does this for the HTTP routes, and the
    same errors come out either way."""
    if isinstance(raw, model):
        return raw
    try:
        return model.model_validate(raw)
    except ValidationError as error:
        raise from_validation(error.errors(), raw) from None


def check_unsupported(body: BaseModel) -> None:
    """A known field this server does not honour, set to anything but its neutral value."""
    for name, neutral in body.UNSUPPORTED.items():  # type: ignore[attr-defined]
        value = getattr(body, name)
        if not any(value == ok and type(value) is type(ok) for ok in neutral):
            info = type(body).model_fields[name].description or ""
            info = info.removeprefix("Not supported: ").removesuffix(" Any other value is a 400.")
            raise RequestError(
                f"{name} is not supported by this server: {info}", name, "unsupported_parameter"
            )


@dataclass(frozen=True)
class CommonOptions:
    """What completions and chat completions share."""

    model: str
    sampling: SamplingKwargs  # all but max_tokens
    max_tokens: int | None
    stream: bool
    include_usage: bool
    return_token_ids: bool  # vLLM's extension: each choice carries its token ids
    priority: int
    continuous_usage: bool = False  # vLLM's extension: every chunk carries the usage so far
    prompt_cache_key: str | None = None  # routing affinity (routing/router.py)
    # The field sampling["structured_output"] came from, named if it does not compile.
    structured_output_param: str = "structured_output"
    lora_name: str | None = None  # the LoRA adapter "model" named; None: the base model

    def generation_request(
        self, request_id: str, prompts: list[list[int]], params: SamplingParams
    ) -> GenerationRequest:
        """What the request core is asked for, `params` from `self.params`."""
        return GenerationRequest(
            request_id,
            prompts,
            params,
            self.priority,
            self.prompt_cache_key,
            self.structured_output_param,
            self.lora_name,
        )

    def params(self, default_max_tokens: int) -> SamplingParams:
        max_tokens = default_max_tokens if self.max_tokens is None else self.max_tokens
        try:
            return SamplingParams(max_tokens=max_tokens, **self.sampling)
        except ValueError as error:
            raise RequestError(str(error), param_of(error)) from None


def common_options(
    body: SamplingFields,
    models: str | ServedModels,
    sampling: SamplingKwargs,
    max_tokens: int | None,
    structured_output_param: str,
) -> CommonOptions:
    served = served_models(models)
    lora_name = served.lora_name(body.model)
    model = lora_name or served.base
    stream_options = body.stream_options
    if stream_options is not None and not body.stream:
        # As OpenAI and vLLM answer: options for a stream that is not one would go unheard.
        raise RequestError("stream_options is only allowed when stream is true", "stream_options")
    return CommonOptions(
        model=model,
        sampling=sampling,
        max_tokens=max_tokens,
        stream=bool(body.stream),
        include_usage=bool(stream_options and stream_options.include_usage),
        return_token_ids=bool(body.return_token_ids),
        priority=body.priority or 0,
        continuous_usage=bool(stream_options and stream_options.continuous_usage_stats),
        prompt_cache_key=body.prompt_cache_key,
        structured_output_param=structured_output_param,
        lora_name=lora_name,
    )


# Each endpoint spells these its own way (max_completion_tokens; logprobs as a count or a flag
# beside top_logprobs) and parses them itself; every other SamplingParams field is a body field
# of the same name.
_PER_ENDPOINT_FIELDS = frozenset({"max_tokens", "logprobs"})
SAMPLING_BODY_FIELDS = tuple(name for name in FIELD_TYPES if name not in _PER_ENDPOINT_FIELDS)


def sampling_kwargs(body: SamplingFields) -> SamplingKwargs:
    """SamplingParams keyword arguments from the fields that are set; ranges are left to
    SamplingParams, so every API rejects the same values with the same message."""
    sampling: SamplingKwargs = {
        name: getattr(body, name)
        for name in SAMPLING_BODY_FIELDS
        if getattr(body, name) is not None
    }
    if isinstance(sampling.get("stop"), str):
        sampling["stop"] = (sampling["stop"],)
    if sampling.get("top_k") == -1:  # vLLM's spelling of "off"
        sampling["top_k"] = 0
    seed = sampling.get("seed")
    if seed is not None and not is_int64(seed):
        raise RequestError(f"seed must be a 64-bit signed integer, got {seed}", "seed")
    logit_bias = parse_logit_bias(body.logit_bias)
    if logit_bias is not None:
        sampling["logit_bias"] = logit_bias
    return sampling


def apply_structured_output(sampling: SamplingKwargs, body: SamplingFields) -> str:
    """The body's constraint into `sampling["structured_output"]`; returns the field it came
    from (the default "structured_output" when there is none), for the 400 of a constraint that
    does not compile. Compiled once, later, by the request core."""
    structured = parse_structured_output(body.response_format, body.structured_outputs)
    if structured is None:
        return "structured_output"
    sampling["structured_output"], param = structured
    return param


def apply_cache_retention(
    sampling: SamplingKwargs,
    body: SamplingFields,
    cache_controls: Sequence[CacheControl | None] = (),
) -> None:
    """prompt_cache_retention and the messages' cache_control markers (api/cache_options.py)
    into cache_retention_s: the longest window any of them (or cache_retention_s) asks for."""
    window = cache_retention_s(body.prompt_cache_retention, cache_controls)
    if window is not None:
        sampling["cache_retention_s"] = max(window, body.cache_retention_s or 0.0)
