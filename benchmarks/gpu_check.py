"""The GPU check of issue 41 in one program: install, kernel tests, kernel benchmark, engine
check and engine timings on a lent CUDA machine, every figure into one JSON file.

    python3 -m benchmarks.gpu_check --prepare              # here: build/gpu/ for `carry`
    python3 -m benchmarks.gpu_check --call 1               # device call 1: kernels
    python3 -m benchmarks.gpu_check --call 2               # device call 2: the engine
    python3 -m benchmarks.gpu_check --dry-run [--out DIR]  # here: every part's CPU fallback

Each part runs as child processes, each with its own time limit (its process group is killed
when the limit passes), so a hung or slow part cannot eat the others' time. Each child writes
its own log; the logs go into one `gpu_check_logs.tar.gz` under the output folder (`--out`,
default `$OUT`), beside `gpu_check_<call>.json` (every part's status, times and figures) and
the console log `gpu_check_<call>_console.log`: three files, as the device returns at most
eight.

The parts (docs/benchmarks.md, "GPU (issue 41)", says which call runs which):
- setup: `pip install --no-deps --no-index --target` of this checkout (the machine has no
  network), the carried packages (`gguf`, the model's stand-in package), the model reassembled
  from the parts the calls carried, then every import checked in a fresh process.
- kernel_tests / model_tests: pytest on the kernel tests with TRITON_INTERPRET=0 (their DEVICE
  is then "cuda"), outcome per test from a JUnit XML; model_tests are those needing the GGUF.
- kernel_bench: `benchmarks.kernels_bench` in bfloat16 and float32.
- engine_check: `benchmarks.gpu_engine_check` (greedy tokens on CUDA equal the CPU engine's).
- engine_timings: `benchmarks.gpu_engine_timings` (ITL, throughput, transformers, the share
  of a decode step outside kernels).

`--dry-run` runs each part's CPU fallback instead (tests collected and one file run in the
interpreter, `--smoke` runs of the benchmarks), into a scratch install; tests/test_gpu_check.py
runs it.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

from benchmarks.gpu_check_parts import PARTS_OF_CALL, CheckContext, run_parts
from benchmarks.gpu_check_prepare import prepare
from benchmarks.gpu_check_report import Console, write_outputs

REPO_ROOT = Path(__file__).resolve().parent.parent
DEVICE_WORKDIR = "/tmp/gpu_check"  # survives between two calls on a warm device machine


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.prepare:
        prepare(REPO_ROOT)
        return 0
    out = Path(args.out or os.environ.get("OUT") or REPO_ROOT / "build" / "gpu_check_out")
    out.mkdir(parents=True, exist_ok=True)
    workdir = Path(args.workdir or (tempfile.mkdtemp() if args.dry_run else DEVICE_WORKDIR))
    label = "dry_run" if args.dry_run else f"call{args.call}" if args.call else "all"
    console = Console(out / f"gpu_check_{label}_console.log")
    ctx = CheckContext(REPO_ROOT, workdir, args.dry_run, console)
    parts = _chosen_parts(args)
    results = run_parts(ctx, parts)
    write_outputs(out, label, ctx, results)
    return 0 if all(result.status in ("passed", "skipped") for result in results) else 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python3 -m benchmarks.gpu_check",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--prepare", action="store_true", help="build build/gpu/ and stop")
    parser.add_argument("--dry-run", action="store_true", help="every part's CPU fallback")
    parser.add_argument("--call", type=int, choices=sorted(PARTS_OF_CALL), help="a call's parts")
    parser.add_argument("--parts", default="", help="comma-separated part names instead")
    parser.add_argument("--out", default="", help="output folder (default $OUT)")
    parser.add_argument("--workdir", default="", help=f"install, logs (default {DEVICE_WORKDIR})")
    return parser


def _chosen_parts(args: argparse.Namespace) -> list[str]:
    if args.parts:
        return [name.strip() for name in args.parts.split(",") if name.strip()]
    if args.call:
        return list(PARTS_OF_CALL[args.call])
    return list(dict.fromkeys(name for call in PARTS_OF_CALL.values() for name in call))


if __name__ == "__main__":
    sys.exit(main())
