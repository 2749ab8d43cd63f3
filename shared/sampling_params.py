"""What a request asks of generation; validated here so every entry point rejects the same input.

Bad values raise `ValueError` whose message starts with the parameter's name, which the
services map to HTTP 400 / gRPC INVALID_ARGUMENT.
"""

from __future__ import annotations

from dataclasses import dataclass

# Top-N logprobs a request may ask for; more would make every step's sort expensive.
MAX_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    n: int = 1
    max_tokens: int = 16
    # 0 means greedy (argmax); the other knobs then do not change the chosen token.
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    # Top-N logprobs per generated token (the sampled token's own logprob always comes along).
    logprobs: int | None = None
    skip_special_tokens: bool = True
    # Keep generating until at least this many tokens, ignoring EOS and stop tokens before.
    min_tokens: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        _check_range("n", self.n, 1, 128)
        _check_range("max_tokens", self.max_tokens, 1, None)
        _check_range("temperature", self.temperature, 0.0, 100.0)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_range("top_k", self.top_k, 0, None)
        _check_range("min_p", self.min_p, 0.0, 1.0)
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise ValueError(
                f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}"
            )
        if self.logprobs is not None:
            _check_range("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        _check_range("min_tokens", self.min_tokens, 0, self.max_tokens)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError("stop must be a list of non-empty strings")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise ValueError("stop_token_ids must be non-negative integers")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def max_stop_string_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)


def _check_range(name: str, value: float, low: float, high: float | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {type(value).__name__}")
    if value < low or (high is not None and value > high):
        bound = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be {bound}, got {value}")
