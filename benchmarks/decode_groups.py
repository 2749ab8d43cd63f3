"""Decode steps with the CPU attention grouped by context length, beside one padded group.

    python -m benchmarks.decode_groups [--requests 64] [--rounds 3] [--steps 8]

Loads SmolLM2, admits `--requests` seeded prompts of 32-512 tokens, steps the engine until every
one is decoding, then times decode steps in alternating rounds: with `group_decodes` (what the
engine runs) and with every decode in one group padded to the longest context (how the engine
grouped them before; both gather heads first, so this isolates the grouping). Prints per-round
step and attention times (ms) and the ratio of medians.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

import torch

import splitserve.engine.runner as runner_module
from splitserve import LLM, SamplingParams
from splitserve.engine.model.attention import TorchPagedAttention
from splitserve.engine.model.decode_groups import DecodeGroup, group_decodes, whole_batch_group

# 64 prompts of up to 512 tokens prefill in a few dozen steps of the default token budget.
MAX_PREFILL_STEPS = 2000


def log(message: str) -> None:
    print(f"[decode_groups {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def one_padded_group(
    seq_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    block_bytes: int,
    device: torch.device,
) -> list[DecodeGroup]:
    """The peer: every decode row in one group (`block_bytes` is unused: no size bound)."""
    if not seq_lens:
        return []
    return [whole_batch_group(seq_lens, block_tables, block_size, device)]


class AttentionTimer:
    """Adds up the wall time of TorchPagedAttention._decode while installed."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self._original = TorchPagedAttention._decode

    def install(self) -> None:
        original, timer = self._original, self

        def timed(backend, *args, **kwargs):
            start = time.perf_counter()
            try:
                return original(backend, *args, **kwargs)
            finally:
                timer.seconds += time.perf_counter() - start

        TorchPagedAttention._decode = timed


def admit_until_decoding(llm: LLM, num_requests: int, seed: int) -> None:
    rng = random.Random(seed)
    params = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)
    for i in range(num_requests):
        prompt = [rng.randrange(1000, 40000) for _ in range(rng.randint(32, 512))]
        llm.engine.add_request(f"bench-{i}", prompt, params, 0, 0)
    scheduler = llm.engine.scheduler
    for _ in range(MAX_PREFILL_STEPS):
        if len(scheduler.running) == num_requests and all(
            r.num_computed_tokens >= len(r.prompt_token_ids) for r in scheduler.running
        ):
            return
        llm.engine.step()
    raise SystemExit(
        f"{num_requests} requests were not all decoding after {MAX_PREFILL_STEPS} steps: "
        "more than the engine runs at once (max_num_seqs) or than its KV cache holds"
    )


def time_steps(llm: LLM, timer: AttentionTimer, num_steps: int) -> tuple[float, float]:
    """(ms per step, ms of decode attention per step)."""
    llm.engine.step()  # the first step after a switch is not counted
    timer.seconds = 0.0
    start = time.perf_counter()
    for _ in range(num_steps):
        llm.engine.step()
    elapsed = time.perf_counter() - start
    return 1000 * elapsed / num_steps, 1000 * timer.seconds / num_steps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    log("loading SmolLM2")
    llm = LLM(kv_cache_bytes=2 * 2**30)
    log(f"prefilling {args.requests} prompts")
    admit_until_decoding(llm, args.requests, args.seed)
    timer = AttentionTimer()
    timer.install()
    variants = {"grouped": group_decodes, "one padded group": one_padded_group}
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}
    for round_index in range(args.rounds):
        for name, grouping in variants.items():
            runner_module.group_decodes = grouping
            results[name].append(time_steps(llm, timer, args.steps))
            log(f"round {round_index + 1}/{args.rounds} {name}: {results[name][-1][0]:.0f} ms")
    runner_module.group_decodes = group_decodes
    print_table(results, args.requests)
    return 0


def print_table(results: dict[str, list[tuple[float, float]]], num_requests: int) -> None:
    print(f"{num_requests} decoding sequences, torch threads {torch.get_num_threads()}")
    print(f"{'variant':<18}{'step ms (rounds)':<30}{'attention ms (rounds)':<30}")
    medians = {}
    for name, rows in results.items():
        steps = " ".join(f"{step:.0f}" for step, _ in rows)
        attention = " ".join(f"{attn:.0f}" for _, attn in rows)
        print(f"{name:<18}{steps:<30}{attention:<30}")
        medians[name] = (
            statistics.median(s for s, _ in rows),
            statistics.median(a for _, a in rows),
        )
    (step_new, attn_new), (step_old, attn_old) = medians["grouped"], medians["one padded group"]
    print(
        f"median step {step_old / step_new:.2f}x faster grouped; "
        f"attention {attn_old / attn_new:.2f}x"
    )


if __name__ == "__main__":
    raise SystemExit(main())
