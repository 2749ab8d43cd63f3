"""Runs inside vLLM's virtual environment (`benchmarks.peer.offline` starts it): the three
offline measures of `make bench-engine` with vLLM's `LLM`, printed as one JSON line.

vLLM compiles per shape on first use, so every measure is run once on other prompts first; its
prefix cache would hit repeated prompts, so timed prompts are new to it."""

from __future__ import annotations

import json
import random
import sys
import time


def main(model_dir: str, seed: int, num_requests: int, decode_tokens: int) -> None:
    from vllm import LLM, SamplingParams

    from benchmarks.engine import batch1_prompt, make_workload, random_prompt

    llm = LLM(model=model_dir, dtype="float32", max_model_len=2048, seed=0)

    def run(prompts: list[list[int]], lengths: list[int]) -> float:
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True) for n in lengths]
        start = time.perf_counter()
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return time.perf_counter() - start

    rng = random.Random(seed + 1000)
    run([random_prompt(rng, 32)], [decode_tokens])  # warm-up, other prompts throughout
    short_prompt = batch1_prompt(seed)
    batch1 = decode_tokens / run([short_prompt], [decode_tokens])
    warm_work = make_workload(seed + 1000, num_requests)
    run(warm_work.prompts, warm_work.output_lens)
    work = make_workload(seed, num_requests)
    continuous = sum(work.output_lens) / run(work.prompts, work.output_lens)
    run([random_prompt(rng, 1024)], [1])
    ttft = run([random_prompt(random.Random(seed + 1), 1024)], [1])
    print(json.dumps({"batch1": batch1, "continuous": continuous, "ttft_1024": ttft}))


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
