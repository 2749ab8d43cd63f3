"""The committed gRPC stubs are exactly what the pinned generator makes from the .proto files."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STUB_DIR = REPO / "proto" / "splitserve" / "v1"


def _load_generator():
    spec = importlib.util.spec_from_file_location("gen_proto", REPO / "scripts" / "gen_proto.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["gen_proto"] = module
    spec.loader.exec_module(module)
    return module


def test_committed_stubs_match_a_fresh_generation(tmp_path):
    gen_proto = _load_generator()
    gen_proto.generate(tmp_path)
    fresh = sorted((tmp_path / "splitserve" / "v1").glob("*_pb2*.py*"))
    committed = sorted(STUB_DIR.glob("*_pb2*.py*"))
    assert [p.name for p in fresh] == [p.name for p in committed]
    stale = [p.name for p in fresh if p.read_text() != (STUB_DIR / p.name).read_text()]
    assert not stale, f"regenerate with `python scripts/gen_proto.py`: {stale} differ"


def test_stubs_import_and_round_trip_a_message():
    from splitserve.v1 import generate_pb2, worker_pb2

    request = worker_pb2.DecodeRequest(
        request_id="r1",
        prompt_token_ids=[1, 2, 3],
        sampling=generate_pb2.SamplingOptions(max_tokens=8, temperature=0.0, stop=["\n"]),
    )
    decoded = worker_pb2.DecodeRequest.FromString(request.SerializeToString())
    assert decoded.prompt_token_ids == [1, 2, 3]
    assert decoded.sampling.HasField("temperature") and decoded.sampling.temperature == 0.0
    assert not decoded.sampling.HasField("top_p")  # unset stays distinguishable from 0
