"""The outputs of `python3 -m benchmarks.gpu_check`: the console log (printed and kept), the
one JSON record of every part, and the logs archive."""

from __future__ import annotations

import json
import platform
import tarfile
import time
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from benchmarks.gpu_check_parts import CheckContext, PartResult


class Console:
    """Prints a line and keeps it in the console log."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.write_text("")

    def say(self, text: str) -> None:
        print(text, flush=True)
        # Opened per line: the log stays whole up to the last line if the call is cut off.
        with open(self.path, "a") as log:
            log.write(text + "\n")


def write_outputs(
    out: Path, label: str, ctx: CheckContext, results: list[PartResult]
) -> dict[str, Any]:
    """Writes gpu_check_<label>.json and gpu_check_logs.tar.gz under `out`; prints a summary."""
    record = {
        "label": label,
        "is_dry_run": ctx.is_dry_run,
        "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "host": platform.node(),
        "parts": {result.name: _part_record(result) for result in results},
    }
    path = out / f"gpu_check_{label}.json"
    # inf / nan relative errors go out as JSON's Infinity / NaN extensions (Python reads them).
    path.write_text(json.dumps(record, indent=1))
    with tarfile.open(out / "gpu_check_logs.tar.gz", "w:gz") as archive:
        archive.add(ctx.logs, arcname=f"gpu_check_logs_{label}")
    for line in summary_lines(record):
        ctx.console.say(line)
    ctx.console.say(f"record: {path}")
    return record


def _part_record(result: PartResult) -> dict[str, Any]:
    return {
        "status": result.status,
        "seconds": round(result.seconds, 1),
        "commands": [
            {**asdict(command), "timed_out": command.timed_out} for command in result.commands
        ],
        "figures": result.figures,
    }


def summary_lines(record: dict[str, Any]) -> list[str]:
    """One line per part, then the figures issue 41 asks about."""
    lines = ["== summary"]
    for name, part in record["parts"].items():
        lines.append(f"{name}: {part['status']} ({part['seconds']:.0f} s)")
        lines += [f"  {line}" for line in _figure_lines(name, part["figures"])]
    return lines


def _figure_lines(name: str, figures: dict[str, Any]) -> list[str]:
    if name in ("kernel_tests", "model_tests"):
        return _test_lines(figures)
    if name == "kernel_bench":
        return [line for dtype, bench in figures.items() for line in _bench_lines(dtype, bench)]
    if name == "tune":
        return [
            f"{shape}: {f['default_us']:.1f} -> {f['best_us']:.1f} us ({f['speedup']:.2f}x)"
            + (f", {f['wrong']} WRONG" if f["wrong"] else "")
            for shape, f in figures.get("shapes", {}).items()
        ]
    if name == "setup" and figures.get("verify"):
        verify = figures["verify"]
        return [f"gpu {verify.get('gpu')}, torch {verify.get('torch')}, model {verify['model']}"]
    record = figures.get("record")
    return [json.dumps(record.get("summary", record))[:1500]] if record else []


def _test_lines(figures: dict[str, Any]) -> list[str]:
    if "tests" not in figures:
        return ["no JUnit record"]
    counts = ", ".join(f"{figures[k]} {k}" for k in ("passed", "failed", "error", "skipped"))
    bad = [test for test, outcome in figures["tests"].items() if outcome in ("failed", "error")]
    return [counts, *[f"not passed: {test}" for test in bad[:20]]]


def _bench_lines(dtype: str, bench: dict[str, Any] | None) -> list[str]:
    if bench is None:
        return [f"{dtype}: no record"]
    lines = [f"{dtype}: copy {bench['copy_gb_per_s']:.0f} GB/s, failed checks "
             f"{bench['failed_checks'] or 'none'}"]  # fmt: skip
    summary = bench["summary"]
    for shape, d in summary["decode"].items():
        lines.append(
            f"{dtype} {shape}: {d['percent_of_copy']:.0f}% of copy, "
            f"{d['speedup_over_sdpa']:.2f}x sdpa ({d['best_partition']})"
        )
    for row, p in summary["pages"].items():
        lines.append(f"{dtype} {row}: {p['percent_of_copy']:.0f}% of copy")
    for size, q in summary["dequant"].items():
        lines.append(
            f"{dtype} matmul {size}: int8 {q['int8_speedup_over_dense']:.2f}x, "
            f"int4 {q['int4_speedup_over_dense']:.2f}x dense"
        )
    return lines
