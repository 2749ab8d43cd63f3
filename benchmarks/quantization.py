"""`python -m benchmarks.quantization`: weight-only quantization side by side, beside llama.cpp.

    python -m benchmarks.quantization [--quick] [--threads N] [--skip-llamacpp] [--force-avx2]
                                      [--alternate ROUNDS]

For quantization none (float32) / int8 / int4 / gguf on the shipped SmolLM2-135M Q4_1 GGUF:

a. batch-1 decode tokens/s (a 32-token prompt, then --decode-tokens tokens, EOS ignored);
b. output tokens/s of 64 seeded requests (prompts 32-512, outputs 16-256; continuous batching);
c. TTFT of a cold 1024-token prompt;
d. resident weight MiB (every weight tensor the model keeps, oneDNN's reordered copies too);

and, unless --skip-kv, kv_cache_dtype auto against int8 on the float32 weights
(benchmarks/kv_cache_dtype.py): e. KV tokens that fit the same budget, f. batch-1 decode,
g. the same requests' output tokens/s.

Beside them llama.cpp through llama-cpp-python on the same file and threads, in its own
virtual environment (benchmarks/peer/llamacpp_venv.py builds it; it compiles llama.cpp, tens
of minutes the first time), one sequence at a time as its `Llama` serves them. The four
engines stay loaded and each measure runs on all of them back to back, so load that comes and
goes on a shared machine falls on all alike; llama.cpp runs after ours, in a subprocess.
Ratios against float32 and against llama.cpp come in the same table. Progress on stderr.

`--force-avx2` runs ours on the AVX2 paths (benchmarks/machine.py's AVX2_ENV, set before torch
loads: the program starts itself again with it) and llama.cpp built for AVX2-only CPUs
(`python -m benchmarks.peer.llamacpp_venv --avx2`); the machine line and llama.cpp's own
feature list are printed with the table.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass

import torch

from benchmarks.engine import (
    batch1_prompt,
    log,
    make_workload,
    our_batch1_tokens_per_s,
    our_continuous_tokens_per_s,
    our_ttfts,
)
from benchmarks.kv_cache_dtype import load_int8_kv_engine, measure_kv, print_kv_table
from benchmarks.machine import AVX2_ENV, machine_line
from splitserve import LLM
from splitserve.engine.model.quantization import weight_nbytes
from splitserve.engine.model_paths import default_model_path

METHODS = ("none", "int8", "int4", "gguf")
MEASURES = {
    "batch1": "a. batch-1 decode tokens/s",
    "continuous": "b. {n}-request output tokens/s",
    "ttft_1024": "c. TTFT 1024-token prompt (s)",
    "weight_mib": "d. resident weight MiB",
}


@dataclass(frozen=True)
class Sizes:
    num_requests: int
    decode_tokens: int

    @classmethod
    def chosen(cls, quick: bool, num_requests: int, decode_tokens: int) -> Sizes:
        return cls(8, 32) if quick else cls(num_requests, decode_tokens)


KV_CACHE_BYTES = 2 * 2**30  # every engine's KV budget


def load_engines(threads: int) -> dict[str, LLM]:
    engines = {}
    for method in METHODS:
        log(f"loading quantization={method}")
        engines[method] = LLM(
            quantization=method, num_threads=threads, kv_cache_bytes=KV_CACHE_BYTES
        )
    return engines


def measure_ours(engines: dict[str, LLM], seed: int, sizes: Sizes) -> dict[str, dict[str, float]]:
    """method -> measure -> value; each measure on every engine before the next measure."""
    figures: dict[str, dict[str, float]] = {m: {} for m in engines}
    short_prompt = batch1_prompt(seed)
    for method, llm in engines.items():
        figures[method]["weight_mib"] = weight_nbytes(llm.engine.runner.model) / 2**20
    for method, llm in engines.items():
        log(f"a. batch-1 decode, {method}")
        figures[method]["batch1"] = our_batch1_tokens_per_s(llm, short_prompt, sizes.decode_tokens)
    for method, llm in engines.items():
        log(f"b. {sizes.num_requests} requests, {method}")
        work = make_workload(seed, sizes.num_requests)
        figures[method]["continuous"] = our_continuous_tokens_per_s(llm, work)
    for method, llm in engines.items():
        log(f"c. TTFT 1024 tokens, {method}")
        figures[method]["ttft_1024"] = our_ttfts(llm, seed)[0]
    return figures


def measure_llamacpp(
    threads: int, seed: int, sizes: Sizes, avx2: bool = False
) -> dict[str, float] | None:
    from benchmarks.peer.llamacpp_venv import ensure_llamacpp_venv

    try:
        python = ensure_llamacpp_venv(avx2=avx2)
    except (subprocess.CalledProcessError, RuntimeError) as error:
        log(f"llama.cpp: no environment ({error}); its column stays empty")
        return None
    log("llama.cpp: a, b, c (with warm-up runs)")
    argv = [str(python), "-m", "benchmarks.peer.llamacpp_offline", default_model_path()]
    argv += [str(threads), str(seed), str(sizes.num_requests), str(sizes.decode_tokens)]
    done = subprocess.run(argv, check=True, capture_output=True, text=True)
    line = [text for text in done.stdout.splitlines() if text.startswith('{"batch1"')][-1]
    figures = json.loads(line)
    figures["weight_mib"] = figures.pop("weight_bytes") / 2**20
    print(f"llama.cpp system info: {figures.pop('system_info', '?')}", flush=True)
    return figures


def alternate_batch1(threads: int, seed: int, sizes: Sizes, avx2: bool, rounds: int) -> None:
    """Batch-1 decode of int4, gguf and llama.cpp in turn, `rounds` times, each loaded once
    (llama.cpp in its own process, waiting between its runs): on a machine whose speed drifts
    from minute to minute, figures taken seconds apart compare where a table's columns, taken
    minutes apart, may not. Prints each round and the medians."""
    from benchmarks.peer.llamacpp_venv import ensure_llamacpp_venv

    python = ensure_llamacpp_venv(avx2=avx2)
    engines = {
        m: LLM(quantization=m, num_threads=threads, kv_cache_bytes=2**30) for m in ("int4", "gguf")
    }
    argv = [str(python), "-m", "benchmarks.peer.llamacpp_offline", default_model_path()]
    argv += [str(threads), str(seed), str(sizes.num_requests), str(sizes.decode_tokens), "--rounds"]
    peer = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert peer.stdin is not None and peer.stdout is not None
    json.loads(peer.stdout.readline())  # {"ready": true}: loaded and warmed up
    short_prompt = batch1_prompt(seed)
    figures: dict[str, list[float]] = {"int4": [], "gguf": [], "llama.cpp": []}
    print(f"\nbatch-1 decode tokens/s, {rounds} alternating rounds ({sizes.decode_tokens} tokens)")
    try:
        for round_index in range(rounds):
            for method, llm in engines.items():
                figures[method].append(
                    our_batch1_tokens_per_s(llm, short_prompt, sizes.decode_tokens)
                )
            peer.stdin.write("batch1\n")
            peer.stdin.flush()
            figures["llama.cpp"].append(json.loads(peer.stdout.readline())["batch1"])
            cells = "  ".join(f"{name} {values[-1]:.1f}" for name, values in figures.items())
            print(f"round {round_index + 1}: {cells}", flush=True)
    finally:
        peer.stdin.close()
        peer.wait()
    medians = {name: statistics.median(values) for name, values in figures.items()}
    ratios = {m: [o / p for o, p in zip(figures[m], figures["llama.cpp"])] for m in engines}
    for method in engines:
        print(
            f"{method}: median {medians[method]:.1f} against llama.cpp's "
            f"{medians['llama.cpp']:.1f}: {medians[method] / medians['llama.cpp']:.2f}x "
            f"(rounds {min(ratios[method]):.2f}-{max(ratios[method]):.2f}x)"
        )


def print_table(ours: dict[str, dict[str, float]], peer: dict[str, float] | None, n: int) -> None:
    columns = [*METHODS, "llama.cpp"]
    print(f"\n{'measure':<34}" + "".join(f"{c:>11}" for c in columns))
    for key, name in MEASURES.items():
        values = [ours[m][key] for m in METHODS] + [peer[key] if peer else float("nan")]
        print(f"{name.format(n=n):<34}" + "".join(f"{v:>11.3f}" for v in values))
    print("\nratios (> 1: better than the reference; memory and TTFT: reference / ours)")
    for reference in ("none", "llama.cpp"):
        if reference == "llama.cpp" and peer is None:
            continue
        base = ours["none"] if reference == "none" else peer
        for key, name in MEASURES.items():
            cells = [_ratio(key, ours[m][key], base[key]) for m in METHODS]
            label = f"{name.format(n=n)} vs {reference}"
            print(f"{label:<47}" + "".join(f"{c:>9.2f}x" for c in cells))


def _ratio(key: str, ours: float, base: float) -> float:
    lower_is_better = key in ("ttft_1024", "weight_mib")
    return base / ours if lower_is_better else ours / base


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="8 requests, 32 decode tokens")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--skip-llamacpp", action="store_true")
    parser.add_argument("--skip-kv", action="store_true", help="no KV auto vs int8 table")
    parser.add_argument("--kv-only", action="store_true", help="only the KV auto vs int8 table")
    parser.add_argument("--force-avx2", action="store_true", help="AVX2 paths, ours and peer's")
    parser.add_argument(
        "--alternate",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="then batch-1 decode of int4, gguf and llama.cpp in turn, ROUNDS times",
    )
    args = parser.parse_args(argv)
    if args.force_avx2 and os.environ.get("ATEN_CPU_CAPABILITY") != "avx2":
        # torch reads its dispatch at import: start again with the AVX2 settings.
        argv = sys.argv[1:] if argv is None else argv
        command = [sys.executable, "-m", "benchmarks.quantization", *argv]
        os.execve(sys.executable, command, {**os.environ, **AVX2_ENV})
    print(machine_line(), flush=True)
    sizes = Sizes.chosen(args.quick, args.requests, args.decode_tokens)
    torch.set_num_threads(args.threads)
    if args.kv_only:
        return run_kv_only(args, sizes)
    engines = load_engines(args.threads)
    ours = measure_ours(engines, args.seed, sizes)
    kv = None
    if not args.skip_kv:
        kv_engines = {"auto": engines["none"]}
        kv_engines["int8"] = load_int8_kv_engine(args.threads, KV_CACHE_BYTES)
        kv = measure_kv(kv_engines, args.seed, sizes.num_requests, sizes.decode_tokens)
        del kv_engines
    del engines
    gc.collect()  # llama.cpp runs in the memory our engines held
    peer = None
    if not args.skip_llamacpp:
        peer = measure_llamacpp(args.threads, args.seed, sizes, args.force_avx2)
    print(f"torch {torch.__version__}, {args.threads} threads, {default_model_path()}")
    print_table(ours, peer, sizes.num_requests)
    if kv is not None:
        print_kv_table(kv, KV_CACHE_BYTES, sizes.num_requests)
    if args.alternate and not args.skip_llamacpp:
        alternate_batch1(args.threads, args.seed, sizes, args.force_avx2, args.alternate)
    return 0


def run_kv_only(args: argparse.Namespace, sizes: Sizes) -> int:
    """The KV table alone (the weights table and llama.cpp take most of the run's time)."""
    log("loading quantization=none")
    kv_engines = {"auto": LLM(num_threads=args.threads, kv_cache_bytes=KV_CACHE_BYTES)}
    kv_engines["int8"] = load_int8_kv_engine(args.threads, KV_CACHE_BYTES)
    kv = measure_kv(kv_engines, args.seed, sizes.num_requests, sizes.decode_tokens)
    print(f"torch {torch.__version__}, {args.threads} threads, {default_model_path()}")
    print_kv_table(kv, KV_CACHE_BYTES, sizes.num_requests)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
