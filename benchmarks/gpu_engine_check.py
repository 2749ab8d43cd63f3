"""Checks that the engine on a GPU (Triton attention) generates what the CPU engine generates.

    python -m benchmarks.gpu_engine_check [--json PATH] [--smoke]

Runs SmolLM2-135M-Instruct in float32 on the parity prompts (benchmarks/parity_prompts.py:
eight prompts, one over 600 tokens): first on the CPU with PyTorch attention, the reference
that tests/test_engine_parity.py holds against transformers, then on CUDA, where
`select_attention_backend` picks the Triton kernels, under five schedules: one batch, a second
pass served from the prefix cache, 32-token prefill chunks, and async scheduling (the next step
launched before the last one's tokens are read) with CUDA graphs and with prefill chunks. Greedy
tokens must be equal, token for token.

`--smoke` runs every line on the CPU instead (the "device" engine is a second CPU engine, two
short prompts, four tokens each), so a wrong call fails here and not in a scarce GPU session.

Prints one line per run with its wall time; `--json` also writes each run's verdict and time.
Exit status: 0 all equal, 1 a mismatch, 2 it cannot run here (no CUDA device, or
TRITON_INTERPRET=1, which would run the kernels on the host).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict, dataclass

import torch

from benchmarks.parity_prompts import PARITY_MAX_TOKENS, parity_prompts
from splitserve import LLM, SamplingParams

KV_CACHE_BYTES = 256 * 2**20
CHUNKED = dict(max_num_batched_tokens=64, long_prefill_token_threshold=32)


@dataclass(frozen=True)
class CheckPlan:
    """What one run of the check compares: where the engine under test runs, on what."""

    device: str
    num_prompts: int  # the first ones of the parity prompts
    max_tokens: int


FULL = CheckPlan(device="cuda", num_prompts=8, max_tokens=PARITY_MAX_TOKENS)
SMOKE = CheckPlan(device="cpu", num_prompts=2, max_tokens=4)


@dataclass(frozen=True)
class RunResult:
    label: str
    seconds: float
    is_ok: bool
    mismatched_prompts: list[int]  # indices of the prompts whose tokens differ


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.gpu_engine_check")
    parser.add_argument("--json", default="", help="also write each run's verdict here")
    parser.add_argument("--smoke", action="store_true", help="every step on the CPU, tiny")
    args = parser.parse_args(argv)
    plan = SMOKE if args.smoke else FULL
    reason = None if args.smoke else _why_it_cannot_run()
    if reason is not None:
        print(f"gpu_engine_check: {reason}", file=sys.stderr)
        return 2
    results = run_check(plan)
    failures = sum(1 for result in results if not result.is_ok)
    print("all runs match the CPU engine" if not failures else f"{failures} run(s) differ")
    if args.json:
        _write_record(args.json, plan, results)
    return 1 if failures else 0


def run_check(plan: CheckPlan) -> list[RunResult]:
    """The CPU reference, then the engine under test under each schedule."""
    greedy = SamplingParams(temperature=0.0, max_tokens=plan.max_tokens)
    cpu = LLM(kv_cache_bytes=KV_CACHE_BYTES)
    prompts = parity_prompts(cpu.tokenizer)[: plan.num_prompts]
    expected, _ = _timed_greedy("cpu reference", cpu, prompts, greedy)
    del cpu
    results = []
    engine = _engine(plan)
    print(f"attention backend under test: {type(engine.engine.runner.backend).__name__}")
    results.append(_check("one batch", engine, prompts, greedy, expected))
    results.append(_check("second pass from the prefix cache", engine, prompts, greedy, expected))
    results.append(_prefix_cache_was_hit(engine))
    del engine
    chunked = _engine(plan, enable_prefix_caching=False, **CHUNKED)
    results.append(_check("32-token prefill chunks", chunked, prompts, greedy, expected))
    del chunked
    results += _check_async_scheduling(plan, prompts, greedy, expected)
    return results


def _check_async_scheduling(
    plan: CheckPlan, prompts: list[list[int]], greedy: SamplingParams, expected: list[list[int]]
) -> list[RunResult]:
    """The same tokens with the next step launched before the last one's are read: with CUDA
    graphs where there is CUDA, and with prefill chunks beside decodes."""
    graphs = {"cuda_graphs": True} if plan.device.startswith("cuda") else {}
    overlapped = _engine(plan, async_scheduling=True, **graphs)
    label = "async scheduling" + (" with CUDA graphs" if graphs else "") + ", one batch"
    results = [_check(label, overlapped, prompts, greedy, expected)]
    del overlapped
    chunked = _engine(plan, async_scheduling=True, enable_prefix_caching=False, **CHUNKED)
    results.append(
        _check("async scheduling, 32-token prefill chunks", chunked, prompts, greedy, expected)
    )
    return results


def _why_it_cannot_run() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device found; this check compares the GPU engine with the CPU engine"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "TRITON_INTERPRET=1 would run the kernels on the host; unset it for a GPU run"
    return None


def _engine(plan: CheckPlan, **options: object) -> LLM:
    return LLM(kv_cache_bytes=KV_CACHE_BYTES, device=plan.device, dtype="float32", **options)


def _timed_greedy(
    label: str, llm: LLM, prompts: list[list[int]], greedy: SamplingParams
) -> tuple[list[list[int]], float]:
    start = time.perf_counter()
    token_ids = [result.outputs[0].token_ids for result in llm.generate(prompts, greedy)]
    seconds = time.perf_counter() - start
    print(f"{label}: {seconds:.2f} s")
    return token_ids, seconds


def _check(
    label: str,
    llm: LLM,
    prompts: list[list[int]],
    greedy: SamplingParams,
    expected: list[list[int]],
) -> RunResult:
    """Prints the first differing token of each prompt that differs."""
    actual, seconds = _timed_greedy(label, llm, prompts, greedy)
    mismatched = []
    for i, (got, want) in enumerate(zip(actual, expected)):
        if got != want:
            at = _first_difference(got, want)
            print(
                f"  MISMATCH prompt {i} ({len(prompts[i])} tokens) from output token {at}: "
                f"got {got[at : at + 5]} cpu {want[at : at + 5]}"
            )
            mismatched.append(i)
    return RunResult(label, seconds, not mismatched, mismatched)


def _prefix_cache_was_hit(llm: LLM) -> RunResult:
    """The second pass was meant to be served from the prefix cache; a failure if it was not."""
    hits = llm.stats().prefix_cache_hit_tokens
    print(f"  prefix-cache hit tokens so far: {hits}")
    if hits == 0:
        print("  MISMATCH: the second pass was meant to be served from the prefix cache")
    return RunResult("prefix cache hit", 0.0, hits > 0, [])


def _first_difference(got: list[int], want: list[int]) -> int:
    for index, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return index
    return min(len(got), len(want))  # one is a prefix of the other


def _write_record(path: str, plan: CheckPlan, results: list[RunResult]) -> None:
    record = {
        "plan": asdict(plan),
        "runs": [asdict(result) for result in results],
        "all_equal": all(result.is_ok for result in results),
    }
    with open(path, "w") as f:
        json.dump(record, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
