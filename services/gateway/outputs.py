"""What a generation gives back, whatever the front end: each sequence's chunks as its decode
pod streams them, a whole sequence gathered from them, and the request's token usage. Plain
data over the proto's logprob entries; the API modules format it as JSON, the gRPC service as
protobuf."""

from __future__ import annotations

from dataclasses import dataclass, field

from splitserve.v1 import generate_pb2


@dataclass
class SequenceChunk:
    """What one decode message added to one output sequence (a choice)."""

    index: int  # choice index: prompt_index * n + sequence index
    text: str
    token_ids: list[int]
    logprobs: list[generate_pb2.TokenLogprob]
    finish_reason: str | None = None  # on the sequence's last chunk only
    stop_reason: str | None = None


@dataclass
class CollectedSequence:
    """A whole sequence, gathered from its chunks (for non-streaming responses)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[generate_pb2.TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | None = None

    def add(self, chunk: SequenceChunk) -> None:
        self.text += chunk.text
        self.token_ids.extend(chunk.token_ids)
        self.logprobs.extend(chunk.logprobs)
        if chunk.finish_reason is not None:
            self.finish_reason, self.stop_reason = chunk.finish_reason, chunk.stop_reason


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    # cached_tokens by the cache tier that served them (Tier.label -> tokens).
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens
