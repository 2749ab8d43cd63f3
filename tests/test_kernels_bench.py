"""`python -m benchmarks.kernels_bench`, which no GPU has run yet, runs every step and check on
the CPU.

`--smoke` runs the GPU benchmark's steps with tiny shapes under Triton's interpreter, so a
wrong argument, shape or reference call in it fails here and not in a scarce GPU session.
`TRITON_INTERPRET=0 pytest tests/test_kernels_bench.py` runs the same smoke run on CUDA, which
also covers the do_bench timing path.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")  # Triton wheels exist for Linux only

import dataclasses  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import torch  # noqa: E402

from benchmarks import kernels_bench as bench  # noqa: E402
from splitserve.kernels import reference  # noqa: E402
from splitserve.kernels.rms_norm import fused_add_rms_norm  # noqa: E402

DEVICE = "cuda" if os.environ["TRITON_INTERPRET"] == "0" else "cpu"
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECK_LINE = re.compile(r"^  check (.+): relative error (\S+) \((ok|MISMATCH)\)$", re.MULTILINE)


def run_bench(*args: str, interpret: str | None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)
    if interpret is not None:
        env["TRITON_INTERPRET"] = interpret
    return subprocess.run(
        [sys.executable, "-m", "benchmarks.kernels_bench", *args],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def expected_check_names(shapes: bench.BenchShapes) -> set[str]:
    """One check per kernel result the bench computes, named as it prints them."""
    names = {"write_kv", "pack_kv_pages", "unpack_kv_pages"}
    partitions = (*shapes.decode_partition_sizes, shapes.single_partition_size)
    for num_heads, num_kv_heads, head_dim in shapes.head_layouts:
        layout = f"{num_heads}/{num_kv_heads}x{head_dim}"
        decode = f"decode {layout} b{shapes.decode_batch} ctx{shapes.decode_context}"
        names |= {f"{decode} part{size}" for size in partitions} | {f"{decode} vs sdpa"}
        names.add(f"{decode} int8")  # the same keys in an int8 cache (kv_cache_dtype int8)
        names |= {
            f"prefill {layout} {shapes.prefill_seqs}x{query_len} ctx{context}"
            for context, query_len in shapes.prefill_shapes
        }
        names |= {f"rotary {layout} query", f"rotary {layout} key"}
    for hidden in shapes.norm_hidden_sizes:
        names |= {f"fused_add_rms_norm h{hidden}", f"fused_add_rms_norm h{hidden} residual"}
    for out, inner in shapes.dequant_shapes:
        for rows in shapes.dequant_rows:
            names |= {f"int8 matmul {rows}x{inner}->{out}", f"int4 matmul {rows}x{inner}->{out}"}
    return names


def test_smoke_shapes_reach_the_paths_the_full_run_takes():
    shapes = bench.SMOKE
    # The merge kernel runs only when a partition is shorter than the context.
    assert min(shapes.decode_partition_sizes) < shapes.decode_context
    assert shapes.single_partition_size >= shapes.decode_context
    # A chunk after a cached prefix longer than itself, as well as whole prompts.
    assert any(context - query_len > query_len for context, query_len in shapes.prefill_shapes)
    assert any(context == query_len for context, query_len in shapes.prefill_shapes)
    # GQA groups that are and are not powers of two.
    groups = {num_heads // num_kv_heads for num_heads, num_kv_heads, _ in shapes.head_layouts}
    assert any(group & (group - 1) for group in groups) and 4 in groups


@pytest.mark.slow  # the program end to end (~8 s a dtype); its checker stays fast
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_smoke_run_checks_every_kernel_against_its_reference(dtype, tmp_path):
    record_path = tmp_path / "bench.json"
    result = run_bench(
        "--smoke",
        "--dtype",
        dtype,
        "--json",
        str(record_path),
        interpret=os.environ["TRITON_INTERPRET"],
    )

    assert result.returncode == 0, result.stdout + result.stderr
    checks = {name: verdict for name, _, verdict in CHECK_LINE.findall(result.stdout)}
    assert set(checks) == expected_check_names(bench.SMOKE)
    assert set(checks.values()) == {"ok"}, result.stdout
    assert "all results match their references" in result.stdout
    # Every timed call ran: one row per decode partition and SDPA, per prefill shape, ...
    rows = [
        line
        for line in result.stdout.splitlines()
        if line.startswith("  ") and not line.startswith("  check ")
    ]
    shapes = bench.SMOKE
    num_decode_rows = len(shapes.decode_partition_sizes) + 2 + 1  # + the int8 cache's
    num_rows_per_layout = num_decode_rows + len(shapes.prefill_shapes) + 1  # + rotary
    # int8, int4 and dense per dequantizing-matmul shape and row count
    num_dequant_rows = 3 * len(shapes.dequant_shapes) * len(shapes.dequant_rows)
    expected_rows = (
        len(shapes.head_layouts) * num_rows_per_layout
        + 1
        + 3
        + len(shapes.norm_hidden_sizes)
        + num_dequant_rows
    )
    assert len(rows) == expected_rows, result.stdout
    assert all(" us " in row and "% of copy" in row for row in rows)
    # The JSON record holds the same rows and checks as numbers.
    record = json.loads(record_path.read_text())
    assert [row["name"] for row in record["rows"]] == [row.split("  ")[1] for row in rows]
    assert all(row["us"] > 0 and row["percent_of_copy"] > 0 for row in record["rows"])
    assert {check["name"] for check in record["checks"]} == set(checks)
    assert record["failed_checks"] == [] and record["copy_gb_per_s"] > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
@pytest.mark.parametrize("interpret", [None, "1"])
def test_full_run_refuses_without_a_gpu(interpret):
    result = run_bench("--dtype", "float32", interpret=interpret)

    assert result.returncode != 0
    assert "--smoke" in result.stderr
    assert "check" not in result.stdout


def test_checker_reports_a_wrong_kernel_result_and_exit_status_1(capsys):
    gen = torch.Generator().manual_seed(3)
    x, residual = torch.randn(2, 5, 96, generator=gen).to(DEVICE)
    weight = torch.randn(96, generator=gen).to(DEVICE)
    normed, _ = fused_add_rms_norm(x, residual, weight, bench.RMS_EPS)
    expected = reference.fused_add_rms_norm(x, residual, weight, bench.RMS_EPS).normed
    checker = bench.Checker(torch.float32)

    checker.check("right", normed, expected)
    assert checker.report() == 0
    # Ten times the float32 tolerance on one row, a NaN (a stray read), a wrong shape.
    off_by_one_row = normed.clone()
    off_by_one_row[2] *= 1.0 + 10 * bench.TOLERANCE[torch.float32] * 5**0.5
    with_nan = normed.clone()
    with_nan[0, 0] = float("nan")
    checker.check("scaled row", off_by_one_row, expected)
    checker.check("nan", with_nan, expected)
    checker.check("shape", normed[:4], expected)
    status = checker.report()

    out = capsys.readouterr().out
    assert status == 1
    assert checker.failed == ["scaled row", "nan", "shape"]
    assert re.search(r"check right: .* \(ok\)", out)
    for name in checker.failed:
        assert re.search(rf"check {name}: .* \(MISMATCH\)", out)
    assert "MISMATCH against the reference: scaled row, nan, shape" in out


def test_shapes_reject_a_partition_size_the_decode_kernel_refuses():
    assert bench.FULL.single_partition_size == bench.FULL.decode_context == 4096
    assert dataclasses.replace(bench.SMOKE, decode_context=100).single_partition_size == 128
    for size in (24, 8, 0):
        with pytest.raises(ValueError, match="partition size"):
            dataclasses.replace(bench.SMOKE, decode_partition_sizes=(size,))


@pytest.mark.slow  # a run of the program (~4 s)
def test_step_option_runs_only_the_matching_steps():
    # The GPU runbook times the dequantizing matmuls alone with --step dequant.
    result = run_bench("--smoke", "--step", "dequant", interpret=os.environ["TRITON_INTERPRET"])
    assert result.returncode == 0, result.stdout + result.stderr
    names = {name for name, _, _ in CHECK_LINE.findall(result.stdout)}
    assert names and all(" matmul " in name for name in names)
    assert "[1/1] dequantizing matmul" in result.stdout
    refused = run_bench("--smoke", "--step", "nothing", interpret="1")
    assert refused.returncode != 0 and "matches no step" in refused.stderr
