"""The JSON pieces every OpenAI response repeats, whichever endpoint answers: the envelope of an
object or chunk, a choice, the usage (with the cache tiers' share), and logprobs as JSON can hold
them."""

from __future__ import annotations

from dataclasses import dataclass

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
