"""Runs inside llama-cpp-python's virtual environment (`benchmarks.quantization` starts it):
the offline measures of `benchmarks/quantization.py` with llama.cpp on the same GGUF file and
threads, printed as one JSON line. With `--rounds`, after loading it waits for lines on stdin
instead: each "batch1" line runs the batch-1 measure once more and prints its JSON line, so the
caller can alternate it with its own runs (`benchmarks.quantization --alternate`).

llama-cpp-python's `Llama` serves one sequence at a time (no continuous batching), so the
64-request figure runs the requests one after another: what its users get. Greedy sampling
(top_k=1), EOS ignored (the generator yields tokens until told to stop), no prefix reuse
(`reset()` before every prompt), one warm-up run per measure on other prompts.
"""

from __future__ import annotations

import json
import random
import sys
import time


def main(
    model_path: str,
    threads: int,
    seed: int,
    num_requests: int,
    decode_tokens: int,
    rounds: bool = False,
) -> None:
    from llama_cpp import Llama, llama_model_size, llama_print_system_info

    from benchmarks.engine import batch1_prompt, make_workload, random_prompt

    llm = Llama(
        model_path=model_path,
        n_ctx=2048,
        n_batch=512,
        n_threads=threads,
        n_threads_batch=threads,
        verbose=False,
    )

    def run(prompt: list[int], num_tokens: int) -> float:
        """Seconds from the call to the num_tokens-th generated token."""
        llm.reset()
        start = time.perf_counter()
        for count, _ in enumerate(llm.generate(prompt, top_k=1, temp=0.0, reset=True), start=1):
            if count == num_tokens:
                break
        return time.perf_counter() - start

    rng = random.Random(seed + 1000)
    run(random_prompt(rng, 32), decode_tokens)  # warm-up
    short_prompt = batch1_prompt(seed)
    if rounds:
        print(json.dumps({"ready": True}), flush=True)
        for line in sys.stdin:
            if line.strip() == "batch1":
                print(
                    json.dumps({"batch1": decode_tokens / run(short_prompt, decode_tokens)}),
                    flush=True,
                )
        return
    batch1 = decode_tokens / run(short_prompt, decode_tokens)
    work = make_workload(seed, num_requests)
    start = time.perf_counter()
    for prompt, num_tokens in zip(work.prompts, work.output_lens, strict=True):
        run(prompt, num_tokens)
    sequential = sum(work.output_lens) / (time.perf_counter() - start)
    run(random_prompt(rng, 1024), 1)
    ttft = run(random_prompt(random.Random(seed + 1), 1024), 1)
    weights = llama_model_size(llm.model)
    figures = {"batch1": batch1, "continuous": sequential, "ttft_1024": ttft}
    # The CPU features this llama.cpp was built to use ("AVX2 = 1 | AVX512 = 0 | ..."),
    # printed beside the figures.
    system_info = llama_print_system_info().decode(errors="replace").strip()
    print(json.dumps({**figures, "weight_bytes": weights, "system_info": system_info}))


if __name__ == "__main__":
    main(sys.argv[1], *(int(arg) for arg in sys.argv[2:6]), rounds="--rounds" in sys.argv[6:])
