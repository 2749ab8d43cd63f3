"""Checks that the engine on a GPU (Triton attention) generates what the CPU engine generates.

    python -m benchmarks.gpu_engine_check

Runs SmolLM2-135M-Instruct in float32 on the parity prompts of tests/test_engine_parity.py
(eight prompts, one over 600 tokens): first on the CPU with PyTorch attention, the reference
that test holds against transformers, then on CUDA, where `select_attention_backend` picks the
Triton kernels, under three schedules: one batch, a second pass served from the prefix cache,
and 32-token prefill chunks. Greedy tokens must be equal, token for token.

Prints one line per run with its wall time. Exit status: 0 all equal, 1 a mismatch, 2 it
cannot run here (no CUDA device, or TRITON_INTERPRET=1, which would run the kernels on the host).
"""

from __future__ import annotations

import os
import sys
import time

import torch

from splitserve import LLM, SamplingParams
from tests.test_engine_parity import MAX_TOKENS, _prompts

KV_CACHE_BYTES = 256 * 2**20
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
CHUNKED = dict(max_num_batched_tokens=64, long_prefill_token_threshold=32)


def main() -> int:
    reason = _why_it_cannot_run()
    if reason is not None:
        print(f"gpu_engine_check: {reason}", file=sys.stderr)
        return 2
    cpu = LLM(kv_cache_bytes=KV_CACHE_BYTES)
    prompts = _prompts(cpu.tokenizer)
    expected = _timed_greedy("cpu reference", cpu, prompts)
    del cpu
    failures = 0
    gpu = _gpu_llm()
    print(f"gpu attention backend: {type(gpu.engine.runner.backend).__name__}")
    failures += _check("gpu, one batch", gpu, prompts, expected)
    failures += _check("gpu, second pass from the prefix cache", gpu, prompts, expected)
    hits = gpu.stats().prefix_cache_hit_tokens
    print(f"  prefix-cache hit tokens so far: {hits}")
    if hits == 0:
        print("  MISMATCH: the second pass was meant to be served from the prefix cache")
        failures += 1
    del gpu
    chunked = _gpu_llm(enable_prefix_caching=False, **CHUNKED)
    failures += _check("gpu, 32-token prefill chunks", chunked, prompts, expected)
    print("all runs match the CPU engine" if not failures else f"{failures} run(s) differ")
    return 1 if failures else 0


def _why_it_cannot_run() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device found; this check compares the GPU engine with the CPU engine"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "TRITON_INTERPRET=1 would run the kernels on the host; unset it for a GPU run"
    return None


def _gpu_llm(**options: object) -> LLM:
    return LLM(kv_cache_bytes=KV_CACHE_BYTES, device="cuda", dtype="float32", **options)


def _timed_greedy(label: str, llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    start = time.perf_counter()
    token_ids = [result.outputs[0].token_ids for result in llm.generate(prompts, GREEDY)]
    print(f"{label}: {time.perf_counter() - start:.2f} s")
    return token_ids


def _check(label: str, llm: LLM, prompts: list[list[int]], expected: list[list[int]]) -> int:
    """Prints the first differing token of each prompt that differs; returns 1 if any did."""
    actual = _timed_greedy(label, llm, prompts)
    failed = 0
    for i, (got, want) in enumerate(zip(actual, expected)):
        if got != want:
            at = _first_difference(got, want)
            print(
                f"  MISMATCH prompt {i} ({len(prompts[i])} tokens) from output token {at}: "
                f"gpu {got[at : at + 5]} cpu {want[at : at + 5]}"
            )
            failed = 1
    return failed


def _first_difference(got: list[int], want: list[int]) -> int:
    for index, (a, b) in enumerate(zip(got, want)):
        if a != b:
            return index
    return min(len(got), len(want))  # one is a prefix of the other


if __name__ == "__main__":
    sys.exit(main())
