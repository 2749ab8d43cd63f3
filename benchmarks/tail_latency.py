"""The ITL tail at 4 and 16 concurrent streams, beside vLLM, with two clients: ours and vLLM's own.

    python -m benchmarks.tail_latency [--force-avx2] [--cap 0 128] [--quick]

Issue 33 found our 1P+1D stack's ITL p99 at 16 streams 1.6-1.8x vLLM's on an AVX2-only machine
(vLLM's `vllm bench serve`, random 256 in / 64 out), while its medians and TTFT were ahead. The
suspect: the decode pod prefills some prompts itself (conditional disaggregation), and a step
that carries a prompt burst stalls every running stream. This program measures vLLM and
`splitserve up` with each `--max-prefill-tokens-while-decoding` cap in `--cap` (0 = none), the
same workload through:

- our client (services/loadgen): `concurrency` closed loops of 256-token prompts, 64 tokens out;
- vLLM's client, `vllm.benchmarks.serve` run in vLLM's own virtual environment
  (benchmarks/peer/vllm_bench.py), `--dataset-name random`, the same lengths and concurrency.

`--force-avx2` runs every process with the AVX2 settings (ATEN_CPU_CAPABILITY=avx2,
ONEDNN_MAX_CPU_ISA=AVX2, SPLITSERVE_CPU_ISA=avx2): torch, oneDNN and our kernels take their AVX2
paths on an AVX-512 machine; vLLM's own C++ kernels pick their ISA when built and are not forced.
The report starts with `splitserve env`'s CPU line, so the figures carry the machine they ran on.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass

from benchmarks.machine import AVX2_ENV, machine_line
from benchmarks.peer.vllm_bench import run_vllm_bench
from benchmarks.peer.vllm_server import SERVED_NAME, VllmServer
from splitserve.loadgen.client import RunResult, Target, run_sequential
from splitserve.loadgen.stacks import RunningStack, SystemSetup
from splitserve.loadgen.stats import Slo, summarize
from splitserve.loadgen.workload import LengthDistribution, WorkloadShape, sequential_workload

KV_CACHE_GIB = 2
PROMPT_TOKENS = 256
OUTPUT_TOKENS = 64
SHAPE = WorkloadShape(
    LengthDistribution(PROMPT_TOKENS, PROMPT_TOKENS),
    LengthDistribution(OUTPUT_TOKENS, OUTPUT_TOKENS),
)
ANY_SLO = Slo(ttft_s=3600.0, itl_s=3600.0)  # summarize needs one; this report prints no goodput


@dataclass(frozen=True)
class TailFigures:
    """One system, one client, one concurrency (milliseconds and tokens/s)."""

    itl_p50_ms: float
    itl_p99_ms: float
    ttft_p50_ms: float
    output_tok_s: float


# ---- systems --------------------------------------------------------------------------------


def system_names(caps: list[int]) -> list[str]:
    return ["vllm"] + [f"splitserve cap {cap}" if cap else "splitserve" for cap in caps]


@contextlib.contextmanager
def serving(name: str) -> Iterator[tuple[str, str]]:
    """(base URL, served model name) of the system while the block runs."""
    if name == "vllm":
        with VllmServer(KV_CACHE_GIB) as server:
            yield server.base_url, SERVED_NAME
        return
    flags = ["--kv-cache-bytes", f"{KV_CACHE_GIB}GiB", "--log-level", "warning"]
    if name.startswith("splitserve cap "):
        flags += ["--max-prefill-tokens-while-decoding", name.rsplit(" ", 1)[1]]
    with RunningStack(SystemSetup(name, flags)) as stack:
        yield stack.base_url, stack.model_name()


# ---- clients --------------------------------------------------------------------------------


def our_client(
    base_url: str, model: str, concurrency: int, num_each: int, seed: str
) -> TailFigures:
    target = Target(f"{base_url}/v1/completions", model)

    async def loops() -> RunResult:
        workloads = [
            sequential_workload(f"{seed}-{concurrency}-{i}", num_each, SHAPE)
            for i in range(concurrency)
        ]
        start = time.perf_counter()
        runs = await asyncio.gather(*(run_sequential(target, specs) for specs in workloads))
        return RunResult([r for run in runs for r in run.results], time.perf_counter() - start)

    summary = summarize(asyncio.run(loops()), ANY_SLO)
    if summary.num_failed:
        print(f"    ({summary.num_failed} requests failed; left out)", flush=True)
    return TailFigures(
        summary.itl.p50 * 1e3,
        summary.itl.p99 * 1e3,
        summary.ttft.p50 * 1e3,
        summary.output_throughput,
    )


def vllm_client(base_url: str, model: str, concurrency: int, num_prompts: int) -> TailFigures:
    """vLLM's `bench serve` against `base_url`, in vLLM's environment; its saved JSON read back."""
    args = ["--dataset-name", "random", "--random-input-len", str(PROMPT_TOKENS)]
    args += ["--random-output-len", str(OUTPUT_TOKENS), "--num-prompts", str(num_prompts)]
    args += ["--ignore-eos", "--max-concurrency", str(concurrency)]
    args += ["--percentile-metrics", "ttft,itl", "--metric-percentiles", "50,99"]
    args += ["--seed", str(int(time.time()))]
    result = run_vllm_bench(base_url, model, args)
    return TailFigures(
        result["p50_itl_ms"],
        result["p99_itl_ms"],
        result["p50_ttft_ms"],
        result["output_throughput"],
    )


# ---- the run --------------------------------------------------------------------------------


def measure(
    name: str, concurrencies: list[int], num_each: int
) -> dict[tuple[str, int], TailFigures]:
    figures = {}
    with serving(name) as (base_url, model):
        print(f"[{name}] warming up", flush=True)
        our_client(base_url, model, 2, 2, f"{name}-warm")
        for concurrency in concurrencies:
            print(f"[{name}] {concurrency} streams, our client", flush=True)
            seed = f"{name}-{time.time_ns()}"
            figures[("ours", concurrency)] = our_client(
                base_url, model, concurrency, num_each, seed
            )
            print(f"[{name}] {concurrency} streams, vLLM's client", flush=True)
            num_prompts = concurrency * num_each
            figures[("vllm's", concurrency)] = vllm_client(
                base_url, model, concurrency, num_prompts
            )
    return figures


def print_report(results: dict[str, dict[tuple[str, int], TailFigures]]) -> None:
    names = list(results)
    print("\nITL p50 / p99, TTFT p50 (ms), output tok/s; ratios against vLLM in the same run")
    header = f"{'client':>7} {'streams':>7} {'system':>20} {'ITL p50':>8} {'ITL p99':>8}"
    header += f" {'TTFT p50':>9} {'tok/s':>7} {'p50/vllm':>9} {'p99/vllm':>9} {'tok/s/vllm':>11}"
    print(header)
    for key in results[names[0]]:
        peer = results["vllm"][key] if "vllm" in results else None
        for name in names:
            f = results[name][key]
            row = f"{key[0]:>7} {key[1]:>7} {name:>20} {f.itl_p50_ms:8.1f} {f.itl_p99_ms:8.1f}"
            row += f" {f.ttft_p50_ms:9.0f} {f.output_tok_s:7.1f}"
            if peer is not None and name != "vllm":
                row += (
                    f" {f.itl_p50_ms / peer.itl_p50_ms:9.2f} {f.itl_p99_ms / peer.itl_p99_ms:9.2f}"
                )
                row += f" {f.output_tok_s / peer.output_tok_s:11.2f}"
            print(row)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--force-avx2", action="store_true")
    parser.add_argument("--cap", type=int, nargs="+", default=[0, 128], help="0 = no cap")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[4, 16])
    parser.add_argument("--requests-per-stream", type=int, default=4)
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--quick", action="store_true", help="16 streams, 2 requests each")
    args = parser.parse_args(argv)
    if args.quick:
        args.concurrency, args.requests_per_stream = [16], 2
    if args.force_avx2:
        os.environ.update(AVX2_ENV)  # every process started below inherits it
    print(machine_line(), flush=True)
    names = system_names(args.cap)
    if args.skip_vllm:
        names.remove("vllm")
    results = {name: measure(name, args.concurrency, args.requests_per_stream) for name in names}
    print_report(results)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
