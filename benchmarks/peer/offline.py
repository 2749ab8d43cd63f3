"""`make bench-engine`'s three offline measures, splitserve's engine beside vLLM's `LLM`.

    python -m benchmarks.peer.offline [--seed 0] [--requests 64] [--decode-tokens 128]

a. batch-1 decode tokens/s; b. output tokens/s of 64 seeded requests (prompts 32-512, outputs
16-256, continuous batching on both sides); c. TTFT of a cold 1024-token prompt. Ours runs in
this process, vLLM's in its own virtual environment right after, on the same float32 weights.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess

from benchmarks.engine import (
    batch1_prompt,
    log,
    make_workload,
    our_batch1_tokens_per_s,
    our_continuous_tokens_per_s,
    our_ttfts,
)
from benchmarks.peer.hf_export import ensure_hf_export
from benchmarks.peer.vllm_venv import ensure_vllm_venv
from splitserve import LLM

NAMES = {
    "batch1": "a. batch-1 decode tokens/s",
    "continuous": "b. {n}-request output tokens/s",
    "ttft_1024": "c. TTFT 1024-token prompt (s)",
}


def ours(seed: int, num_requests: int, decode_tokens: int) -> dict[str, float]:
    threads = os.cpu_count() or 1
    llm = LLM(num_threads=threads, kv_cache_bytes=2 * 2**30)
    log("ours: a, b, c")
    short_prompt = batch1_prompt(seed)
    batch1 = our_batch1_tokens_per_s(llm, short_prompt, decode_tokens)
    continuous = our_continuous_tokens_per_s(llm, make_workload(seed, num_requests))
    cold, _ = our_ttfts(llm, seed)
    return {"batch1": batch1, "continuous": continuous, "ttft_1024": cold}  # llm freed here


def vllm(seed: int, num_requests: int, decode_tokens: int) -> dict[str, float]:
    python, model_dir = ensure_vllm_venv(), ensure_hf_export()
    log("vLLM: a, b, c (with warm-up runs)")
    argv = [str(python), "-m", "benchmarks.peer.vllm_offline", str(model_dir)]
    argv += [str(seed), str(num_requests), str(decode_tokens)]
    # The same 2 GiB KV budget as ours (vLLM would otherwise take most of the free memory).
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "2"}
    done = subprocess.run(argv, check=True, capture_output=True, text=True, env=env)
    # vLLM logs to stdout too: the figures are the one JSON line.
    figures = [line for line in done.stdout.splitlines() if line.startswith('{"batch1"')]
    return json.loads(figures[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--decode-tokens", type=int, default=128)
    args = parser.parse_args(argv)
    mine = ours(args.seed, args.requests, args.decode_tokens)
    theirs = vllm(args.seed, args.requests, args.decode_tokens)
    print(f"{'measure':<38}{'splitserve':>12}{'vLLM':>10}{'ratio':>9}")
    for key, name in NAMES.items():
        # Throughputs: ours / theirs; times: theirs / ours. Either way, > 1 means we are faster.
        ratio = theirs[key] / mine[key] if key == "ttft_1024" else mine[key] / theirs[key]
        label = name.format(n=args.requests)
        print(f"{label:<38}{mine[key]:>12.3f}{theirs[key]:>10.3f}{ratio:>8.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
