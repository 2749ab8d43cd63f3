"""SamplingParams is the one list of sampling fields. The proto's SamplingOptions must carry the
same fields with the same types (the converters in services/common/convert.py walk
SamplingParams' fields and set the proto's by name), and the OpenAI parser accepts each of them.
"""

from __future__ import annotations

from google.protobuf.descriptor import FieldDescriptor

from splitserve.common.convert import options_from_params, params_from_options
from splitserve.engine.sampling_params import (
    COMPOSITE_FIELDS,
    FIELD_TYPES,
    SamplingParams,
    is_sequence_field,
    value_type,
)
from splitserve.engine.structured_output.spec import StructuredOutput
from splitserve.gateway.api.chat import parse_chat
from splitserve.gateway.api.completions import parse_completion
from splitserve.v1 import generate_pb2

_PYTHON_TYPE = {
    FieldDescriptor.TYPE_INT32: int,
    FieldDescriptor.TYPE_INT64: int,
    FieldDescriptor.TYPE_FLOAT: float,
    FieldDescriptor.TYPE_DOUBLE: float,
    FieldDescriptor.TYPE_BOOL: bool,
    FieldDescriptor.TYPE_STRING: str,
}
_PROTO_FIELDS = {field.name: field for field in generate_pb2.SamplingOptions.DESCRIPTOR.fields}

# Non-default values for every field, as an OpenAI body would carry them.
_BODY = {
    "n": 2,
    "max_tokens": 9,
    "temperature": 0.7,
    "top_p": 0.9,
    "top_k": 5,
    "min_p": 0.05,
    "seed": 2**40,
    "presence_penalty": 0.1,
    "frequency_penalty": -0.3,
    "repetition_penalty": 1.1,
    "stop": ["a", "bc"],
    "stop_token_ids": [2, 3],
    "ignore_eos": True,
    "logprobs": 3,
    "skip_special_tokens": False,
    "min_tokens": 2,
    "cache_salt": "tenant-a",
    "cache_retention_s": 3600.0,
}


def test_sampling_options_and_sampling_params_name_the_same_fields():
    only_proto = sorted(set(_PROTO_FIELDS) - set(FIELD_TYPES) - set(COMPOSITE_FIELDS))
    only_params = sorted(set(FIELD_TYPES) - set(_PROTO_FIELDS))
    assert not only_proto, f"SamplingOptions fields missing from SamplingParams: {only_proto}"
    assert not only_params, f"SamplingParams fields missing from SamplingOptions: {only_params}"


def test_each_field_has_the_same_type_in_the_proto():
    for name, field in _PROTO_FIELDS.items():
        if name in COMPOSITE_FIELDS:
            continue
        assert field.is_repeated == is_sequence_field(name), name
        assert _PYTHON_TYPE[field.type] is value_type(name), name
        # A scalar must be `optional`: unset has to mean "SamplingParams' default", not zero.
        assert field.is_repeated or field.has_presence, f"{name} must be declared optional"


def test_every_field_survives_the_proto_round_trip():
    params = SamplingParams(**{name: _as_param(name, value) for name, value in _BODY.items()})
    options = options_from_params(params)
    assert sorted(field.name for field, _ in options.ListFields()) == sorted(FIELD_TYPES)
    assert params_from_options(options) == params


def test_the_composite_fields_survive_the_proto_round_trip():
    # 0.3 is not a float32: the bias must come back as the decimal that was sent.
    params = SamplingParams(
        logit_bias={7: 0.3, 2: -100},
        structured_output=StructuredOutput.json_schema({"type": "array"}),
    )
    options = options_from_params(params)
    assert set(COMPOSITE_FIELDS) <= {field.name for field, _ in options.ListFields()}
    assert params_from_options(options) == params
    assert not params_from_options(options_from_params(SamplingParams())).logit_bias


def test_the_openai_parsers_accept_every_field():
    expected = SamplingParams(**{name: _as_param(name, value) for name, value in _BODY.items()})
    completion = parse_completion({"prompt": "hi", **_BODY}, "m")
    assert completion.options.params(default_max_tokens=16) == expected
    chat_body = {key: value for key, value in _BODY.items() if key != "logprobs"}
    chat = parse_chat(
        {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 3,
         **chat_body},
        "m",
    )
    assert chat.options.params(default_max_tokens=16) == expected


def _as_param(name: str, value: object) -> object:
    return tuple(value) if is_sequence_field(name) else value  # type: ignore[arg-type]
