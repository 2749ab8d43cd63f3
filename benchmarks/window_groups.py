"""What layer groups (shared/kv/groups.py) cost per decode step and save in KV memory, for Gemma.

    python -m benchmarks.window_groups [--families gemma2 gemma3_text] [--batch 8]
                                       [--prompt 128] [--steps 240] [--threads 2]

For each family, a random checkpoint of SmolLM2-135M's shape with that family's parts
(benchmarks/family_decode.py: 30 layers, 64-token windows) is served by two engines in one
process: one with layer groups (the default) and one in one group (`group_window_layers=False`).
Each takes `--batch` requests of `--prompt` tokens and decodes `--steps` tokens, the two engines
stepping in turn (ABBA) so the machine's noise falls on both alike. Prints each engine's median
ms per decode step and, at the end, the KV bytes the batch holds (blocks held in each group
times a block's bytes): the window layers of the grouped engine hold about their window, the
other engine's every position.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

from benchmarks.family_decode import write_checkpoint
from benchmarks.machine import machine_line
from splitserve import LLM, SamplingParams


def _engine(directory: str, grouped: bool, threads: int) -> LLM:
    return LLM(
        directory,
        num_threads=threads,
        kv_cache_bytes=256 * 2**20,
        group_window_layers=grouped,
        enable_prefix_caching=False,
    )


def _start(llm: LLM, batch: int, prompt_len: int, steps: int) -> list[str]:
    """`batch` requests prefilled (outside the timed steps); their ids."""
    params = SamplingParams(temperature=0.0, max_tokens=steps + 4, ignore_eos=True)
    ids = []
    for i in range(batch):
        prompt = llm.tokenizer.encode(f"Request {i}: " + "a story about the sea. " * 60)
        ids.append(f"r{i}")
        llm.engine.add_request(ids[-1], prompt[:prompt_len], params)
    while any(r.num_output_tokens == 0 for r in llm.engine.scheduler.requests.values()):
        llm.engine.step()
    return ids


def _kv_bytes(llm: LLM, ids: list[str]) -> int:
    """The bytes the requests' KV blocks take now."""
    kv = llm.engine.kv_manager
    block_bytes = llm.engine.kv_spec.bytes_per_block
    return sum(kv.num_held_blocks(rid) for rid in ids) * block_bytes


def compare(directory: str, batch: int, prompt_len: int, steps: int, threads: int) -> dict:
    engines = {grouped: _engine(directory, grouped, threads) for grouped in (True, False)}
    assert engines[True].engine.kv_spec.groups > 1, "this family should take layer groups"
    ids = {grouped: _start(llm, batch, prompt_len, steps) for grouped, llm in engines.items()}
    times: dict[bool, list[float]] = {True: [], False: []}
    for step in range(2 * steps):
        grouped = step % 4 in (0, 3)  # A B B A
        if len(times[grouped]) == steps:
            grouped = not grouped
        start = time.perf_counter()
        engines[grouped].engine.step()
        times[grouped].append(time.perf_counter() - start)
    result = {
        "ms": {g: 1000 * statistics.median(times[g]) for g in (True, False)},
        "kv_bytes": {g: _kv_bytes(engines[g], ids[g]) for g in (True, False)},
        "context": prompt_len + steps,
        "groups": engines[True].engine.kv_spec.groups,
    }
    for llm in engines.values():
        llm.engine.abort_requests(list(llm.engine.scheduler.requests))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--families", nargs="+", default=["gemma2", "gemma3_text"])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--steps", type=int, default=240)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    print(machine_line(), flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for family in args.families:
            print(f"[{family}] writing a random checkpoint of SmolLM2's shape", flush=True)
            directory = write_checkpoint(root, family)
            print(f"[{family}] batch {args.batch}, {args.steps} steps each, ABBA", flush=True)
            rows.append((family, compare(directory, args.batch, args.prompt, args.steps,
                                         args.threads)))  # fmt: skip
    print(f"\n{'family':<12} {'groups':>6} {'context':>7} {'ms grouped':>10} {'ms one':>7} "
          f"{'ratio':>6} {'KV MiB grouped':>14} {'KV MiB one':>10} {'saved':>6}")  # fmt: skip
    for family, r in rows:
        ms, kv = r["ms"], r["kv_bytes"]
        print(f"{family:<12} {r['groups']:>6} {r['context']:>7} {ms[True]:>10.2f} "
              f"{ms[False]:>7.2f} {ms[True] / ms[False]:>5.2f}x {kv[True] / 2**20:>14.2f} "
              f"{kv[False] / 2**20:>10.2f} {kv[False] / kv[True]:>5.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
