"""benchmarks.triton_tune: its search keeps only candidates that match the reference, and its
smoke run (the interpreter) writes a table under the keys the kernels look up."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import dataclasses  # noqa: E402
import json  # noqa: E402

import pytest  # noqa: E402

pytest.importorskip("triton")

import torch  # noqa: E402

from benchmarks import triton_tune  # noqa: E402
from splitserve.kernels import launch_configs  # noqa: E402
from splitserve.kernels.decode_attention import decode_launch_key  # noqa: E402
from splitserve.kernels.dequant_matmul import matmul_launch_key  # noqa: E402


def _shape(results: dict[int, torch.Tensor], expected: torch.Tensor) -> triton_tune.Shape:
    return triton_tune.Shape(
        kernel="k",
        key="key",
        run=lambda launch: results[launch["TILE"]],
        expected=expected,
        space={"TILE": [1, 2, 3]},
        default={"TILE": 1},
        tolerance=1e-4,
    )


def test_a_fast_but_wrong_candidate_is_never_chosen():
    expected = torch.ones(4)
    # TILE 3 is the fastest but wrong, TILE 2 the fastest right one.
    results = {1: expected.clone(), 2: expected.clone(), 3: expected + 1}
    times = {id(results[1]): 3.0, id(results[2]): 2.0, id(results[3]): 1.0}

    def timer(fn):
        return times[id(fn())]

    plan = dataclasses.replace(triton_tune.SMOKE, max_values=None)
    outcome = triton_tune.search(_shape(results, expected), plan, timer, deadline=float("inf"))
    assert outcome.best == {"TILE": 2} and outcome.best_ms == 2.0
    assert outcome.default_ms == 3.0 and outcome.speedup == 1.5
    assert [wrong["TILE"] for wrong in outcome.wrong] == [3]


def test_a_candidate_that_raises_is_recorded_and_skipped():
    expected = torch.ones(4)

    def run(launch):
        if launch["TILE"] == 2:
            raise RuntimeError("out of resources")
        return expected

    shape = _shape({}, expected)
    shape.run = run
    outcome = triton_tune.search(shape, triton_tune.SMOKE, lambda fn: 1.0, float("inf"))
    assert outcome.best == {"TILE": 1}
    assert len(outcome.failed) == 1 and "out of resources" in outcome.failed[0]


def test_smoke_run_writes_the_keys_the_kernels_read(tmp_path):
    table_path, record_path = tmp_path / "table.json", tmp_path / "record.json"
    argv = ["--smoke", "--out", str(table_path), "--record", str(record_path)]
    assert triton_tune.main(argv) == 0
    kernels = launch_configs.device_table("cpu", str(table_path))
    (num_heads, num_kv_heads, head_dim), = triton_tune.SMOKE.decode_layouts
    attention_key = decode_launch_key(torch.float32, head_dim, num_heads // num_kv_heads, 16,
                                      kv_int8=False)  # fmt: skip
    assert set(kernels["decode_attention"]) == {attention_key}
    (out, inner), = triton_tune.SMOKE.matmul_shapes
    for kind in ("int4", "int8"):
        # The weight's own entry and its row bucket's.
        assert set(kernels[f"{kind}_matmul"]) == {
            matmul_launch_key(kind, torch.float32, 1, out, inner),
            matmul_launch_key(kind, torch.float32, 1),
        }
    record = json.loads(record_path.read_text())
    assert len(record) == 3 and all(outcome["wrong"] == [] for outcome in record)


def test_decode_variants_are_one_coordinate_each_for_half_precision_only():
    """The variants' keys (kernels/_decode_variants.py) come first and last in bfloat16's
    search, each as one coordinate; float32's search is the one-kv-head kernel's alone."""
    plan = triton_tune.FULL
    bf16 = triton_tune.decode_space(plan, torch.bfloat16, num_kv_heads=3)
    assert list(bf16)[:2] == ["KV_HEADS", "HEADS_FIRST"] and list(bf16)[-1] == "FUSED_MERGE"
    assert bf16["KV_HEADS"] == [1, 2, 4]
    assert triton_tune.decode_space(plan, torch.bfloat16, num_kv_heads=8)["KV_HEADS"] == [
        1, 2, 4, 8,
    ]  # fmt: skip
    float32 = triton_tune.decode_space(plan, torch.float32, num_kv_heads=3)
    assert not {"KV_HEADS", "HEADS_FIRST", "FUSED_MERGE"} & set(float32)


def test_only_tunes_the_named_kernel_into_its_own_file(tmp_path):
    table_path = tmp_path / "decode.json"
    argv = ["--smoke", "--only", "decode_attention", "--out", str(table_path)]
    assert triton_tune.main(argv) == 0
    assert set(launch_configs.device_table("cpu", str(table_path))) == {"decode_attention"}
    with pytest.raises(SystemExit):  # never a partial table over the shipped one
        triton_tune.main(["--smoke", "--only", "decode_attention"])
