"""KV cache auto vs int8 for `python -m benchmarks.quantization` (docs/quantization.md):

e. KV tokens that fit one budget (the engines' own sizing: blocks x block size);
f. batch-1 decode tokens/s (the same 32-token prompt and output length as measure a);
g. output tokens/s of the same seeded requests as measure b.

Both engines hold float32 weights (quantization none) and the same KV budget, so the columns
differ only in how keys and values are stored; int8 is the KV auto engine of the main table's
"none" column plus one more engine. Measures alternate between the two, as the main table's do.
"""

from __future__ import annotations

from benchmarks.engine import (
    batch1_prompt,
    log,
    make_workload,
    our_batch1_tokens_per_s,
    our_continuous_tokens_per_s,
)
from splitserve import LLM

KV_DTYPES = ("auto", "int8")
KV_MEASURES = {
    "kv_tokens": "e. KV tokens at {budget} MiB",
    "batch1": "f. batch-1 decode tokens/s",
    "continuous": "g. {n}-request output tokens/s",
}


def load_int8_kv_engine(threads: int, kv_cache_bytes: int) -> LLM:
    log("loading quantization=none, kv_cache_dtype=int8")
    return LLM(num_threads=threads, kv_cache_bytes=kv_cache_bytes, kv_cache_dtype="int8")


def measure_kv(
    engines: dict[str, LLM], seed: int, num_requests: int, decode_tokens: int
) -> dict[str, dict[str, float]]:
    """kv_cache_dtype -> measure -> value, for engines {"auto": ..., "int8": ...}."""
    figures: dict[str, dict[str, float]] = {kv: {} for kv in engines}
    prompt = batch1_prompt(seed)
    for kv, llm in engines.items():
        figures[kv]["kv_tokens"] = llm.engine.kv_spec.num_tokens
    for kv, llm in engines.items():
        log(f"f. batch-1 decode, kv_cache_dtype {kv}")
        figures[kv]["batch1"] = our_batch1_tokens_per_s(llm, prompt, decode_tokens)
    for kv, llm in engines.items():
        log(f"g. {num_requests} requests, kv_cache_dtype {kv}")
        work = make_workload(seed, num_requests)
        figures[kv]["continuous"] = our_continuous_tokens_per_s(llm, work)
    return figures


def print_kv_table(figures: dict[str, dict[str, float]], budget_bytes: int, n: int) -> None:
    print(f"\nKV cache (float32 weights)  {'auto':>11}{'int8':>11}{'int8/auto':>11}")
    for key, name in KV_MEASURES.items():
        auto, int8 = figures["auto"][key], figures["int8"][key]
        label = name.format(budget=budget_bytes // 2**20, n=n)
        print(f"{label:<28}{auto:>11.3f}{int8:>11.3f}{int8 / auto:>10.2f}x")
