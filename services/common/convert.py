"""Proto <-> engine conversions shared by the services: `SamplingOptions` <-> `SamplingParams`
and the engine's `TokenLogprobs` -> proto `TokenLogprob`.

Torch-free on purpose (the gateway imports it): `TokenLogprobs` is only named for type checking.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from splitserve.v1 import generate_pb2

from shared.sampling_params import SamplingParams

if TYPE_CHECKING:
    from shared.sampler import TokenLogprobs

# SamplingOptions fields that are `optional` scalars, named as in SamplingParams.
_INT_FIELDS = ("n", "max_tokens", "top_k", "seed", "logprobs", "min_tokens")
_FLOAT_FIELDS = (
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
)
_BOOL_FIELDS = ("ignore_eos", "skip_special_tokens")
_SCALAR_FIELDS = _INT_FIELDS + _FLOAT_FIELDS + _BOOL_FIELDS
_INT64_RANGE = (-(2**63), 2**63)

# Turns a token id into the text it stands for (special tokens included).
TokenText = Callable[[int], str]


def params_from_options(options: generate_pb2.SamplingOptions) -> SamplingParams:
    """Unset fields keep SamplingParams' defaults. Raises ValueError (naming the parameter)
    for out-of-range values, exactly as SamplingParams does."""
    kwargs: dict[str, object] = {}
    for name in _SCALAR_FIELDS:
        if options.HasField(name):
            value = getattr(options, name)
            kwargs[name] = _from_float32(value) if name in _FLOAT_FIELDS else value
    if options.stop:
        kwargs["stop"] = tuple(options.stop)
    if options.stop_token_ids:
        kwargs["stop_token_ids"] = tuple(options.stop_token_ids)
    return SamplingParams(**kwargs)  # type: ignore[arg-type]


def options_from_params(params: SamplingParams) -> generate_pb2.SamplingOptions:
    """Every field set explicitly, so the receiver never depends on its own defaults."""
    if params.seed is not None and not _INT64_RANGE[0] <= params.seed < _INT64_RANGE[1]:
        raise ValueError(f"seed must be in [-2**63, 2**63), got {params.seed}")
    options = generate_pb2.SamplingOptions(
        stop=list(params.stop), stop_token_ids=list(params.stop_token_ids)
    )
    for name in _SCALAR_FIELDS:
        value = getattr(params, name)
        if value is not None:
            setattr(options, name, value)
    return options


def logprobs_to_proto(
    logprobs: Sequence[TokenLogprobs], token_text: TokenText
) -> list[generate_pb2.TokenLogprob]:
    return [logprob_to_proto(entry, token_text) for entry in logprobs]


def logprob_to_proto(entry: TokenLogprobs, token_text: TokenText) -> generate_pb2.TokenLogprob:
    top = [
        generate_pb2.TopLogprob(token_id=token_id, logprob=logprob, token=token_text(token_id))
        for token_id, logprob in entry.top
    ]
    return generate_pb2.TokenLogprob(
        token_id=entry.token_id,
        logprob=entry.logprob,
        rank=entry.rank,
        token=token_text(entry.token_id),
        top=top,
    )


def _from_float32(value: float) -> float:
    """The shortest decimal that a proto float32 came from: 0.9 travels as 0.89999998 and
    arrives as 0.9 again, so a request samples exactly as it would in-process."""
    packed = struct.pack("<f", value)
    for digits in range(6, 10):
        candidate = float(f"{value:.{digits}g}")
        if struct.pack("<f", candidate) == packed:
            return candidate
    return value
