"""The OpenAI HTTP API's shapes: request bodies (validated against the pydantic models of
`api_schema.py`) turned into engine terms, and engine output formatted back into completion /
chat completion objects and stream chunks.

The models check types (strictly: "max_tokens": "10" is refused) and refuse unknown fields;
the rules that need more than a type are here, and sampling ranges are SamplingParams' alone,
so every error is a 400 whose message starts with the parameter's name.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from splitserve.common.convert import is_int64
from splitserve.engine.sampling_params import FIELD_TYPES, MAX_LOGPROBS, SamplingParams
from splitserve.gateway.api_errors import (  # noqa: F401  (re-exported: the API's error types)
    RequestError,
    error_body,
    from_validation,
    param_of,
)
from splitserve.gateway.api_schema import (
    ChatBody,
    ChatMessage,
    CompletionBody,
    Prompt,
    SamplingFields,
)
from splitserve.gateway.cache_options import cache_retention_s
from splitserve.gateway.constraints import (
    check_structured_output,
    parse_logit_bias,
    parse_structured_output,
)
from splitserve.gateway.generation import CollectedSequence, SequenceChunk, Usage
from splitserve.gateway.tools.hooks import ToolOutputs, ToolRequest, prepare_chat, render_tool_turns
from splitserve.v1 import generate_pb2

# The OpenAI API's default for completions; chat defaults to the rest of the context.
DEFAULT_COMPLETION_MAX_TOKENS = 16
# JSON has no -inf; OpenAI-compatible servers clamp to this instead.
MIN_LOGPROB = -9999.0

Body = TypeVar("Body", bound=BaseModel)


def validate_body(model: type[Body], raw: object) -> Body:
    """`raw` (a parsed JSON body) as `model`; FastAPI does this for the HTTP routes, and the
    same errors come out either way."""
    if isinstance(raw, model):
        return raw
    try:
        return model.model_validate(raw)
    except ValidationError as error:
        raise from_validation(error.errors(), raw) from None


# ---- parsing --------------------------------------------------------------------------------


@dataclass(frozen=True)
class CommonOptions:
    """What completions and chat completions share."""

    model: str
    sampling: dict[str, object]  # SamplingParams keyword arguments, except max_tokens
    max_tokens: int | None
    stream: bool
    include_usage: bool
    return_token_ids: bool  # vLLM's extension: each choice carries its token ids
    priority: int
    continuous_usage: bool = False  # vLLM's extension: every chunk carries the usage so far
    prompt_cache_key: str | None = None  # routing affinity (router.py)

    def params(self, default_max_tokens: int) -> SamplingParams:
        max_tokens = default_max_tokens if self.max_tokens is None else self.max_tokens
        try:
            return SamplingParams(max_tokens=max_tokens, **self.sampling)  # type: ignore[arg-type]
        except ValueError as error:
            raise RequestError(str(error), param_of(error)) from None


@dataclass(frozen=True)
class CompletionRequest:
    prompts: list[str | list[int]]
    options: CommonOptions
    echo: bool = False  # each choice's text starts with its prompt's
    add_special_tokens: bool = True  # for text prompts


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict[str, str]]
    options: CommonOptions
    logprobs: bool = False
    add_generation_prompt: bool = True
    tools: ToolRequest | None = None  # tools, tool_choice, parallel_tool_calls (tools.py)


def parse_completion(raw: object, model_name: str) -> CompletionRequest:
    body = validate_body(CompletionBody, raw)
    check_unsupported(body)
    sampling = _sampling(body)
    if body.logprobs is not None:
        sampling["logprobs"] = body.logprobs
        if body.echo:
            raise RequestError(
                "echo together with logprobs is not supported (prompt logprobs are not "
                "computed); echo without logprobs is",
                "echo",
                "unsupported_value",
            )
    _apply_cache_retention(sampling, body)
    options = _common(body, model_name, sampling, body.max_tokens)
    if body.best_of is not None and body.best_of != sampling.get("n", 1):
        raise RequestError("best_of must equal n (beam search is not supported)", "best_of")
    return CompletionRequest(
        _prompts(body.prompt),
        options,
        echo=bool(body.echo),
        add_special_tokens=body.add_special_tokens is not False,
    )


def parse_chat(raw: object, model_name: str) -> ChatRequest:
    body = validate_body(ChatBody, raw)
    check_unsupported(body)
    sampling = _sampling(body)
    logprobs = bool(body.logprobs)
    top_logprobs = body.top_logprobs
    if top_logprobs is not None and not logprobs:
        raise RequestError("top_logprobs requires logprobs to be true", "top_logprobs")
    if top_logprobs is not None and not 0 <= top_logprobs <= MAX_LOGPROBS:
        raise RequestError(
            f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {top_logprobs}", "top_logprobs"
        )
    if logprobs:
        sampling["logprobs"] = top_logprobs or 0
    max_tokens = body.max_completion_tokens
    if max_tokens is None:
        max_tokens = body.max_tokens
    # Tool calling hook (services/gateway/tools.py): the tools into the system prompt, and the
    # grammar that enforces a call into `sampling`.
    messages, tools = prepare_chat(
        lambda name: getattr(body, name, None), chat_messages(body.messages), sampling
    )
    _apply_cache_retention(sampling, body, body.messages)
    options = _common(body, model_name, sampling, max_tokens)
    return ChatRequest(
        messages,
        options,
        logprobs,
        add_generation_prompt=body.add_generation_prompt is not False,
        tools=tools,
    )


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


def _apply_cache_retention(
    sampling: dict[str, object], body: SamplingFields, messages: list[ChatMessage] = ()
) -> None:
    """prompt_cache_retention and messages' cache_control (services/gateway/cache_options.py)
    into cache_retention_s: the longest window any of them (or cache_retention_s) asks for."""
    window = cache_retention_s(
        body.prompt_cache_retention,
        [message.model_dump(mode="json", exclude_none=True) for message in messages],
    )
    if window is not None:
        sampling["cache_retention_s"] = max(window, body.cache_retention_s or 0.0)


def _common(
    body: SamplingFields, model_name: str, sampling: dict[str, object], max_tokens: int | None
) -> CommonOptions:
    model = body.model if body.model is not None else model_name
    if model != model_name:
        raise RequestError(
            f"model {model!r} does not exist; this server serves {model_name!r}",
            "model",
            "model_not_found",
        )
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
    )


# Each endpoint spells these its own way (max_completion_tokens; logprobs as a count or a flag
# beside top_logprobs) and parses them itself; every other SamplingParams field is a body field
# of the same name.
_PER_ENDPOINT_FIELDS = frozenset({"max_tokens", "logprobs"})
SAMPLING_BODY_FIELDS = tuple(name for name in FIELD_TYPES if name not in _PER_ENDPOINT_FIELDS)


def _sampling(body: SamplingFields) -> dict[str, object]:
    """SamplingParams keyword arguments from the fields that are set; ranges are left to
    SamplingParams, so every API rejects the same values with the same message."""
    sampling: dict[str, Any] = {
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
    structured = parse_structured_output(body.response_format, body.structured_outputs)
    if structured is not None:
        output, param = structured
        check_structured_output(output, param)  # before anything is scheduled
        sampling["structured_output"] = output
    return sampling


def _prompts(prompt: Prompt) -> list[str | list[int]]:
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompts: list = [prompt]
    elif prompt:
        prompts = list(prompt)
    else:
        raise RequestError(
            "prompt must be a string, a list of token ids, or a non-empty list of either",
            "prompt",
            "invalid_type",
        )
    if any(len(p) == 0 for p in prompts):
        raise RequestError("prompt must not be empty", "prompt")
    return prompts


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, str]]:
    if not messages:
        raise RequestError("messages must not be empty", "messages")
    checked = [_message(message) for message in messages]
    # Tool calls and results as text (tools.py), from the messages as JSON.
    raw = [message.model_dump(mode="json", by_alias=True) for message in messages]
    return render_tool_turns(raw, checked)


def _message(message: ChatMessage) -> dict[str, str]:
    content = message.content
    if isinstance(content, list):  # content parts: only text can reach a text-only model
        content = "\n".join(part.text for part in content)
    return {"role": message.role, "content": content or ""}


# ---- formatting -----------------------------------------------------------------------------


def usage_json(usage: Usage) -> dict:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": cached_details(usage),
    }


def cached_details(usage: Usage) -> dict:
    """OpenAI's `cached_tokens`, and (an extension) the tokens each cache tier served:
    "device" (the pod's KV cache), "host" and "disk" (its offload tiers)."""
    details: dict = {"cached_tokens": usage.cached_tokens}
    if usage.cached_tokens_by_tier:
        details["cached_tokens_by_tier"] = dict(usage.cached_tokens_by_tier)
    return details


def _logprob(value: float) -> float:
    return max(value, MIN_LOGPROB)


@dataclass(frozen=True)
class Envelope:
    """The fields every object and chunk of one response repeats."""

    request_id: str
    model: str
    created: int

    def wrap(self, object_name: str, choices: list[dict], **extra: object) -> dict:
        return {
            "id": self.request_id,
            "object": object_name,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }


def _choice(
    part: SequenceChunk | CollectedSequence,
    content: dict[str, object],
    logprobs: dict | None,
    options: CommonOptions,
) -> dict:
    """One choice of a response or chunk: the endpoint's `content` fields (text, delta or
    message) between the index and the logprobs, the finish, and the token ids when asked."""
    choice = {
        "index": part.index,
        **content,
        "logprobs": logprobs,
        "finish_reason": part.finish_reason,
        "stop_reason": part.stop_reason,
    }
    if options.return_token_ids:
        choice["token_ids"] = part.token_ids
    return choice


@dataclass
class StreamUsage:
    """A stream's usage so far, for vLLM's `continuous_usage_stats` (every chunk carries it)."""

    prompt_tokens: int
    completion_tokens: int = 0

    def extra(self, options: CommonOptions, chunk: SequenceChunk) -> dict[str, object]:
        """The `usage` key of `chunk`'s event: absent, null (the total comes last) or so far."""
        self.completion_tokens += len(chunk.token_ids)
        if options.continuous_usage:
            return {"usage": usage_json(Usage(self.prompt_tokens, self.completion_tokens))}
        return {"usage": None} if options.include_usage else {}


@dataclass
class CompletionFormat:
    """Completion objects and chunks for one request."""

    envelope: Envelope
    logprobs: bool
    options: CommonOptions
    num_prompt_tokens: int = 0
    # choice -> its prompt's text, put before its text (`echo`); empty: no echo
    echo: list[str] = field(default_factory=list)
    _offsets: dict[int, int] = field(default_factory=dict)  # choice -> text offset so far
    _echoed: set[int] = field(default_factory=set)  # choices whose prompt was sent
    _usage: StreamUsage | None = None

    def chunk(self, chunk: SequenceChunk) -> dict:
        logprobs = self._logprobs(chunk.index, chunk.logprobs)
        text = chunk.text
        if self.echo and chunk.index not in self._echoed:
            self._echoed.add(chunk.index)
            text = self.echo[chunk.index] + text
        choice = _choice(chunk, {"text": text}, logprobs, self.options)
        if self._usage is None:
            self._usage = StreamUsage(self.num_prompt_tokens)
        extra = self._usage.extra(self.options, chunk)
        return self.envelope.wrap("text_completion", [choice], **extra)

    def usage_chunk(self, usage: Usage) -> dict:
        return self.envelope.wrap("text_completion", [], usage=usage_json(usage))

    def response(self, sequences: list[CollectedSequence], usage: Usage) -> dict:
        choices = [
            _choice(
                sequence,
                {"text": (self.echo[sequence.index] if self.echo else "") + sequence.text},
                self._logprobs(sequence.index, sequence.logprobs),
                self.options,
            )
            for sequence in sequences
        ]
        return self.envelope.wrap("text_completion", choices, usage=usage_json(usage))

    def _logprobs(self, index: int, entries: list[generate_pb2.TokenLogprob]) -> dict | None:
        """The legacy completions layout: parallel lists, top alternatives as token -> logprob."""
        if not self.logprobs:
            return None
        offset = self._offsets.get(index, 0)
        offsets = []
        for entry in entries:
            offsets.append(offset)
            offset += len(entry.token)
        self._offsets[index] = offset
        return {
            "tokens": [entry.token for entry in entries],
            "token_logprobs": [_logprob(entry.logprob) for entry in entries],
            "top_logprobs": [_top_dict(entry) for entry in entries],
            "text_offset": offsets,
        }


def _top_dict(entry: generate_pb2.TokenLogprob) -> dict[str, float]:
    top = {alt.token: _logprob(alt.logprob) for alt in entry.top}
    top.setdefault(entry.token, _logprob(entry.logprob))
    return top


@dataclass
class ChatFormat:
    """Chat completion objects and chunks for one request."""

    envelope: Envelope
    logprobs: bool
    options: CommonOptions
    tools: ToolOutputs | None = None  # answers read for tool calls (tools.py); None: text
    num_prompt_tokens: int = 0
    _started: set[int] = field(default_factory=set)  # choices whose role was sent
    _usage: StreamUsage | None = None

    def chunk(self, chunk: SequenceChunk) -> dict:
        delta: dict[str, object] = {"content": chunk.text}
        finish_reason = chunk.finish_reason
        if self.tools is not None:  # tool calling hook: content and tool_calls deltas
            delta, finish_reason = self.tools.delta(chunk.index, chunk.text, finish_reason)
        if chunk.index not in self._started:
            self._started.add(chunk.index)
            delta = {"role": "assistant", **delta}
        choice = _choice(chunk, {"delta": delta}, self._logprobs(chunk.logprobs), self.options)
        choice["finish_reason"] = finish_reason
        if self._usage is None:
            self._usage = StreamUsage(self.num_prompt_tokens)
        extra = self._usage.extra(self.options, chunk)
        return self.envelope.wrap("chat.completion.chunk", [choice], **extra)

    def usage_chunk(self, usage: Usage) -> dict:
        return self.envelope.wrap("chat.completion.chunk", [], usage=usage_json(usage))

    def response(self, sequences: list[CollectedSequence], usage: Usage) -> dict:
        choices = [self._message_choice(sequence) for sequence in sequences]
        return self.envelope.wrap("chat.completion", choices, usage=usage_json(usage))

    def _message_choice(self, sequence: CollectedSequence) -> dict:
        message: dict[str, object] = {"role": "assistant", "content": sequence.text}
        finish_reason = sequence.finish_reason
        if self.tools is not None:  # tool calling hook: content and tool_calls
            message, finish_reason = self.tools.message(sequence.text, finish_reason)
        logprobs = self._logprobs(sequence.logprobs)
        choice = _choice(sequence, {"message": message}, logprobs, self.options)
        choice["finish_reason"] = finish_reason
        return choice

    def _logprobs(self, entries: list[generate_pb2.TokenLogprob]) -> dict | None:
        if not self.logprobs:
            return None
        return {"content": [_chat_logprob(entry) for entry in entries]}


def _chat_logprob(entry: generate_pb2.TokenLogprob) -> dict:
    return {
        "token": entry.token,
        "logprob": _logprob(entry.logprob),
        "bytes": list(entry.token.encode("utf-8")),
        "top_logprobs": [
            {
                "token": alt.token,
                "logprob": _logprob(alt.logprob),
                "bytes": list(alt.token.encode("utf-8")),
            }
            for alt in entry.top
        ],
    }
