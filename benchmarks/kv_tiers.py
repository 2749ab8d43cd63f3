"""Multi-turn chat sessions against a KV cache a fraction of their working set: the offload
tiers on against off, side by side on one engine configuration and one workload.

Agentic shape: every session starts with one long shared system prompt, then alternates a turn
(a tool's output, 128 tokens, and a question) and the model's answer; sessions take
turns round-robin, so between two turns of a session
every other session runs one (the idle gap, measured in other sessions' work: with LRU or the
host tier what matters is the work in between, not the seconds). The sessions' final contexts
hold 3-5x the pool in distinct tokens (`--sessions`, `--turns`, `--pool-mib`).

Reported for the resumed turns (every turn after a session's first): TTFT p50 / p90 and the
prefill tokens computed, offload off against on; then a premium session (priority policy,
priority -1) resumed while low-priority sessions flood the cache, against the same session with
no flood; then the host tier's reload throughput: blocks copied from the host store into the
pool, one load at a time as the load thread does it (GB/s).

    python -m benchmarks.kv_tiers [--sessions 8] [--turns 4] [--pool-mib 64] [--plot PATH]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import dataclass, field

import torch

from splitserve import LLM, SamplingParams
from splitserve.engine.kv.block_hash import BlockHash
from splitserve.engine.kv.offload.host_store import HostBlockStore
from splitserve.engine.kv.offload.layout import BlockLayout, pool_block

SYSTEM = (
    "You are a meticulous travel-planning agent. You keep a running itinerary, check every "
    "date against the traveller's calendar, compare train and flight options on price and "
    "time, and answer in short numbered steps. "
) * 10
TOOL_OUTPUT = (
    "Tool result {n}: {city} timetable rows: 06:12 regional, 07:40 intercity (change at the "
    "junction, 9 minutes), 08:05 express, 09:30 regional; fares 18.40, 32.10, 41.00, 18.40 "
    "euros; the 07:40 runs on weekdays only and the express needs a seat reservation. Hotel "
    "rows: three places under budget within 800 metres of the station, one with late check-in."
)
QUESTIONS = [
    "Which museums in {city} open before nine on weekdays?",
    "Find me a hotel in {city} under 150 euros near the old town.",
    "How long is the train from {city} to the nearest airport?",
    "Suggest a dinner place in {city} that takes late bookings.",
    "What should I pack for three rainy days in {city}?",
    "Rebook everything in {city} one day later and list what changes.",
]
CITIES = ["Lisbon", "Krakow", "Ghent", "Turin", "Bergen", "Ljubljana", "Porto", "Tallinn"]
ANSWER = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


@dataclass
class Session:
    index: int
    priority: int = 0
    history: list[int] = field(default_factory=list)


@dataclass
class TurnResult:
    turn: int
    ttft_s: float
    prompt_tokens: int
    computed_tokens: int  # prompt tokens not served from any cache tier


def _turn_prompt(llm: LLM, session: Session, turn: int) -> list[int]:
    city = CITIES[session.index % len(CITIES)]
    question = QUESTIONS[turn % len(QUESTIONS)].format(city=city)
    tool = TOOL_OUTPUT.format(n=f"{session.index}-{turn}", city=city)
    text = f"\n{tool}\nUser ({session.index}-{turn}): {question}\nAgent:"
    if not session.history:
        text = SYSTEM + text
    return session.history + llm.tokenizer.encode(text)


def run_turn(llm: LLM, session: Session, turn: int) -> TurnResult:
    prompt = _turn_prompt(llm, session, turn)
    output = llm.generate([prompt], ANSWER, priority=[session.priority])[0].outputs[0]
    session.history = prompt + output.token_ids
    timings = output.timings
    return TurnResult(
        turn,
        timings.first_token_time - timings.arrival_time,
        len(prompt),
        len(prompt) - output.num_cached_tokens,
    )


def multi_turn(llm: LLM, num_sessions: int, num_turns: int) -> list[TurnResult]:
    sessions = [Session(i) for i in range(num_sessions)]
    results = []
    for turn in range(num_turns):
        for session in sessions:
            results.append(run_turn(llm, session, turn))
        log(f"turn {turn + 1}/{num_turns}: contexts up to {max(len(s.history) for s in sessions)}"
            f" tokens")
    return results


def premium_under_flood(llm: LLM, index: int, num_flood: int, num_turns: int) -> list[float]:
    """Resumed-turn TTFTs of one priority -1 session (its own content: `index`), `num_flood`
    low-class sessions running one turn each between its turns."""
    premium = Session(index, priority=-1)
    flood = [Session(200 + i) for i in range(num_flood)]
    ttfts = []
    for turn in range(num_turns):
        result = run_turn(llm, premium, turn)
        if turn:
            ttfts.append(result.ttft_s)
        for session in flood:
            run_turn(llm, session, turn)
    return ttfts


def reload_throughput(llm: LLM, num_blocks: int, blocks_per_load: int) -> float:
    """GB/s of host-store -> pool copies, `blocks_per_load` blocks per load as one request's
    prefix would come back."""
    kv_cache = llm.engine.runner.kv_cache
    layout = BlockLayout.of_pool(kv_cache, "bench")
    store = HostBlockStore(num_blocks, layout)
    hashes = [BlockHash(i.to_bytes(16, "big")) for i in range(num_blocks)]
    for block_hash in hashes:
        store.save(block_hash, torch.randn(layout.block_shape), 0)
    num_pool_blocks = kv_cache.shape[2]
    start = time.perf_counter()
    for first in range(0, num_blocks, blocks_per_load):
        for j, block_hash in enumerate(hashes[first : first + blocks_per_load]):
            store.load_into(block_hash, pool_block(kv_cache, (first + j) % num_pool_blocks))
    seconds = time.perf_counter() - start
    return num_blocks * layout.block_bytes / seconds / 1e9


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _summary(results: list[TurnResult]) -> tuple[float, float, int]:
    resumed = [r for r in results if r.turn > 0]
    ttfts = [r.ttft_s for r in resumed]
    return _percentile(ttfts, 0.5), _percentile(ttfts, 0.9), sum(r.computed_tokens for r in resumed)


def plot(off: list[TurnResult], on: list[TurnResult], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(6, 4))
    for label, results in (("offload off", off), ("offload on (host tier)", on)):
        ttfts = sorted(r.ttft_s * 1e3 for r in results if r.turn > 0)
        axis.step(ttfts, [(i + 1) / len(ttfts) for i in range(len(ttfts))], label=label)
    axis.set_xscale("log")
    axis.set_xlabel("TTFT of resumed turns (ms, log)")
    axis.set_ylabel("fraction of turns")
    axis.set_title("Multi-turn sessions, working set > KV cache")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    log(f"plot written to {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sessions", type=int, default=6)
    parser.add_argument("--turns", type=int, default=8)
    parser.add_argument("--pool-mib", type=int, default=96, help="the KV cache (tier 1)")
    parser.add_argument("--host-mib", type=int, default=1024, help="the host tier when on")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--plot", default="docs/kv_tiers_ttft.png")
    args = parser.parse_args()
    common = dict(kv_cache_bytes=args.pool_mib * 2**20, num_threads=args.threads)

    runs, engines = {}, {}
    for name, extra in (("off", {}), ("on", {"offload_host_bytes": args.host_mib * 2**20})):
        log(f"offload {name}: {args.sessions} sessions x {args.turns} turns")
        engines[name] = LLM(**common, **extra)
        runs[name] = multi_turn(engines[name], args.sessions, args.turns)
    pool_tokens = engines["on"].engine.kv_spec.num_tokens
    # Distinct tokens at the end: the shared system prompt once, each session's own history.
    system = len(engines["on"].tokenizer.encode(SYSTEM))
    working_set = system + sum(r.prompt_tokens - system for r in runs["on"][-args.sessions :])
    reload_llm = engines["on"]

    print(f"\nKV cache {pool_tokens} tokens; final working set {working_set} distinct tokens "
          f"({working_set / pool_tokens:.1f}x the cache)")
    print("| resumed turns | TTFT p50 | TTFT p90 | prefill tokens computed |")
    print("|---|---|---|---|")
    for name in ("off", "on"):
        p50, p90, computed = _summary(runs[name])
        print(f"| offload {name} | {p50 * 1e3:.0f} ms | {p90 * 1e3:.0f} ms | {computed} |")
    off_p50, on_p50 = _summary(runs["off"])[0], _summary(runs["on"])[0]
    print(f"resumed-turn TTFT p50: {off_p50 / on_p50:.1f}x lower with offload")

    log("premium session, quiet and under a flood (priority policy, host tier on)")
    premium = LLM(**common, offload_host_bytes=args.host_mib * 2**20, eviction_policy="priority")
    # Two premium sessions of the same shape and length (their own texts, so the second does
    # not find the first's turns cached), one alone, one among the flood.
    quiet = premium_under_flood(premium, 100, 0, args.turns)
    flooded = premium_under_flood(premium, 101, args.sessions, args.turns)
    q50, f50 = statistics.median(quiet), statistics.median(flooded)
    print(f"premium resumed-turn TTFT p50: quiet {q50 * 1e3:.0f} ms, under a flood of "
          f"{args.sessions} low-class sessions {f50 * 1e3:.0f} ms ({f50 / q50:.2f}x)")

    log("host tier reload throughput")
    rate = reload_throughput(reload_llm, 512, blocks_per_load=32)
    tiers = reload_llm.stats().kv_tiers
    served = tiers.hit_tokens.get("host", 0) // 16 * BlockLayout.of_pool(
        reload_llm.engine.runner.kv_cache, ""
    ).block_bytes
    engine_rate = served / tiers.load_seconds_total / 1e9 if tiers.load_seconds_total else 0.0
    print(f"host tier reload: {rate:.1f} GB/s (store -> pool copies, 32 blocks a load); "
          f"{engine_rate:.1f} GB/s over the run's {tiers.num_loads} loads (load thread, "
          f"admission to done)")
    plot(runs["off"], runs["on"], args.plot)


if __name__ == "__main__":
    main()
