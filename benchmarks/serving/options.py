"""`python -m benchmarks.serve`'s flags, and the validated configuration they make."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from splitserve.loadgen.stats import Slo
from splitserve.loadgen.workload import LengthDistribution, WorkloadShape

# On this 2-core machine one decode core streams ~45 output tokens/s at most (a decode step
# costs ~15 ms more per running sequence), so with outputs of 80 tokens on average the
# systems saturate near 0.55 req/s: the sweep goes from light load to just past that.
FULL_RATES = "0.15,0.3,0.45,0.6"
QUICK_RATES = "0.3,0.5"
SYSTEM_NAMES = ("colocated", "disaggregated")


@dataclass(frozen=True)
class BenchConfig:
    rates: list[float]
    duration_s: float  # arrivals stop after this long at each rate
    max_requests: int  # per rate
    drain_timeout_s: float  # after the last arrival; then what still streams is cancelled
    num_unloaded: int
    shape: WorkloadShape
    seed: int
    slo: Slo
    systems: list[str]
    transport: str | None
    startup_timeout_s: float
    quiet_wait_s: float  # before each system, wait this long at most for a quiet machine
    retry_noisy: bool  # measure a load again when other processes were busy meanwhile
    plot_dir: str | None
    json_path: str | None


def build_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.serve",
        description=description,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--quick", action="store_true", help="a ~3-4 minute version (full: ~12-15 minutes)"
    )
    parser.add_argument(
        "--rates",
        default=None,
        help=f"req/s, comma-separated (default {FULL_RATES}; --quick {QUICK_RATES})",
    )
    parser.add_argument(
        "--duration",
        type=float,
        default=None,
        metavar="SECONDS",
        help="arrivals stop after this long at each rate (default 60; --quick 25)",
    )
    parser.add_argument("--max-requests", type=int, default=100, help="per rate")
    parser.add_argument(
        "--drain-timeout",
        type=float,
        default=None,
        metavar="SECONDS",
        help="wait this long after the last arrival, then cancel (default 45; --quick 20)",
    )
    parser.add_argument(
        "--unloaded-requests",
        type=int,
        default=None,
        metavar="N",
        help="requests one at a time for the unloaded baseline (default 6; --quick 3)",
    )
    parser.add_argument("--prompt-lens", default="64-512", help="uniform, tokens (low-high)")
    parser.add_argument("--output-lens", default="32-128", help="uniform, tokens (low-high)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--slo-ttft-ms",
        type=float,
        default=3000.0,
        help="goodput SLO on time to first token (default: a 512-token prompt on one core "
        "takes ~2 s here)",
    )
    parser.add_argument(
        "--slo-itl-ms",
        type=float,
        default=100.0,
        help="goodput SLO on a request's mean inter-token latency (default: about twice the "
        "unloaded ITL here)",
    )
    parser.add_argument(
        "--systems", default=",".join(SYSTEM_NAMES), help="which to run, comma-separated"
    )
    parser.add_argument(
        "--transport",
        default=None,
        choices=["ucx", "tcp"],
        help="disaggregated KV transport (default: splitserve up's choice)",
    )
    parser.add_argument("--startup-timeout", type=float, default=300.0, metavar="SECONDS")
    parser.add_argument(
        "--quiet-wait",
        type=float,
        default=120.0,
        metavar="SECONDS",
        help="before each system, wait up to this long for other processes to leave the "
        "CPUs idle (0: do not wait)",
    )
    parser.add_argument(
        "--retry-noisy",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="measure a load once more when other processes took CPU during it",
    )
    parser.add_argument("--plot-dir", default="docs", help="where the PNG plots go ('' for none)")
    parser.add_argument("--json", default=None, metavar="PATH", help="also write summaries here")
    return parser


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    rates = _parse_rates(args.rates or (QUICK_RATES if args.quick else FULL_RATES))
    systems = [name.strip() for name in args.systems.split(",") if name.strip()]
    if not systems or any(name not in SYSTEM_NAMES for name in systems):
        raise ValueError(f"systems must be names from {SYSTEM_NAMES}, got {args.systems!r}")
    config = BenchConfig(
        rates=rates,
        duration_s=_pick(args.duration, args.quick, 60.0, 25.0),
        max_requests=args.max_requests,
        drain_timeout_s=_pick(args.drain_timeout, args.quick, 45.0, 20.0),
        num_unloaded=_pick(args.unloaded_requests, args.quick, 6, 3),
        shape=WorkloadShape(
            LengthDistribution.parse(args.prompt_lens, "prompt_lens"),
            LengthDistribution.parse(args.output_lens, "output_lens"),
        ),
        seed=args.seed,
        slo=Slo(args.slo_ttft_ms / 1e3, args.slo_itl_ms / 1e3),
        systems=systems,
        transport=args.transport,
        startup_timeout_s=args.startup_timeout,
        quiet_wait_s=args.quiet_wait,
        retry_noisy=args.retry_noisy,
        plot_dir=args.plot_dir or None,
        json_path=args.json,
    )
    _validate(config)
    return config


def _pick(given, quick: bool, full_default, quick_default):
    if given is not None:
        return given
    return quick_default if quick else full_default


def _parse_rates(text: str) -> list[float]:
    try:
        rates = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise ValueError(f"rates must be comma-separated numbers, got {text!r}") from None
    if not rates or any(rate <= 0 for rate in rates) or len(set(rates)) != len(rates):
        raise ValueError(f"rates must be distinct numbers > 0, got {text!r}")
    return sorted(rates)


def _validate(config: BenchConfig) -> None:
    if config.duration_s <= 0:
        raise ValueError(f"duration must be > 0, got {config.duration_s}")
    if config.max_requests < 1:
        raise ValueError(f"max_requests must be >= 1, got {config.max_requests}")
    if config.drain_timeout_s <= 0:
        raise ValueError(f"drain_timeout must be > 0, got {config.drain_timeout_s}")
    if config.num_unloaded < 1:
        raise ValueError(f"unloaded_requests must be >= 1, got {config.num_unloaded}")
    if config.quiet_wait_s < 0:
        raise ValueError(f"quiet_wait must be >= 0, got {config.quiet_wait_s}")
