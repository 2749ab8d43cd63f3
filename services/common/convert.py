"""Proto <-> engine conversions shared by the services: `SamplingOptions` <-> `SamplingParams`
and the engine's `TokenLogprobs` <-> proto `TokenLogprob`.

Every SamplingParams field travels in SamplingOptions under the same name: a tuple field as a
repeated field, any other as an `optional` scalar (unset = the receiver's default). The
conversions walk SamplingParams' fields, so a new field needs no code here;
tests/test_sampling_fields.py checks that the proto declares it alike.

Torch-free on purpose (the gateway imports it): `TokenLogprobs` lives in the engine's torch-free
`outputs` module.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence

from splitserve.engine.outputs import TokenLogprobs
from splitserve.engine.sampling_params import (
    FIELD_TYPES,
    SamplingParams,
    is_sequence_field,
    value_type,
)
from splitserve.engine.structured_output.spec import StructuredOutput
from splitserve.v1 import generate_pb2

# Turns a token id into the text it stands for (special tokens included).
TokenText = Callable[[int], str]


def is_int64(value: int) -> bool:
    """Whether `value` fits the proto's int64 seed (SamplingParams takes up to 2**64 - 1, as
    torch does, so a seed for the wire is checked again)."""
    return -(2**63) <= value < 2**63


def params_from_options(options: generate_pb2.SamplingOptions) -> SamplingParams:
    """Unset fields keep SamplingParams' defaults. Raises ValueError (naming the parameter)
    for out-of-range values, exactly as SamplingParams does."""
    kwargs: dict[str, object] = {}
    for name in FIELD_TYPES:
        if is_sequence_field(name):
            if getattr(options, name):
                kwargs[name] = tuple(getattr(options, name))
        elif options.HasField(name):
            value = getattr(options, name)
            kwargs[name] = _from_float32(value) if value_type(name) is float else value
    if options.logit_bias:
        kwargs["logit_bias"] = {t: _from_float32(b) for t, b in options.logit_bias.items()}
    if options.HasField("structured_output"):
        wire = options.structured_output
        kwargs["structured_output"] = StructuredOutput(wire.kind, wire.spec)
    return SamplingParams(**kwargs)  # type: ignore[arg-type]


def options_from_params(params: SamplingParams) -> generate_pb2.SamplingOptions:
    """Every field set explicitly, so the receiver never depends on its own defaults."""
    if params.seed is not None and not is_int64(params.seed):
        raise ValueError(f"seed must be in [-2**63, 2**63), got {params.seed}")
    options = generate_pb2.SamplingOptions()
    for name in FIELD_TYPES:
        value = getattr(params, name)
        if is_sequence_field(name):
            getattr(options, name).extend(value)
        elif value is not None:
            setattr(options, name, value)
    options.logit_bias.update(dict(params.logit_bias))
    if params.structured_output is not None:
        options.structured_output.kind = params.structured_output.kind
        options.structured_output.spec = params.structured_output.spec
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


def logprob_from_proto(proto: generate_pb2.TokenLogprob) -> TokenLogprobs:
    """`logprob_to_proto`'s inverse, less the token texts (the receiver has the tokenizer)."""
    return TokenLogprobs(
        token_id=proto.token_id,
        logprob=proto.logprob,
        rank=proto.rank,
        top=[(top.token_id, top.logprob) for top in proto.top],
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
