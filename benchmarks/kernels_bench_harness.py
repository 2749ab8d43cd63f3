"""What every step of `python -m benchmarks.kernels_bench` shares: a timing row, the checker
against the reference, the run's context and the two timers (do_bench on CUDA, a wall clock
under the interpreter).

A module of its own so that the steps in other modules (benchmarks/kernels_bench_dequant.py)
import it without importing the benchmark's entry point, which lists them.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from benchmarks.kernels_bench import BenchShapes

TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 5e-3}

# Off CUDA only. The interpreter compiles nothing, so no warm-up call; timings there only prove
# that each timed call runs.
WALL_CLOCK_REPS = 1


@dataclass
class Timing:
    name: str
    ms: float
    num_bytes: int
    flops: int = 0

    def row(self, copy_gbps: float) -> str:
        figures = self.figures(copy_gbps)
        line = (
            f"  {self.name:<44} {figures.us:10.1f} us {figures.gb_per_s:8.1f} GB/s "
            f"{figures.percent_of_copy:5.0f}% of copy"
        )
        if figures.tflop_per_s is not None:
            line += f" {figures.tflop_per_s:7.3f} TFLOP/s"
        return line

    def figures(self, copy_gbps: float) -> TimingFigures:
        gbps = self.num_bytes / self.ms / 1e6
        tflops = self.flops / self.ms / 1e9 if self.flops else None
        return TimingFigures(self.name, self.ms * 1e3, gbps, 100 * gbps / copy_gbps, tflops)


@dataclass(frozen=True)
class TimingFigures:
    """One printed row as numbers, for the JSON record (`--json`)."""

    name: str
    us: float
    gb_per_s: float
    percent_of_copy: float  # of the copy bandwidth measured in the same run
    tflop_per_s: float | None


@dataclass(frozen=True)
class CheckResult:
    name: str
    relative_error: float  # inf for a wrong shape, nan for a stray read
    is_ok: bool


class Checker:
    """Compares results with references; remembers which failed."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.tolerance = TOLERANCE[dtype]
        self.failed: list[str] = []
        self.results: list[CheckResult] = []

    def check(self, name: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
        """Relative error in the 2-norm; NaN anywhere (a stray read) counts as a mismatch."""
        if actual.shape != expected.shape:
            error = math.inf
        else:
            diff = (actual.double() - expected.double()).norm()
            error = (diff / expected.double().norm()).item()
        is_ok = math.isfinite(error) and error < self.tolerance
        if not is_ok:
            self.failed.append(name)
        self.results.append(CheckResult(name, error, is_ok))
        verdict = "ok" if is_ok else "MISMATCH"
        print(f"  check {name}: relative error {error:.2e} ({verdict})", flush=True)

    def report(self) -> int:
        """Prints the verdict; returns the exit status (1 if any check failed)."""
        if self.failed:
            print(f"MISMATCH against the reference: {', '.join(self.failed)}", flush=True)
            return 1
        print("all results match their references", flush=True)
        return 0


@dataclass(frozen=True)
class BenchContext:
    shapes: BenchShapes
    dtype: torch.dtype
    device: torch.device
    checker: Checker
    time_ms: Callable[[Callable[[], object]], float]

    def randn(self, *shape: int) -> torch.Tensor:
        return torch.randn(*shape, device=self.device, dtype=self.dtype)


def do_bench_ms(fn: Callable[[], object]) -> float:
    # Lazy: Triton reads TRITON_INTERPRET at import, and pick_device sets it first.
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median")


def wall_clock_ms(fn: Callable[[], object]) -> float:
    """Median wall time of a few calls; for runs off CUDA, where it says nothing about the
    kernels (the interpreter runs them in numpy)."""
    times = []
    for _ in range(WALL_CLOCK_REPS):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)
