"""`python -m splitserve.planner` (also `splitserve plan`): profile, simulate, recommend,
validate, autoscale."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict

from splitserve.common.cli_args import parse_size
from splitserve.loadgen.stats import Slo
from splitserve.loadgen.workload import (
    LengthDistribution,
    WorkloadSpec,
    load_trace,
    poisson_requests,
)
from splitserve.planner.autoscale.loop import add_autoscale_flags, run_autoscale
from splitserve.planner.measure.settings import QUICK_GRID, Grid, ProfileSettings
from splitserve.planner.plot import plot_goodput_vs_ratio
from splitserve.planner.profile import DEFAULT_MARGIN, load_profile
from splitserve.planner.recommend import format_table, helm_values, recommend
from splitserve.planner.search import Profiles, Recommendation, SearchSpec
from splitserve.planner.simulate.cluster import ClusterConfig, simulate
from splitserve.planner.simulate.failures import PodFailure
from splitserve.planner.simulate.prefix_cache import TierSizes
from splitserve.planner.simulate.speculation import SpeculationModel

DEFAULT_PROFILE = "planner_profile.json"
DEFAULT_PLOT = "docs/planner_goodput_vs_ratio.png"


def build_parser(prog: str = "python -m splitserve.planner") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__)
    add_plan_subcommands(parser)
    return parser


def add_plan_subcommands(parser: argparse.ArgumentParser) -> None:
    """The subcommands, on `parser` (the planner's own, or `splitserve plan`'s)."""
    commands = parser.add_subparsers(dest="plan_command", required=True)
    _add_profile(commands.add_parser("profile", help="measure a pod on this machine"))
    simulate = commands.add_parser("simulate", help="simulate P prefill + D decode pods")
    _add_simulation_flags(simulate)
    simulate.add_argument("--prefill", type=int, default=1, metavar="P", help="0 = colocated")
    simulate.add_argument("--decode", type=int, default=1, metavar="D")
    simulate.add_argument("--json", default=None, metavar="PATH", help="also write the result")
    simulate.add_argument(
        "--decode-failure",
        action="append",
        default=[],
        metavar="AT_S[,POD[,DETECT_S]]",
        help="a decode pod (index, default 0) dies at AT_S; the gateway sees it after DETECT_S "
        "(0: a reset; its stall timeout for a wedged pod); streams move (repeatable)",
    )
    recommend = commands.add_parser("recommend", help="search (P, D) for a rate and SLOs")
    _add_simulation_flags(recommend)
    _add_recommend_flags(recommend)
    validate = commands.add_parser("validate", help="simulated against measured, on this machine")
    _add_validate_flags(validate)
    add_autoscale_flags(commands.add_parser("autoscale", help="scale Deployments to the load"))


def _add_profile(sub: argparse.ArgumentParser) -> None:
    sub.add_argument("--output", default=DEFAULT_PROFILE, metavar="PATH")
    sub.add_argument(
        "--model", default=None, help="a .gguf file or HF directory (default: SmolLM2)"
    )
    sub.add_argument("--num-threads", type=int, default=1, help="torch threads, as a pod runs")
    sub.add_argument("--kv-cache-bytes", default="256MiB", help="a pod's KV cache (as `up`'s)")
    sub.add_argument("--max-num-batched-tokens", type=int, default=512)
    sub.add_argument("--kv-transport", default="tcp", choices=["tcp", "ucx"])
    sub.add_argument("--repeats", type=int, default=3, help="timed steps per point")
    sub.add_argument("--quick", action="store_true", help="a smaller grid (about 30 s)")
    sub.add_argument("--quantization", default="none", help="weights, as the pods run them")
    sub.add_argument("--kv-cache-dtype", default="auto", help="KV cache, as the pods run it")
    sub.add_argument("--tensor-parallel-size", type=int, default=1)
    sub.add_argument("--pipeline-parallel-size", type=int, default=1)
    sub.add_argument(
        "--serving",
        action="store_true",
        help="also measure the serving path's costs on local stacks (about 2 minutes)",
    )
    sub.add_argument(
        "--neighbor-core",
        type=int,
        default=None,
        metavar="CPU",
        help="also measure steps beside a second engine pinned to this CPU (pods sharing a "
        "machine); pin this one elsewhere (taskset)",
    )


def _add_profile_flags(sub: argparse.ArgumentParser) -> None:
    """The measured profile a subcommand reads, and the margin its times are taken with."""
    sub.add_argument("--profile", default=DEFAULT_PROFILE, metavar="PATH")
    sub.add_argument(
        "--margin",
        type=float,
        default=DEFAULT_MARGIN,
        help="measured times are taken this much slower (0.1 = 10%%): the planner errs high",
    )


def _add_simulation_flags(sub: argparse.ArgumentParser) -> None:
    _add_profile_flags(sub)
    sub.add_argument("--trace", default=None, metavar="PATH", help="JSONL requests (else Poisson)")
    sub.add_argument("--rate", type=float, default=1.0, help="Poisson arrivals, requests/s")
    sub.add_argument("--num-requests", type=int, default=400)
    sub.add_argument("--input-lens", default="64-512", help="uniform range, or one length")
    sub.add_argument("--output-lens", default="32-128")
    sub.add_argument("--prefix-groups", type=int, default=0, help="requests share prefixes")
    sub.add_argument("--prefix-len", type=int, default=0, help="tokens shared in a group")
    sub.add_argument("--seed", type=int, default=0)
    sub.add_argument("--ttft-slo", type=float, default=2.0, help="seconds")
    sub.add_argument("--itl-slo", type=float, default=0.2, help="seconds (a request's mean)")
    sub.add_argument("--local-prefill-threshold", type=int, default=32)
    sub.add_argument(
        "--max-remote-prefill-tokens",
        type=int,
        default=0,
        help="as the decode pods' flag: conditional disaggregation (0 = always send)",
    )
    sub.add_argument(
        "--pods-per-host",
        type=int,
        default=1,
        help="pods sharing one machine (CPU pods on one node): they slow each other by the "
        "profile's neighbor slowdowns (1 = each pod alone, as GPU pods)",
    )
    sub.add_argument("--max-num-batched-tokens", type=int, default=None)
    sub.add_argument("--kv-blocks", type=int, default=None, help="per pod (default: profile's)")
    sub.add_argument(
        "--speculative-tokens", type=int, default=0, help="drafts per decode row (0 = off)"
    )
    sub.add_argument(
        "--host-tier-blocks", type=int, default=0, help="KV offload host tier per pod (0 = off)"
    )
    sub.add_argument(
        "--disk-tier-blocks", type=int, default=0, help="KV offload disk tier per pod (0 = off)"
    )
    sub.add_argument(
        "--acceptance-rate",
        type=float,
        default=0.7,
        help="per draft token, as the pods' spec_decode metrics report for this workload",
    )


def _add_recommend_flags(sub: argparse.ArgumentParser) -> None:
    sub.add_argument("--attainment", type=float, default=0.9, help="share meeting both SLOs")
    sub.add_argument(
        "--confidence",
        type=float,
        default=0.8,
        help="share of the seeded workloads in which the attainment must hold",
    )
    sub.add_argument("--seeds", type=int, default=5, help="seeded workloads per configuration")
    sub.add_argument(
        "--prefill-profile",
        default=None,
        metavar="PATH",
        help="the prefill pods' profile when they run another setup (default: --profile)",
    )
    sub.add_argument("--max-pods", type=int, default=8)
    sub.add_argument(
        "--ratio-max-pods",
        type=int,
        default=4,
        help="pods in the ratio sweep (with slices, the sweep runs the slice's layouts instead)",
    )
    sub.add_argument(
        "--slice-pods",
        type=int,
        default=None,
        metavar="N",
        help="judge each layout by a slice of N pods at its share of the rate (0: whole "
        "layouts; default: slices of 10 past 64 --max-pods)",
    )
    sub.add_argument(
        "--jobs",
        type=int,
        default=len(os.sched_getaffinity(0)),
        help="simulations at once, in worker processes (default: this process's cores)",
    )
    sub.add_argument("--no-colocated", action="store_true", help="leave out P = 0")
    sub.add_argument(
        "--variant-profile",
        action="append",
        default=[],
        metavar="PATH",
        help="another setup of the model (say int8 weights) for the layout sweep; repeatable",
    )
    sub.add_argument(
        "--remote-prefill-limits",
        default="",
        metavar="N,N,...",
        help="conditional-disaggregation limits the layout sweep tries for P > 0 layouts",
    )
    sub.add_argument(
        "--try-admission",
        action="store_true",
        help="the layout sweep also tries each layout with the gateway's SLO-aware admission "
        "(--admission --slo-ttft-ms at --ttft-slo)",
    )
    sub.add_argument("--plot", default=DEFAULT_PLOT, metavar="PATH", help="'' for none")


def _add_validate_flags(sub: argparse.ArgumentParser) -> None:
    _add_profile_flags(sub)
    sub.add_argument("--duration", type=float, default=60.0, help="seconds per measured run")
    sub.add_argument(
        "--fresh-profile", action="store_true", help="measure --profile first (quick grid)"
    )
    sub.add_argument("--only", nargs="*", default=None, help="configurations to run, by name")
    sub.add_argument("--seed", type=int, default=0)
    sub.add_argument(
        "--json", default=None, metavar="PATH", help="also write the runs (a record to --replay)"
    )
    sub.add_argument("--plot", default=None, metavar="PATH", help="measured vs simulated PNG")
    sub.add_argument(
        "--replay",
        default=None,
        metavar="PATH",
        help="measure nothing: simulate the runs of a --json record again with --profile",
    )


# ---- the commands ---------------------------------------------------------------------------


def run_profile(args: argparse.Namespace) -> int:
    # lazy: the engine (torch), which only this command runs
    from splitserve.planner.measure.profiler import load_engine, log_to_stderr, measure_profile

    settings = ProfileSettings(
        num_threads=args.num_threads,
        kv_cache_bytes=_size(parse_size, args.kv_cache_bytes),
        max_num_batched_tokens=args.max_num_batched_tokens,
        model=args.model,
        kv_transport=args.kv_transport,
        repeats=args.repeats,
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        tensor_parallel_size=args.tensor_parallel_size,
        pipeline_parallel_size=args.pipeline_parallel_size,
        neighbor_core=args.neighbor_core,
        **(QUICK_GRID if args.quick else Grid()),
    )
    engine = load_engine(settings, log_to_stderr)
    profile = measure_profile(settings, engine=engine)
    if args.serving:
        # lazy: aiohttp
        from splitserve.planner.measure.pace import EnginePace
        from splitserve.planner.measure.serving import measure_serving

        profile = measure_serving(profile, log_to_stderr, pace=EnginePace(engine))
    profile.save(args.output)
    a, b, c = profile.prefill_coefficients
    print(f"wrote {args.output}: {profile.description}")
    print(f"  prefill s = {a * 1e3:.1f} ms + {b * 1e3:.3f} ms/token + {c * 1e6:.4f} us/token^2")
    grid = profile.decode
    print(
        f"  decode step {grid.seconds[0][0] * 1e3:.1f} ms (batch {grid.batch_sizes[0]}, "
        f"context {grid.context_lens[0]}) .. {grid.seconds[-1][-1] * 1e3:.1f} ms (batch "
        f"{grid.batch_sizes[-1]}, context {grid.context_lens[-1]})"
    )
    print(
        f"  KV: {profile.num_kv_blocks} blocks of {profile.block_size} tokens; transfer "
        f"{profile.kv_transfer.bandwidth_bytes_per_s / 1e9:.2f} GB/s + "
        f"{profile.kv_transfer.latency_s * 1e3:.2f} ms"
    )
    print(f"  engine: {profile.engine.describe()}")
    for topology, costs in profile.serving.items():
        print(
            f"  serving ({topology}): {costs.step_s * 1e3:.1f} ms/step + "
            f"{costs.row_s * 1e3:.2f} ms/row, {costs.request_s * 1e3:.0f} ms/request, "
            f"{costs.token_s * 1e3:.3f} ms/prompt token"
        )
    return 0


def _size(parse, text: str) -> int:
    try:
        return parse(text)
    except argparse.ArgumentTypeError as error:
        raise ValueError(f"--kv-cache-bytes: {error}") from None


def _requests(args: argparse.Namespace, rate: float | None = None):
    if args.trace:
        return load_trace(args.trace)
    return poisson_requests(_workload_spec(args, rate), args.seed)


def _workload_spec(args: argparse.Namespace, rate: float | None = None):
    return WorkloadSpec(
        rate=args.rate if rate is None else rate,
        num_requests=args.num_requests,
        input_lens=LengthDistribution.parse(args.input_lens, "--input-lens"),
        output_lens=LengthDistribution.parse(args.output_lens, "--output-lens"),
        num_prefix_groups=args.prefix_groups,
        prefix_len=args.prefix_len,
    )


def _slo(args: argparse.Namespace):
    return Slo(args.ttft_slo, args.itl_slo)


def _cluster(args: argparse.Namespace, num_prefill: int, num_decode: int):
    return ClusterConfig(
        num_prefill,
        num_decode,
        local_prefill_threshold=args.local_prefill_threshold,
        max_remote_prefill_tokens=args.max_remote_prefill_tokens,
        pods_per_host=args.pods_per_host,
        max_num_batched_tokens=args.max_num_batched_tokens,
        num_kv_blocks=args.kv_blocks,
        speculation=_speculation(args),
        failures=tuple(_failure(text) for text in getattr(args, "decode_failure", [])),
        tier_sizes=_tier_sizes(args),
    )


def _tier_sizes(args: argparse.Namespace):
    return TierSizes(args.host_tier_blocks, args.disk_tier_blocks)


def _failure(text: str):
    try:
        parts = [float(part) for part in text.split(",")]
        if not 1 <= len(parts) <= 3:
            raise ValueError
    except ValueError:
        raise ValueError(f"--decode-failure wants AT_S[,POD[,DETECT_S]], got {text!r}") from None
    at_s, pod, detect_s = (parts + [0.0, 0.0])[:3]
    return PodFailure(at_s, int(pod), detect_s)


def _speculation(args: argparse.Namespace):
    if args.speculative_tokens == 0:
        return None
    return SpeculationModel(args.speculative_tokens, args.acceptance_rate)


def run_simulate(args: argparse.Namespace) -> int:
    profile = load_profile(args.profile).with_margin(args.margin)
    cluster = _cluster(args, args.prefill, args.decode)
    requests = _requests(args)
    started = time.monotonic()
    result = simulate(profile, cluster, requests, _slo(args))
    elapsed = time.monotonic() - started
    print(f"{cluster.label}, {len(requests)} requests ({elapsed:.1f} s to simulate)")
    for name, figures in (("TTFT", result.ttft), ("ITL ", result.itl)):
        print(f"  {name}  p50 {_ms(figures.p50)}  p90 {_ms(figures.p90)}  p99 {_ms(figures.p99)}")
    print(
        f"  throughput {result.request_throughput:.2f} req/s, {result.output_throughput:.1f} "
        f"tok/s; goodput {result.goodput:.2f} req/s ({result.attainment:.0%} meet {_slo(args)})"
    )
    busy = ", ".join(f"{role} {share:.0%}" for role, share in result.utilization.items())
    print(f"  busy: {busy}; preemptions {result.num_preemptions}")
    tiers = ", ".join(f"{t} {n}" for t, n in result.cached_tokens_by_tier.items() if n)
    if tiers:
        print(f"  prompt tokens from cache: {tiers}")
    if result.num_moved:
        print(f"  {result.num_moved} requests moved off a dead decode pod")
    if args.json:
        with open(args.json, "w") as file:
            json.dump(asdict(result), file, indent=2)
    return 0


def run_recommend(args: argparse.Namespace) -> int:
    if args.trace:
        raise ValueError("recommend searches over Poisson rates: use --rate, not --trace")
    profile = load_profile(args.profile).with_margin(args.margin)
    prefill_profile = (
        load_profile(args.prefill_profile).with_margin(args.margin)
        if args.prefill_profile
        else None
    )
    spec = SearchSpec(
        workload=_workload_spec(args),
        slo=_slo(args),
        attainment=args.attainment,
        confidence=args.confidence,
        num_seeds=args.seeds,
        max_pods=args.max_pods,
        ratio_max_pods=args.ratio_max_pods,
        include_colocated=not args.no_colocated,
        seed=args.seed,
        local_prefill_threshold=args.local_prefill_threshold,
        max_remote_prefill_tokens=args.max_remote_prefill_tokens,
        pods_per_host=args.pods_per_host,
        speculation=_speculation(args),
        tier_sizes=_tier_sizes(args),
        remote_prefill_limits=_token_counts(args.remote_prefill_limits, "--remote-prefill-limits"),
        try_admission=args.try_admission,
        slice_pods=args.slice_pods,
        jobs=args.jobs,
    )
    variants = tuple(
        Profiles(load_profile(path).with_margin(args.margin)) for path in args.variant_profile
    )
    started = time.monotonic()
    recommendation = recommend(profile, spec, _progress, prefill_profile, variants)
    elapsed = time.monotonic() - started
    print(format_table(recommendation, spec))
    print(f"(searched in {elapsed:.1f} s)")
    if args.plot:
        plot_goodput_vs_ratio(recommendation, spec, args.plot)
        print(f"\nwrote {args.plot}")
    if recommendation.best is None:
        print(f"\nno configuration of up to {args.max_pods} pods meets the target")
        _print_binding(recommendation)
        return 1
    print("\nHelm values:\n" + helm_values(recommendation.best))
    return 0


def _token_counts(text: str, flag: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise ValueError(f"{flag} must be token counts separated by commas, got {text!r}") from None


def _print_binding(recommendation: Recommendation) -> None:
    """Without a configuration that meets the target, what the largest one runs out of (with
    slices: what the best slice layout would need, or what binds it)."""
    if recommendation.slice_pods:
        best = max(recommendation.ratios, key=lambda p: p.goodput_per_pod)
        if best.max_rate > 0:
            print(f"the best slice layout ({best.label}) holds {best.max_rate:.2f} req/s per "
                  f"{recommendation.slice_pods} pods: the target needs more pods")  # fmt: skip
        else:
            print(f"no slice layout holds any rate; {best.label} binds on {best.binding}")
        return
    if not recommendation.candidates:
        print("no configuration was tried (see --max-pods and --no-colocated)")
        return
    largest = max(recommendation.candidates, key=lambda c: (c.num_devices, c.result.goodput))
    print(f"the largest ({largest.cluster.label}) binds on {largest.verdict.binding}")


def _progress(message: str) -> None:
    print(f"  [plan] {message}", file=sys.stderr, flush=True)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:7.1f} ms"


def run_validate(args: argparse.Namespace) -> int:
    # lazy: the load generator's HTTP client (aiohttp), which the other commands do without
    from splitserve.planner.validate.compare import run_validation

    return run_validation(args)


COMMANDS = {
    "profile": run_profile,
    "simulate": run_simulate,
    "recommend": run_recommend,
    "validate": run_validate,
    "autoscale": run_autoscale,
}


def run_plan(args: argparse.Namespace) -> int:
    """Runs the parsed subcommand; bad input is a one-line error and exit status 2."""
    try:
        return COMMANDS[args.plan_command](args)
    except ValueError as error:
        print(f"splitserve plan {args.plan_command}: error: {error}", file=sys.stderr)
        return 2


def main(argv: list[str] | None = None) -> int:
    return run_plan(build_parser().parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
