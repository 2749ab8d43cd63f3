"""The JSON pieces every OpenAI response repeats, whichever endpoint answers: the envelope of an
object or chunk, a choice, the usage (with the cache tiers' share), and logprobs as JSON can hold
them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from splitserve.gateway.api.fields import CommonOptions
from splitserve.gateway.outputs import CollectedSequence, SequenceChunk, Usage

# JSON has no -inf; OpenAI-compatible servers clamp to this instead.
MIN_LOGPROB = -9999.0


def clamp_logprob(value: float) -> float:
    return max(value, MIN_LOGPROB)


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


def choice_json(
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
class ChoicesFormat:
    """What completion and chat completion answers share: the envelope, the options, whether
    logprobs are shown, and the usage that a stream's chunks carry (`chunk_object` names the
    chunks)."""

    chunk_object: ClassVar[str]
    envelope: Envelope
    options: CommonOptions
    logprobs: bool
    num_prompt_tokens: int
    _stream_usage: StreamUsage | None = field(default=None, init=False)

    @property
    def request_id(self) -> str:
        return self.envelope.request_id

    def usage_chunk(self, usage: Usage) -> dict:
        return self.envelope.wrap(self.chunk_object, [], usage=usage_json(usage))

    def _wrap_chunk(self, choice: dict, chunk: SequenceChunk) -> dict:
        """One choice's chunk, with the usage key the options ask for."""
        if self._stream_usage is None:
            self._stream_usage = StreamUsage(self.num_prompt_tokens)
        extra = self._stream_usage.extra(self.options, chunk)
        return self.envelope.wrap(self.chunk_object, [choice], **extra)


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
