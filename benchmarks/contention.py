"""How a colocated stack keeps serving when another process takes a core.

    python -m benchmarks.contention [--variants default spin passive threads1] [--streams 4]

For each variant, `splitserve up --colocated` serves 4 concurrent streams (128-token prompts,
64 output tokens) twice: on a quiet machine, then while one busy process (a spinning Python
loop, as a load generator or sidecar would be) runs beside it. Printed: output tokens/s and
ITL median both times, and quiet / busy throughput (target: <= 2x). Variants:
- default: what `splitserve up` does (GOMP_SPINCOUNT=10000, services/pod/openmp.py);
- libgomp: OpenMP threads spin as long as libgomp's own default (GOMP_SPINCOUNT=300000);
- passive: OpenMP threads sleep as soon as they wait (OMP_WAIT_POLICY=PASSIVE);
- threads1: one torch thread in the engine process.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator

from benchmarks.vs_vllm import ANY_SLO, run_streams
from splitserve.loadgen.client import Target
from splitserve.loadgen.stacks import RunningStack, SystemSetup
from splitserve.loadgen.stats import summarize

VARIANTS = {
    "default": ({}, []),
    "libgomp": ({"GOMP_SPINCOUNT": "300000"}, []),
    "passive": ({"OMP_WAIT_POLICY": "PASSIVE"}, []),
    "threads1": ({}, ["--num-threads", "1"]),
}


@contextlib.contextmanager
def busy_core() -> Iterator[None]:
    """One process spinning on the CPU until the block ends."""
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        yield
    finally:
        spinner.kill()
        spinner.wait()


@contextlib.contextmanager
def stack(env: dict[str, str], flags: list[str]) -> Iterator[Target]:
    saved = {name: os.environ.get(name) for name in env}
    os.environ.update(env)  # the stack's processes inherit it
    try:
        setup = SystemSetup("colocated", ["--colocated", "--log-level", "warning", *flags])
        with RunningStack(setup) as running:
            yield Target(f"{running.base_url}/v1/completions", running.model_name())
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def measure(target: Target, streams: int, seed: str) -> tuple[float, float]:
    """(output tokens/s, ITL median in ms) of `streams` concurrent closed loops."""
    summary = summarize(asyncio.run(run_streams(target, streams, 3, seed)), ANY_SLO)
    if summary.num_failed:
        print(f"  {summary.num_failed} requests failed: {summary.first_error}", flush=True)
    return summary.output_throughput, summary.itl.p50 * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    parser.add_argument("--streams", type=int, default=4)
    args = parser.parse_args(argv)
    rows = []
    for name in args.variants:
        env, flags = VARIANTS[name]
        print(f"[{name}] starting", flush=True)
        with stack(env, flags) as target:
            measure(target, 1, f"{name}-warm")
            quiet = measure(target, args.streams, f"{name}-quiet")
            with busy_core():
                busy = measure(target, args.streams, f"{name}-busy")
        rows.append((name, quiet, busy))
    print(f"\n{args.streams} streams, colocated; one busy process beside it in the 'busy' columns")
    print(f"{'variant':>10}{'quiet tok/s':>13}{'busy tok/s':>12}{'quiet/busy':>12}"
          f"{'ITL quiet':>11}{'ITL busy':>10}")
    for name, (quiet_tps, quiet_itl), (busy_tps, busy_itl) in rows:
        print(f"{name:>10}{quiet_tps:>13.1f}{busy_tps:>12.1f}{quiet_tps / busy_tps:>11.2f}x"
              f"{quiet_itl:>11.1f}{busy_itl:>10.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
