"""`python -m benchmarks.goodput`: see the package's docstring (benchmarks/goodput/__init__.py)."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import benchmarks.goodput as package
from benchmarks.goodput.clients import FIXED, WORKLOADS
from benchmarks.goodput.report import print_report, write_json, write_plot
from benchmarks.goodput.run import Bench, Options, expected_s
from benchmarks.goodput.systems import (
    ADMISSION_FLAGS,
    BASELINE,
    System,
    admission_available,
    systems_under_test,
)
from benchmarks.machine import AVX2_ENV, machine_line, machine_title

DURATION_S = 60.0
QUICK_DURATION_S = 10.0
SATURATION_CONCURRENCY = 16  # the past-saturation measurement ran 16 streams
SATURATION_PROMPTS = 64  # four rounds of 16: the first round's ramp-up weighs a quarter
QUICK_SATURATION_PROMPTS = 32


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    doc = package.__doc__ or ""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10 s per load, 256/64 only")
    parser.add_argument("--duration", type=float, default=None, help="seconds of arrivals")
    parser.add_argument("--loads", type=float, nargs="+", default=[0.5, 1.0, 2.0, 3.0])
    parser.add_argument("--force-avx2", action="store_true", help="as benchmarks.tail_latency")
    parser.add_argument("--out", type=Path, default=None, help="JSON path; the PNG goes beside")
    parser.add_argument("--systems", nargs="+", default=None, help="a subset, by name")
    parser.add_argument(
        "--reference-rate",
        type=float,
        default=None,
        help="splitserve's saturation in req/s, for --systems without splitserve",
    )
    args = parser.parse_args(argv)
    if args.duration is None:
        args.duration = QUICK_DURATION_S if args.quick else DURATION_S
    if args.duration <= 0 or any(load <= 0 for load in args.loads):
        parser.error("--duration and --loads must be > 0")
    if args.reference_rate is not None and args.reference_rate <= 0:
        parser.error("--reference-rate must be > 0")
    if args.out is None:
        args.out = Path("build/goodput_quick.json" if args.quick else "docs/goodput.json")
    return args


def options_from(args: argparse.Namespace) -> Options:
    return Options(
        duration_s=args.duration,
        load_factors=sorted(args.loads),
        workloads=[FIXED] if args.quick else list(WORKLOADS),
        saturation_concurrency=SATURATION_CONCURRENCY,
        saturation_prompts=QUICK_SATURATION_PROMPTS if args.quick else SATURATION_PROMPTS,
        seed=int(time.time()),
        reference_rate=args.reference_rate,
    )


def chosen_systems(has_admission: bool, args: argparse.Namespace) -> list[System]:
    systems = systems_under_test(has_admission)
    if args.systems is None:
        return systems
    names = [system.name for system in systems]
    unknown = set(args.systems) - set(names)
    if unknown:
        raise SystemExit(f"--systems: no {sorted(unknown)} here; there are {names}")
    if BASELINE not in args.systems and args.reference_rate is None:
        raise SystemExit(f"--systems without {BASELINE} needs --reference-rate")
    return [system for system in systems if system.name in args.systems]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.force_avx2:
        os.environ.update(AVX2_ENV)  # every process started below inherits it
    machine = machine_line()
    print(machine, flush=True)
    has_admission = admission_available()
    if not has_admission:
        print(
            f"`splitserve up --help` lists no {' / '.join(ADMISSION_FLAGS)}: measuring "
            "splitserve WITHOUT admission control only (our client on it too)",
            flush=True,
        )
    systems = chosen_systems(has_admission, args)
    options = options_from(args)
    print(
        f"systems: {', '.join(s.name for s in systems)}; workloads: "
        f"{', '.join(w.name for w in options.workloads)}; loads {options.load_factors} x "
        f"saturation, {options.duration_s:.0f} s each; expected about "
        f"{expected_s(systems, options) / 60:.0f} min",
        flush=True,
    )
    results = Bench(systems, options).run()
    print_report(results)
    options_json = {key: str(value) for key, value in vars(args).items()}
    header = {"machine": machine, "admission_available": has_admission, "options": options_json}
    write_json(args.out, header, results)
    title = f"{machine_title()}; {options.duration_s:.0f} s per load, vLLM's client"
    write_plot(args.out.with_suffix(".png"), results, title)
    print(f"\nwrote {args.out} and {args.out.with_suffix('.png')}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
