"""`python -m benchmarks.moe_parallel`: a mixture-of-experts model over 2 processes (expert
parallel, and tensor-parallel MoE) against 1 process, on the CPU.

Layouts (`--layouts`, default all four):
- `single`: one process;
- `ep2`: tensor_parallel_size 2 with enable_expert_parallel: 4 of the 8 experts per rank, rows
  dispatched and combined by all-to-all (shared/parallel/expert_parallel.py);
- `ep2_ar`: the same experts per rank, SPLITSERVE_EXPERT_DISPATCH=all_reduce: every rank routes
  every row through its own experts and the block's all-reduce sums (no rows move);
- `tp2`: tensor_parallel_size 2 without it: every expert's intermediate size split in two.

Figures per layout and batch size B (`--batch`, default 1 16 64): decode tokens/s of B requests
submitted together (a max_tokens=1 run of the same prompts is subtracted, leaving prefill out),
and, for ep2, the all-to-all share: of rank 0's wall time in those runs, the part inside the
dispatch/combine collectives (the counts' all-gather and the two all-to-alls per layer), beside
the share of all collectives (the broadcast of the step and the all-reduces too). Both include
waiting for the slower rank: upper bounds on the transfers themselves.

The model is a random Mixtral-shaped checkpoint written once under build/bench_moe_parallel_model
(8 experts, top 2, hidden 512, expert intermediate 1792, 8 layers, 8 heads of 64, 2 KV heads;
SmolLM2's tokenizer): wide enough that the experts dominate the step. `--model` takes another
Mixtral / Qwen2-MoE directory. `--quick` writes a tiny one and runs short (checks the program
works; its figures mean nothing). `--threads` is per rank (default: cores // ranks).
Progress goes to stderr, the table to stdout; run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass

from benchmarks.parallel import log, timed, write_random_checkpoint
from splitserve import LLM, SamplingParams
from splitserve.engine.parallel.moe_shard import DISPATCH_ENV

MODEL_DIR = os.path.join("build", "bench_moe_parallel_model")
PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."
_EP2 = {"tensor_parallel_size": 2, "enable_expert_parallel": True}
LAYOUTS = {"single": {}, "ep2": _EP2, "ep2_ar": _EP2, "tp2": {"tensor_parallel_size": 2}}
DISPATCH = {"ep2_ar": "all_reduce"}  # the others: the default (all_to_all)
FULL_SIZES = {"hidden_size": 512, "intermediate_size": 1792, "num_hidden_layers": 8}
QUICK_SIZES = {"hidden_size": 64, "intermediate_size": 64, "num_hidden_layers": 2}


@dataclass(frozen=True)
class Figures:
    layout: str
    batch: int
    decode_tps: float
    all_to_all_share: float  # of rank 0's wall time in this batch's runs
    comm_share: float


def synthetic_model(quick: bool) -> str:
    """A random Mixtral-shaped checkpoint (8 experts, top 2) with SmolLM2's tokenizer."""
    directory = MODEL_DIR + ("_quick" if quick else "")
    if os.path.isfile(os.path.join(directory, "config.json")):
        return directory
    from transformers import MixtralConfig, MixtralForCausalLM

    log(f"writing a random Mixtral-shaped checkpoint to {directory}")
    sizes = QUICK_SIZES if quick else FULL_SIZES
    config = MixtralConfig(
        vocab_size=49152,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=sizes["hidden_size"] // 8,
        num_local_experts=8,
        num_experts_per_tok=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        **sizes,
    )
    return write_random_checkpoint(MixtralForCausalLM, config, directory)


def measure(model: str, layout: str, args: argparse.Namespace) -> list[Figures]:
    ranks = LAYOUTS[layout].get("tensor_parallel_size", 1)
    threads = args.threads or max(1, (os.cpu_count() or 1) // ranks)
    log(f"{layout}: loading ({threads} thread(s) per rank)")
    os.environ[DISPATCH_ENV] = DISPATCH.get(layout, "all_to_all")  # the ranks inherit it
    llm = LLM(
        model,
        num_threads=threads,
        adaptive_threads=False,
        kv_cache_bytes=512 * 2**20,
        enable_prefix_caching=False,  # every run recomputes its prompts alike
        **LAYOUTS[layout],
    )
    try:
        prompt = llm.tokenizer.encode(PROMPT)
        llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
        return [_run(llm, layout, prompt, batch, args.max_tokens) for batch in args.batch]
    finally:
        llm.close()


def _run(llm: LLM, layout: str, prompt: list[int], batch: int, max_tokens: int) -> Figures:
    prompts = [prompt + [1000 + i] for i in range(batch)]
    first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    decode = SamplingParams(temperature=0.0, max_tokens=max_tokens + 1, ignore_eos=True)
    a2a_before, comm_before = _comm_seconds(llm)
    start = time.perf_counter()
    prefill_s = timed(lambda: llm.generate(prompts, first))
    whole_s = timed(lambda: llm.generate(prompts, decode))
    wall = time.perf_counter() - start
    a2a_after, comm_after = _comm_seconds(llm)
    decode_s = whole_s - prefill_s
    # nan when noise swallowed the decode time (--quick's few tokens on a busy machine)
    tps = batch * max_tokens / decode_s if decode_s > 0 else float("nan")
    log(f"{layout}: batch {batch}: {tps:.1f} decode tok/s")
    return Figures(
        layout, batch, tps, (a2a_after - a2a_before) / wall, (comm_after - comm_before) / wall
    )


def _comm_seconds(llm: LLM) -> tuple[float, float]:
    """(all-to-all seconds, all collectives' seconds) of rank 0 so far."""
    group = llm.engine.parallel
    if group is None:
        return 0.0, 0.0
    return group.comm.all_to_all_seconds, group.comm.comm_seconds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: a random Mixtral-shaped model")
    parser.add_argument("--layouts", nargs="+", choices=list(LAYOUTS), default=list(LAYOUTS))
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--threads", type=int, default=None, help="torch threads per rank")
    parser.add_argument("--max-tokens", type=int, default=32, help="decode tokens per request")
    parser.add_argument("--quick", action="store_true", help="tiny model, short runs")
    args = parser.parse_args(argv)
    if args.quick:
        args.max_tokens = min(args.max_tokens, 4)
    model = args.model or synthetic_model(args.quick)
    rows = [row for layout in args.layouts for row in measure(model, layout, args)]
    print(f"model: {model}; {os.cpu_count()} cores; gloo on loopback")
    print(f"{'layout':>7} {'batch':>6} {'decode tok/s':>13} {'all-to-all':>11} {'all comm':>9}")
    for row in rows:
        print(
            f"{row.layout:>7} {row.batch:>6} {row.decode_tps:>13.1f} "
            f"{row.all_to_all_share:>10.0%} {row.comm_share:>9.0%}"
        )


if __name__ == "__main__":
    main()
