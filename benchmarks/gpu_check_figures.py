"""Each part's figures for the JSON record of `python3 -m benchmarks.gpu_check`, read from the
files its commands wrote (JUnit XML, the benchmarks' `--json` records), with the comparisons
issue 41 asks for worked out: decode attention and page movement as a share of the copy
bandwidth and against SDPA, the dequantizing matmuls against the dense product."""

from __future__ import annotations

import json
import re
import xml.etree.ElementTree as ElementTree
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Issue 41's bars, reported beside the figures (a benchmark never fails on a speed).
TARGET_PERCENT_OF_COPY = 70.0
# The kernel benchmark's runs (gpu_check_parts runs each): bfloat16 only since 2026-11-27, as
# float32's figures from the first run stand and the tuner times float32 decode attention.
BENCH_DTYPES = ("bfloat16",)
# Test ids may hold spaces (parameters such as "[(1, 32, 16, 4, 2)]"), so the id runs up to the
# last outcome word on the line.
VERBOSE_OUTCOME = re.compile(
    r"^(?P<test>\S+::.+) (?P<outcome>PASSED|FAILED|ERROR|SKIPPED)(?: +\[ *\d+%\])?$", re.MULTILINE
)
DEQUANT_ROW = re.compile(r"^(int8|int4|dense \w+) matmul (\S+)$")


def _read_json(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


def setup_figures(logs: Path) -> dict[str, Any]:
    return {"verify": _read_json(logs / "setup_verify.json")}


def junit_outcomes(xml_path: Path) -> dict[str, Any]:
    """Counts by outcome and each test's outcome, keyed `module::test[params]`; from pytest's
    verbose log beside the XML (`<name>.log`) when pytest was killed before writing it."""
    if xml_path.is_file():
        tests = _tests_from_junit(xml_path)
        source = "junit"
    elif xml_path.with_suffix(".log").is_file():
        tests = _tests_from_verbose_log(xml_path.with_suffix(".log"))
        source = "log (no JUnit file: pytest did not finish)"
    else:
        return {"junit": "missing"}
    counts = {outcome: 0 for outcome in ("passed", "failed", "error", "skipped")}
    for outcome in tests.values():
        counts[outcome] += 1
    return {**counts, "source": source, "tests": tests}


def _tests_from_junit(xml_path: Path) -> dict[str, str]:
    return {
        f"{case.get('classname', '')}::{case.get('name', '')}": _case_outcome(case)
        for case in ElementTree.parse(xml_path).getroot().iter("testcase")
    }


def _tests_from_verbose_log(log_path: Path) -> dict[str, str]:
    outcomes = {"PASSED": "passed", "FAILED": "failed", "ERROR": "error", "SKIPPED": "skipped"}
    tests = {}
    for match in VERBOSE_OUTCOME.finditer(log_path.read_text(errors="replace")):
        tests[match["test"]] = outcomes[match["outcome"]]
    return tests


def _case_outcome(case: ElementTree.Element) -> str:
    for tag, outcome in (("failure", "failed"), ("error", "error"), ("skipped", "skipped")):
        if case.find(tag) is not None:
            return outcome
    return "passed"


def _tests_figures(name: str) -> Callable[[Path], dict[str, Any]]:
    def figures(logs: Path) -> dict[str, Any]:
        return junit_outcomes(logs / f"{name}.xml")

    return figures


def kernel_bench_figures(logs: Path) -> dict[str, Any]:
    return {dtype: _bench_figures(logs / f"kernel_bench_{dtype}.json") for dtype in BENCH_DTYPES}


def _bench_figures(path: Path) -> dict[str, Any] | None:
    record = _read_json(path)
    if record is None:
        return None
    rows = {row["name"]: row for row in record["rows"]}
    summary = {
        "decode": decode_summary(rows),
        "pages": pages_summary(rows),
        "dequant": dequant_summary(rows),
    }
    return {**record, "summary": summary}


def decode_summary(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per decode shape: the fastest partition size against the copy bandwidth and SDPA."""
    summary = {}
    for sdpa_name, sdpa in rows.items():
        if not sdpa_name.endswith(" sdpa contiguous"):
            continue
        shape = sdpa_name.removesuffix(" sdpa contiguous")
        paged = [row for name, row in rows.items() if name.startswith(f"{shape} part")]
        best = min(paged, key=lambda row: row["us"])
        int8 = rows.get(f"{shape} int8")
        summary[shape] = {
            "best_partition": best["name"].removeprefix(f"{shape} "),
            "us": best["us"],
            "percent_of_copy": best["percent_of_copy"],
            "sdpa_us": sdpa["us"],
            "speedup_over_sdpa": sdpa["us"] / best["us"],
            "int8_cache_us": int8["us"] if int8 else None,
            "meets_target": best["percent_of_copy"] >= TARGET_PERCENT_OF_COPY
            and best["us"] <= sdpa["us"],
        }
    return summary


def pages_summary(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {
        name: {
            "us": row["us"],
            "percent_of_copy": row["percent_of_copy"],
            "meets_target": row["percent_of_copy"] >= TARGET_PERCENT_OF_COPY,
        }
        for name, row in rows.items()
        if name.startswith(("pack_kv_pages", "unpack_kv_pages"))
    }


def dequant_summary(rows: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per matmul size: each kernel's speed-up over the dense product of the same size."""
    by_size: dict[str, dict[str, float]] = {}
    for name, row in rows.items():
        match = DEQUANT_ROW.match(name)
        if match:
            kind = "dense" if match[1].startswith("dense") else match[1]
            by_size.setdefault(match[2], {})[kind] = row["us"]
    return {
        size: {
            **{f"{kind}_us": us for kind, us in times.items()},
            "int8_speedup_over_dense": times["dense"] / times["int8"],
            "int4_speedup_over_dense": times["dense"] / times["int4"],
        }
        for size, times in by_size.items()
        if {"dense", "int8", "int4"} <= times.keys()
    }


def tune_figures(logs: Path) -> dict[str, Any]:
    """Each tuned shape's default and best time, and the table the later parts ran with."""
    outcomes = _read_json(logs / "triton_tune.json") or []
    shapes = {
        f"{o['kernel']} {o['key']}": {
            "default_us": 1e3 * o["default_ms"],
            "best_us": 1e3 * o["best_ms"],
            "speedup": o["default_ms"] / o["best_ms"],
            "wrong": len(o["wrong"]),
            "failed": len(o["failed"]),
        }
        for o in outcomes  # type: ignore[union-attr]
    }
    return {"shapes": shapes, "table": _read_json(logs / "triton_configs.json")}


def _record_figures(name: str) -> Callable[[Path], dict[str, Any]]:
    def figures(logs: Path) -> dict[str, Any]:
        return {"record": _read_json(logs / f"{name}.json")}

    return figures


FIGURES_OF_PART: dict[str, Callable[[Path], dict[str, Any]]] = {
    "setup": setup_figures,
    "tune": tune_figures,
    "kernel_tests": _tests_figures("kernel_tests"),
    "model_tests": _tests_figures("model_tests"),
    "changed_kernel_tests": _tests_figures("changed_kernel_tests"),
    "graph_timings": _record_figures("graph_timings"),
    "kernel_bench": kernel_bench_figures,
    "engine_check": _record_figures("engine_check"),
    "engine_timings": _record_figures("engine_timings"),
}
