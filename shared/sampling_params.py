"""What a request asks of generation; validated here so every entry point rejects the same input.

Bad values raise `ValueError` whose message starts with the parameter's name, which the
services map to HTTP 400 / gRPC INVALID_ARGUMENT.
"""

from __future__ import annotations

import math
import typing
from collections.abc import Mapping
from dataclasses import dataclass

from splitserve.engine.structured_output.spec import StructuredOutput

# Top-N logprobs a request may ask for; more would make every step's sort expensive.
MAX_LOGPROBS = 20
# OpenAI's range for logit_bias values: -100 bans a token, 100 all but forces it.
MAX_LOGIT_BIAS = 100.0


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
    # Prefix caching: a tenant's salt enters its block hashes (only requests with the same
    # salt share cached prefixes); how long this request's cached blocks should stay after it
    # (seconds; None = the engine's idle_ttl_s). Not sampling, but carried with it everywhere.
    cache_salt: str | None = None
    cache_retention_s: float | None = None
    # (token id, bias) pairs added to the logits before any penalty; a dict is accepted and
    # stored sorted. Ids beyond the model's vocabulary are refused when the engine admits it.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # What the output must match (JSON schema, regex, choice, grammar); None = free text.
    structured_output: StructuredOutput | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "logit_bias", _logit_bias("logit_bias", self.logit_bias))
        if self.structured_output is not None and not isinstance(
            self.structured_output, StructuredOutput
        ):
            raise ValueError(
                f"structured_output must be a StructuredOutput, got {self.structured_output!r}"
            )
        object.__setattr__(self, "stop", _string_tuple("stop", self.stop))
        object.__setattr__(
            self, "stop_token_ids", _int_tuple("stop_token_ids", self.stop_token_ids)
        )
        for name in _BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        _check_int("n", self.n, 1, 128)
        _check_int("max_tokens", self.max_tokens, 1, None)
        _check_range("temperature", self.temperature, 0.0, 100.0)
        _check_number("top_p", self.top_p)
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        _check_int("top_k", self.top_k, 0, None)
        _check_range("min_p", self.min_p, 0.0, 1.0)
        _check_range("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _check_range("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _check_number("repetition_penalty", self.repetition_penalty)
        if not 0.0 < self.repetition_penalty <= 10.0:
            raise ValueError(
                f"repetition_penalty must be in (0, 10], got {self.repetition_penalty}"
            )
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        _check_int("min_tokens", self.min_tokens, 0, self.max_tokens)
        if self.seed is not None:
            # What torch.Generator.manual_seed accepts.
            _check_int("seed", self.seed, -(2**63), 2**64 - 1)
        if self.cache_salt is not None and (
            not isinstance(self.cache_salt, str) or not self.cache_salt
        ):
            raise ValueError(f"cache_salt must be a non-empty string, got {self.cache_salt!r}")
        if self.cache_retention_s is not None:
            _check_number("cache_retention_s", self.cache_retention_s)
            if not self.cache_retention_s > 0:
                raise ValueError(f"cache_retention_s must be > 0, got {self.cache_retention_s}")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def max_stop_string_len(self) -> int:
        return max((len(s) for s in self.stop), default=0)


# Fields with a shape of their own (a map, a message) that the proto conversion and the OpenAI
# parser handle by name; every other field is a scalar or a list of scalars, walked generically.
COMPOSITE_FIELDS = ("logit_bias", "structured_output")
# Each plain field's resolved annotation (`int`, `int | None`, `tuple[str, ...]`, ...), in
# declaration order. The proto conversion and the OpenAI parser derive their field lists from it,
# so a new field is declared here once (and in SamplingOptions: tests/test_sampling_fields.py
# checks).
FIELD_TYPES: dict[str, object] = {
    name: hint
    for name, hint in typing.get_type_hints(SamplingParams).items()
    if name not in COMPOSITE_FIELDS
}
_BOOL_FIELDS = tuple(name for name, hint in FIELD_TYPES.items() if hint is bool)


def is_sequence_field(name: str) -> bool:
    """A `tuple[T, ...]` field (a repeated proto field, a JSON list)."""
    return typing.get_origin(FIELD_TYPES[name]) is tuple


def value_type(name: str) -> type:
    """The type of one value of the field: `int` for `int`, `int | None` and `tuple[int, ...]`."""
    hint = FIELD_TYPES[name]
    args = [arg for arg in typing.get_args(hint) if arg not in (type(None), Ellipsis)]
    return args[0] if args else hint  # type: ignore[return-value]


def _check_number(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or math.isnan(value):
        raise ValueError(f"{name} must be a number, got {value!r}")


def _check_range(name: str, value: float, low: float, high: float | None) -> None:
    _check_number(name, value)
    if value < low or (high is not None and value > high):
        bound = f"[{low}, {high}]" if high is not None else f">= {low}"
        raise ValueError(f"{name} must be {bound}, got {value}")


def _check_int(name: str, value: object, low: int, high: int | None) -> None:
    # Counts index and size tensors: 2.0 would pass a range check and fail inside a step.
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    _check_range(name, value, low, high)


def _string_tuple(name: str, value: object) -> tuple[str, ...]:
    if isinstance(value, str):
        value = (value,)
    if not isinstance(value, list | tuple) or any(not isinstance(s, str) or not s for s in value):
        raise ValueError(f"{name} must be a string or a list of non-empty strings, got {value!r}")
    return tuple(value)


def _int_tuple(name: str, value: object) -> tuple[int, ...]:
    if not isinstance(value, list | tuple) or any(
        isinstance(t, bool) or not isinstance(t, int) or t < 0 for t in value
    ):
        raise ValueError(f"{name} must be a list of non-negative integers, got {value!r}")
    return tuple(value)


def _logit_bias(name: str, value: object) -> tuple[tuple[int, float], ...]:
    if isinstance(value, Mapping):
        value = list(value.items())
    if not isinstance(value, list | tuple) or any(
        not isinstance(pair, list | tuple) or len(pair) != 2 for pair in value
    ):
        raise ValueError(f"{name} must map token ids to numbers, got {value!r}")
    checked: dict[int, float] = {}
    for token_id, bias in value:
        if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
            raise ValueError(f"{name} keys must be non-negative token ids, got {token_id!r}")
        _check_range(name, bias, -MAX_LOGIT_BIAS, MAX_LOGIT_BIAS)
        checked[token_id] = float(bias)
    return tuple(sorted(checked.items()))
