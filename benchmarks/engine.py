"""`make bench-engine`: the engine beside Hugging Face transformers, same model, same machine.

a. batch-1 decode tokens/s: ours / transformers `generate`;
b. aggregate output tokens/s for 64 seeded requests (prompts 32-512, outputs 16-256 tokens):
   ours (continuous batching) / transformers (static batches of 16, left padding);
c. TTFT of a 1024-token prompt, and of a second prompt sharing its first 960 tokens.

Figures are ratios measured in one process, because these machines are noisy. Progress goes to
stderr; the summary table to stdout.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from dataclasses import dataclass

import torch

from splitserve import LLM, SamplingParams


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def random_prompt(rng: random.Random, length: int) -> list[int]:
    # Ordinary vocabulary ids (SmolLM2 keeps its special tokens below 20).
    return [rng.randrange(1000, 40000) for _ in range(length)]


def batch1_prompt(seed: int) -> list[int]:
    """The 32-token prompt every batch-1 decode figure starts from, ours and the peers' alike."""
    return random_prompt(random.Random(seed + 2), 32)


def make_workload(seed: int, num_requests: int) -> Workload:
    rng = random.Random(seed)
    prompts = [random_prompt(rng, rng.randint(32, 512)) for _ in range(num_requests)]
    return Workload(prompts, [rng.randint(16, 256) for _ in range(num_requests)])


# ---- transformers, the peer ----------------------------------------------------------------


def load_transformers():
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    from splitserve.engine.model_paths import default_model_path

    logging.set_verbosity_error()
    directory, name = os.path.split(default_model_path())
    return AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)


def hf_generate(model, batch: list[list[int]], max_new_tokens: int) -> None:
    """Static batch, left padding, EOS ignored (min_new_tokens) so lengths are as asked."""
    width = max(len(p) for p in batch)
    ids = torch.tensor([[0] * (width - len(p)) + p for p in batch])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
    with torch.no_grad():
        model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            min_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=0,
        )


def hf_batch1_tokens_per_s(model, prompt: list[int], num_tokens: int) -> float:
    hf_generate(model, [prompt], 4)  # warm-up
    start = time.perf_counter()
    hf_generate(model, [prompt], num_tokens)
    return num_tokens / (time.perf_counter() - start)


def hf_static_batches_tokens_per_s(model, work: Workload, batch_size: int) -> float:
    start = time.perf_counter()
    for first in range(0, len(work.prompts), batch_size):
        batch = work.prompts[first : first + batch_size]
        # A static batch runs until its longest output; only the asked-for tokens count.
        hf_generate(model, batch, max(work.output_lens[first : first + batch_size]))
        log(f"transformers: batch {first // batch_size + 1} done")
    return sum(work.output_lens) / (time.perf_counter() - start)


def hf_ttft(model, prompt: list[int]) -> float:
    start = time.perf_counter()
    hf_generate(model, [prompt], 1)
    return time.perf_counter() - start


# ---- ours ----------------------------------------------------------------------------------


def fixed_length(num_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)


def our_batch1_tokens_per_s(llm: LLM, prompt: list[int], num_tokens: int) -> float:
    llm.generate([prompt], fixed_length(4))  # warm-up
    start = time.perf_counter()
    llm.generate([prompt], fixed_length(num_tokens))
    return num_tokens / (time.perf_counter() - start)


def our_continuous_tokens_per_s(llm: LLM, work: Workload) -> float:
    params = [fixed_length(n) for n in work.output_lens]
    start = time.perf_counter()
    llm.generate(work.prompts, params)
    return sum(work.output_lens) / (time.perf_counter() - start)


def our_ttfts(llm: LLM, seed: int) -> tuple[float, float]:
    rng = random.Random(seed + 1)
    first = random_prompt(rng, 1024)
    second = first[:960] + random_prompt(rng, 64)
    cold = llm.generate([first], fixed_length(1))[0].outputs[0].timings.time_to_first_token
    warm = llm.generate([second], fixed_length(1))[0].outputs[0].timings.time_to_first_token
    return cold, warm


# ---- the run -------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--decode-tokens", type=int, default=128)
    parser.add_argument("--skip-transformers", action="store_true")
    args = parser.parse_args(argv)
    threads = os.cpu_count() or 1
    torch.set_num_threads(threads)
    work = make_workload(args.seed, args.requests)
    short_prompt = batch1_prompt(args.seed)

    log("loading our engine")
    llm = LLM(num_threads=threads, kv_cache_bytes=2 * 2**30)
    model = None if args.skip_transformers else load_transformers()
    names = [
        "a. batch-1 decode tokens/s",
        f"b. {args.requests}-request output tokens/s",
        "c. TTFT 1024-token prompt (s)",
        "c. TTFT sharing 960 cached tokens (s)",
    ]
    # Each measure runs ours and then the peer back to back, so both see the same machine.
    ours: dict[str, float] = {}
    peers: dict[str, float] = {}
    log("a. batch-1 decode")
    ours[names[0]] = our_batch1_tokens_per_s(llm, short_prompt, args.decode_tokens)
    if model is not None:
        peers[names[0]] = hf_batch1_tokens_per_s(model, short_prompt, args.decode_tokens)
    log(f"b. {args.requests} requests: continuous batching, then static batches of 16")
    ours[names[1]] = our_continuous_tokens_per_s(llm, work)
    if model is not None:
        peers[names[1]] = hf_static_batches_tokens_per_s(model, work, 16)
    log("c. TTFT cold and with a 960-token cached prefix")
    cold, warm = our_ttfts(llm, args.seed)
    ours[names[2]], ours[names[3]] = cold, warm
    if model is not None:
        peers[names[2]] = hf_ttft(model, random_prompt(random.Random(args.seed + 1), 1024))
    rows = [(name, ours[name]) for name in names]
    print_table(rows, peers, threads)
    print(f"cached / uncached TTFT: {warm / cold:.3f} (target <= 0.2)")
    return 0


def print_table(rows: list[tuple[str, float]], peers: dict[str, float], threads: int) -> None:
    print(f"torch {torch.__version__}, {threads} threads")
    print(f"{'measure':<42}{'splitserve':>12}{'transformers':>14}{'ratio':>9}")
    for name, ours in rows:
        peer = peers.get(name)
        if peer is None:
            print(f"{name:<42}{ours:>12.3f}{'-':>14}{'-':>9}")
            continue
        # Throughputs: ours / theirs; times: theirs / ours. Either way, > 1 means we are faster.
        ratio = ours / peer if "tokens/s" in name else peer / ours
        print(f"{name:<42}{ours:>12.3f}{peer:>14.3f}{ratio:>8.2f}x")


if __name__ == "__main__":
    raise SystemExit(main())
