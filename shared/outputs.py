"""What the engine hands back: per-step deltas for streaming and whole results for `generate`."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprobs:
    """One generated token's logprobs, as the sampler computes them (here, torch-free, so the
    services convert them to and from protos without the sampler)."""

    token_id: int
    logprob: float  # of the sampled token, under the raw model distribution
    rank: int  # 1 = the model's most likely token
    # Top-N (token_id, logprob), most likely first; N = params.logprobs (may be 0).
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class RequestTimings:
    """Monotonic-clock seconds, taken when the engine produced each token."""

    arrival_time: float
    first_token_time: float | None = None
    token_times: list[float] = field(default_factory=list)
    finish_time: float | None = None

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def inter_token_latencies(self) -> list[float]:
        """Gaps between the steps that produced tokens, one per step as vLLM counts them: a
        verification step that accepts several tokens gives them one timestamp, and zero gaps
        inside it would drag every ITL percentile down."""
        step_times = [
            t for i, t in enumerate(self.token_times) if i == 0 or t != self.token_times[i - 1]
        ]
        return [later - earlier for earlier, later in zip(step_times, step_times[1:])]


@dataclass
class StreamDelta:
    """What one engine step added to one sequence."""

    request_id: str
    text: str
    token_ids: list[int]
    logprobs: list[TokenLogprobs] | None
    finished: bool
    index: int = 0  # which of the request's n sequences
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    final: CompletionOutput | None = None  # the whole sequence, on its last delta only


def merge_deltas(earlier: StreamDelta, later: StreamDelta) -> StreamDelta:
    """Two consecutive deltas of one sequence as one (what a reader that fell behind gets)."""
    assert (earlier.request_id, earlier.index) == (later.request_id, later.index), "one sequence"
    assert not earlier.finished, "nothing follows a finished delta"
    logprobs = None
    if earlier.logprobs is not None or later.logprobs is not None:
        logprobs = (earlier.logprobs or []) + (later.logprobs or [])
    return StreamDelta(
        request_id=earlier.request_id,
        text=earlier.text + later.text,
        token_ids=earlier.token_ids + later.token_ids,
        logprobs=logprobs,
        finished=later.finished,
        index=earlier.index,
        finish_reason=later.finish_reason,
        stop_reason=later.stop_reason,
        final=later.final,
    )


@dataclass
class CompletionOutput:
    index: int  # which of the request's n sequences
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None
    logprobs: list[TokenLogprobs] | None
    timings: RequestTimings
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # The same by the tier that served them (Tier.label -> tokens; summing to the above).
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    num_preemptions: int = 0


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]

    @property
    def finished(self) -> bool:
        return all(output.finish_reason is not None for output in self.outputs)
