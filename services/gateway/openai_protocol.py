"""The OpenAI HTTP API's shapes: request bodies parsed (strictly typed) into engine terms, and
engine output formatted back into completion / chat completion objects and stream chunks.

Parsing is hand-written rather than a pydantic model: every error must be a 400 whose message
starts with the parameter's name (as SamplingParams' own errors do), and lax coercion
("max_tokens": "10") is exactly the kind of wrong type that must be refused.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from splitserve.v1 import generate_pb2

from services.common.convert import is_int64
from services.gateway.generation import CollectedSequence, SequenceChunk, Usage
from services.gateway.tools import (
    ToolError,
    ToolOutputs,
    ToolRequest,
    prepare_chat,
    render_tool_turns,
)
from shared.sampling_params import (
    FIELD_TYPES,
    MAX_LOGPROBS,
    SamplingParams,
    is_sequence_field,
    value_type,
)

# The OpenAI API's default for completions; chat defaults to the rest of the context.
DEFAULT_COMPLETION_MAX_TOKENS = 16
# JSON has no -inf; OpenAI-compatible servers clamp to this instead.
MIN_LOGPROB = -9999.0

SAMPLING_FIELDS = frozenset(FIELD_TYPES)


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
    return first if first in SAMPLING_FIELDS or first in ("prompt", "messages") else None


# ---- parsing --------------------------------------------------------------------------------


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _is_str_list(value: object) -> bool:
    return isinstance(value, list) and all(isinstance(item, str) for item in value)


def _is_int_list(value: object) -> bool:
    return isinstance(value, list) and all(_is_int(item) for item in value)


def _is_str_or_str_list(value: object) -> bool:
    return isinstance(value, str) or _is_str_list(value)


_CHECKS: dict[str, tuple[Callable[[object], bool], str]] = {
    "int": (_is_int, "an integer"),
    "number": (_is_number, "a number"),
    "bool": (lambda v: isinstance(v, bool), "a boolean"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "object": (lambda v: isinstance(v, dict), "an object"),
    "stop": (_is_str_or_str_list, "a string or a list of strings"),
    "int_list": (_is_int_list, "a list of integers"),
}


class _Body:
    """Typed access to a JSON body's fields; null or absent means unset."""

    def __init__(self, body: object) -> None:
        if not isinstance(body, dict):
            raise RequestError("the request body must be a JSON object", code="invalid_type")
        self._body: dict[str, Any] = body

    def get(self, name: str, kind: str, default: Any = None) -> Any:
        value = self._body.get(name)
        if value is None:
            return default
        check, expected = _CHECKS[kind]
        if not check(value):
            raise RequestError(
                f"{name} must be {expected}, got {_json_type(value)}", name, "invalid_type"
            )
        return value

    def has(self, name: str) -> bool:
        return self._body.get(name) is not None

    def raw(self, name: str) -> Any:
        """A field whose several accepted shapes the caller checks itself."""
        return self._body.get(name)


def _json_type(value: object) -> str:
    names = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array"}
    return "object" if isinstance(value, dict) else names.get(type(value), "null")


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


@dataclass(frozen=True)
class ChatRequest:
    messages: list[dict[str, str]]
    options: CommonOptions
    logprobs: bool = False
    tools: ToolRequest | None = None  # tools, tool_choice, parallel_tool_calls (tools.py)


def parse_completion(raw: object, model_name: str) -> CompletionRequest:
    body = _Body(raw)
    if body.get("echo", "bool", False):
        raise RequestError("echo is not supported", "echo", "unsupported_value")
    if body.get("suffix", "str"):
        raise RequestError("suffix is not supported", "suffix", "unsupported_value")
    sampling = _sampling(body)
    logprobs = body.get("logprobs", "int")
    if logprobs is not None:
        sampling["logprobs"] = logprobs
    options = _common(body, model_name, sampling, body.get("max_tokens", "int"))
    best_of = body.get("best_of", "int")
    if best_of is not None and best_of != sampling.get("n", 1):
        raise RequestError("best_of must equal n (beam search is not supported)", "best_of")
    return CompletionRequest(_prompts(body), options)


def parse_chat(raw: object, model_name: str) -> ChatRequest:
    body = _Body(raw)
    sampling = _sampling(body)
    logprobs = body.get("logprobs", "bool", False)
    top_logprobs = body.get("top_logprobs", "int")
    if top_logprobs is not None and not logprobs:
        raise RequestError("top_logprobs requires logprobs to be true", "top_logprobs")
    if top_logprobs is not None and not 0 <= top_logprobs <= MAX_LOGPROBS:
        raise RequestError(
            f"top_logprobs must be in [0, {MAX_LOGPROBS}], got {top_logprobs}", "top_logprobs"
        )
    if logprobs:
        sampling["logprobs"] = top_logprobs or 0
    max_tokens = body.get("max_completion_tokens", "int")
    if max_tokens is None:
        max_tokens = body.get("max_tokens", "int")
    # Tool calling hook (services/gateway/tools.py): the tools into the system prompt, and the
    # grammar that enforces a call into `sampling`.
    messages, tools = prepare_chat(body.raw, _messages(body), sampling)
    options = _common(body, model_name, sampling, max_tokens)
    return ChatRequest(messages, options, logprobs, tools)


def _common(
    body: _Body, model_name: str, sampling: dict[str, object], max_tokens: int | None
) -> CommonOptions:
    model = body.get("model", "str", model_name)
    if model != model_name:
        raise RequestError(
            f"model {model!r} does not exist; this server serves {model_name!r}",
            "model",
            "model_not_found",
        )
    stream = body.get("stream", "bool", False)
    stream_options = body.get("stream_options", "object", {})
    include_usage = stream_options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise RequestError("stream_options.include_usage must be a boolean", "stream_options")
    return CommonOptions(
        model=model,
        sampling=sampling,
        max_tokens=max_tokens,
        stream=stream,
        include_usage=include_usage,
        return_token_ids=body.get("return_token_ids", "bool", False),
        priority=body.get("priority", "int", 0),
    )


# Each endpoint spells these its own way (max_completion_tokens; logprobs as a count or a flag
# beside top_logprobs) and parses them itself; every other SamplingParams field is a body field
# of the same name.
_PER_ENDPOINT_FIELDS = frozenset({"max_tokens", "logprobs"})


def _json_kind(name: str) -> str:
    """The `_CHECKS` kind a SamplingParams field's JSON value must have."""
    if is_sequence_field(name):
        return "stop" if value_type(name) is str else "int_list"
    return {float: "number", int: "int", bool: "bool", str: "str"}[value_type(name)]


_SAMPLING_KINDS = {
    name: _json_kind(name) for name in FIELD_TYPES if name not in _PER_ENDPOINT_FIELDS
}


def _sampling(body: _Body) -> dict[str, object]:
    """SamplingParams keyword arguments from the fields that are set; ranges are left to
    SamplingParams, so every API rejects the same values with the same message."""
    sampling = {
        name: body.get(name, kind) for name, kind in _SAMPLING_KINDS.items() if body.has(name)
    }
    if isinstance(sampling.get("stop"), str):
        sampling["stop"] = (sampling["stop"],)
    if sampling.get("top_k") == -1:  # vLLM's spelling of "off"
        sampling["top_k"] = 0
    seed = sampling.get("seed")
    if seed is not None and not is_int64(seed):
        raise RequestError(f"seed must be a 64-bit signed integer, got {seed}", "seed")
    return sampling


def _prompts(body: _Body) -> list[str | list[int]]:
    prompt = body.raw("prompt")
    if isinstance(prompt, str) or (_is_int_list(prompt) and prompt):
        prompts: list = [prompt]
    elif (
        isinstance(prompt, list)
        and prompt
        and all(isinstance(p, str) or _is_int_list(p) for p in prompt)
    ):
        prompts = prompt
    elif prompt is None:
        raise RequestError("prompt is required", "prompt", "missing_required_parameter")
    else:
        raise RequestError(
            "prompt must be a string, a list of token ids, or a non-empty list of either",
            "prompt",
            "invalid_type",
        )
    if any(len(p) == 0 for p in prompts):
        raise RequestError("prompt must not be empty", "prompt")
    return prompts


def _messages(body: _Body) -> list[dict[str, str]]:
    messages = body.raw("messages")
    if messages is None:
        raise RequestError("messages is required", "messages", "missing_required_parameter")
    if not isinstance(messages, list):
        raise RequestError(
            f"messages must be an array, got {_json_type(messages)}", "messages", "invalid_type"
        )
    if not messages:
        raise RequestError("messages must not be empty", "messages")
    checked = [_message(i, message) for i, message in enumerate(messages)]
    return render_tool_turns(messages, checked)  # tool calls and results as text (tools.py)


def _message(i: int, message: object) -> dict[str, str]:
    param = f"messages[{i}]"
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise RequestError(f"{param} must be an object with a string role", param, "invalid_type")
    content = message.get("content")
    if isinstance(content, list):  # content parts: only text can reach a text-only model
        if not all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            raise RequestError(f"{param}.content may only hold text parts", param)
        content = "\n".join(str(part.get("text", "")) for part in content)
    if content is None:
        content = ""
    if not isinstance(content, str):
        raise RequestError(f"{param}.content must be a string", param, "invalid_type")
    return {"role": message["role"], "content": content}


# ---- formatting -----------------------------------------------------------------------------


def usage_json(usage: Usage) -> dict:
    return {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.total_tokens,
        "prompt_tokens_details": {"cached_tokens": usage.cached_tokens},
    }


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
class CompletionFormat:
    """Completion objects and chunks for one request."""

    envelope: Envelope
    logprobs: bool
    options: CommonOptions
    _offsets: dict[int, int] = field(default_factory=dict)  # choice -> text offset so far

    def chunk(self, chunk: SequenceChunk) -> dict:
        logprobs = self._logprobs(chunk.index, chunk.logprobs)
        choice = _choice(chunk, {"text": chunk.text}, logprobs, self.options)
        extra = {"usage": None} if self.options.include_usage else {}
        return self.envelope.wrap("text_completion", [choice], **extra)

    def usage_chunk(self, usage: Usage) -> dict:
        return self.envelope.wrap("text_completion", [], usage=usage_json(usage))

    def response(self, sequences: list[CollectedSequence], usage: Usage) -> dict:
        choices = [
            _choice(
                sequence,
                {"text": sequence.text},
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
    _started: set[int] = field(default_factory=set)  # choices whose role was sent

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
        extra = {"usage": None} if self.options.include_usage else {}
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
