"""`python -m benchmarks.parallel`: tensor parallel (TP=2) vs one process (TP=1) on the CPU.

Figures, per layout:
- batch-1 decode tokens/s: one request, its decode steps only (a max_tokens=1 run of the
  same prompt is subtracted, which leaves prefill out);
- 64-request tokens/s: 64 prompts submitted together, every output token over the wall time;
- communication share: of rank 0's wall time in those runs, the part spent inside gloo
  collectives (the step broadcast, the two all-reduces per layer, pipeline hand-offs). It
  includes waiting for the slower rank, so it is an upper bound on the cost of the transfers
  themselves.

SmolLM2-135M has 9 attention heads, which 2 does not divide; by default the model is a random
checkpoint of the same size and shapes but 8 heads of 72 (2 KV heads), written once under
build/bench_parallel_model (its tokens are random; its speed is SmolLM2's). `--model` takes any
HF directory or .gguf whose heads the sizes divide, `--tp 1 3` compares other sizes, and
`--pp 1 2` runs each of them also with 2 pipeline stages (tp x pp ranks; SmolLM2's 30 layers).

Threads: `--threads` per rank (default: the cores shared out, cores // (tp x pp), at least 1).
On a machine with fewer cores than ranks, parallelism only adds communication. Progress goes to
stderr, the table to stdout. Run it on a quiet machine; a test never asserts these figures.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from dataclasses import dataclass

from splitserve import LLM, SamplingParams

MODEL_DIR = os.path.join("build", "bench_parallel_model")
PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle."


@dataclass(frozen=True)
class Figures:
    tp_size: int
    pp_size: int
    batch1_decode_tps: float
    batch64_tps: float
    comm_share: float  # of rank 0's wall time in the two runs


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def synthetic_model(directory: str = MODEL_DIR) -> str:
    """SmolLM2-135M's sizes with 8 heads of 72 and 2 KV heads, random weights, its tokenizer."""
    if os.path.isfile(os.path.join(directory, "config.json")):
        return directory
    from transformers import LlamaConfig, LlamaForCausalLM

    log(f"writing a random 8-head SmolLM2-sized checkpoint to {directory}")
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=72,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    return write_random_checkpoint(LlamaForCausalLM, config, directory)


def write_random_checkpoint(model_class: type, config: object, directory: str) -> str:
    """`model_class(config)` with seeded random weights and SmolLM2's tokenizer, saved in
    `directory` (benchmarks/moe_parallel.py's Mixtral too)."""
    import torch
    from transformers import AutoTokenizer

    from splitserve.engine.model_paths import default_model_path

    gguf_dir, gguf_name = os.path.split(default_model_path())
    torch.manual_seed(0)
    model_class(config).save_pretrained(directory, safe_serialization=True)
    AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name).save_pretrained(directory)
    return directory


def measure(
    model: str, tp_size: int, pp_size: int, threads: int, max_tokens: int, batch: int
) -> Figures:
    log(f"TP={tp_size} PP={pp_size}: loading ({threads} thread(s) per rank)")
    llm = LLM(
        model,
        tensor_parallel_size=tp_size,
        pipeline_parallel_size=pp_size,
        num_threads=threads,
        adaptive_threads=False,
        kv_cache_bytes=512 * 2**20,
    )
    try:
        return _run(llm, tp_size, pp_size, max_tokens, batch)
    finally:
        llm.close()


def _run(llm: LLM, tp_size: int, pp_size: int, max_tokens: int, batch: int) -> Figures:
    prompt = llm.tokenizer.encode(PROMPT)
    first = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    decode = SamplingParams(temperature=0.0, max_tokens=max_tokens + 1, ignore_eos=True)
    llm.generate([prompt], decode)  # warm-up: kernels, buffers
    comm_before, wall_before = _comm_seconds(llm), time.perf_counter()
    prefill_s = timed(lambda: llm.generate([prompt], first))
    whole_s = timed(lambda: llm.generate([prompt], decode))
    batch1 = max_tokens / max(whole_s - prefill_s, 1e-9)
    log(f"TP={tp_size} PP={pp_size}: batch-1 decode {batch1:.1f} tok/s; {batch} requests ...")
    prompts = [prompt + [1000 + i] for i in range(batch)]  # distinct: no shared last block
    batch_s = timed(lambda: llm.generate(prompts, decode))
    wall = time.perf_counter() - wall_before
    share = (_comm_seconds(llm) - comm_before) / wall
    return Figures(tp_size, pp_size, batch1, batch * (max_tokens + 1) / batch_s, share)


def timed(action) -> float:
    """Seconds `action()` took."""
    start = time.perf_counter()
    action()
    return time.perf_counter() - start


def _comm_seconds(llm: LLM) -> float:
    group = llm.engine.parallel
    return 0.0 if group is None else group.comm.comm_seconds


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="default: a random 8-head SmolLM2-size")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2], help="sizes to compare")
    parser.add_argument("--pp", type=int, nargs="+", default=[1], help="pipeline sizes")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per rank")
    parser.add_argument("--max-tokens", type=int, default=64, help="decode tokens per request")
    parser.add_argument("--batch", type=int, default=64, help="requests in the batched run")
    args = parser.parse_args(argv)
    model = args.model or synthetic_model()
    rows = []
    for pp_size in args.pp:
        for tp_size in args.tp:
            threads = args.threads or max(1, (os.cpu_count() or 1) // (tp_size * pp_size))
            rows.append(measure(model, tp_size, pp_size, threads, args.max_tokens, args.batch))
    print(f"model: {model}; {os.cpu_count()} cores; gloo on loopback")
    batched = f"{args.batch}-request tok/s"
    print(f"{'TP':>3} {'PP':>3} {'batch-1 decode tok/s':>21} {batched:>20} {'comm share':>11}")
    for row in rows:
        print(
            f"{row.tp_size:>3} {row.pp_size:>3} {row.batch1_decode_tps:>21.1f} "
            f"{row.batch64_tps:>20.1f} {row.comm_share:>10.0%}"
        )


if __name__ == "__main__":
    main()
