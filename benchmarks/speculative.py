"""`python -m benchmarks.speculative`: decode tokens/s with n-gram speculation vs without.

Two workloads, each at batch 1 and batch 16, on the shipped SmolLM2-135M:

a. repetitive: rewrite a given code snippet (rename a variable, keep the rest), the answer
   prefilled with a code fence: the output copies its prompt, so n-gram lookup proposes long
   runs the model accepts;
b. chat: open-ended questions sampled at temperature 0.8: little to copy, where the adaptive k
   and the batch switch must keep speculation from costing time.

Engines, built once each in this process: plain; n-gram with the default batch switch; and at
batch 16 also n-gram with the switch off (speculating at any batch size), which shows why the
switch exists. Decode tokens/s counts every output token after the first over the time from each
batch's first token to its last, so prefill is left out. Progress goes to stderr, the table to
stdout.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

import torch

from splitserve import LLM, SamplingParams

SNIPPETS = [
    """def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    totals = []
    running = 0
    for index, value in enumerate(values):
        running += value
        if index >= window:
            running -= values[index - window]
        if index >= window - 1:
            totals.append(running / window)
    return totals
""",
    """class Inventory:
    def __init__(self):
        self.items = {}

    def add(self, name, count):
        self.items[name] = self.items.get(name, 0) + count

    def remove(self, name, count):
        if self.items.get(name, 0) < count:
            raise KeyError(name)
        self.items[name] -= count

    def total(self):
        return sum(self.items.values())
""",
    """def merge_sorted(left, right):
    merged = []
    i = j = 0
    while i < len(left) and j < len(right):
        if left[i] <= right[j]:
            merged.append(left[i])
            i += 1
        else:
            merged.append(right[j])
            j += 1
    merged.extend(left[i:])
    merged.extend(right[j:])
    return merged
""",
    """def parse_config(lines):
    config = {}
    for line in lines:
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        key, _, value = line.partition("=")
        config[key.strip()] = value.strip()
    return config
""",
]
RENAMES = [("values", "samples"), ("items", "stock"), ("merged", "result"), ("config", "settings")]

QUESTIONS = [
    "What makes a good morning routine?",
    "Tell me a short story about a robot who learns to paint.",
    "Why is the sky blue? Explain simply.",
    "Give me some tips for learning a new language.",
    "What are the pros and cons of working from home?",
    "Describe your ideal vacation.",
    "How do plants know which way is up?",
    "Write a friendly note to a new neighbour.",
]


@dataclass(frozen=True)
class Workload:
    name: str
    prompts: list[list[int]]
    params: list[SamplingParams]


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def chat_prompt(llm: LLM, content: str) -> list[int]:
    text = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True
    )
    return llm.tokenizer.encode(text, add_special_tokens=False)


def repetitive(llm: LLM, batch: int, max_tokens: int) -> Workload:
    prompts = []
    for i in range(batch):
        snippet = SNIPPETS[i % len(SNIPPETS)]
        old, new = RENAMES[i % len(RENAMES)]
        request = (
            f"Rewrite this code, renaming `{old}` to `{new}`. Reply with the whole code only."
            f"\n```python\n{snippet}```"
        )
        # The answer starts with the code fence, as editing tools prefill it: the 135M model
        # otherwise often answers in prose about the code instead of rewriting it.
        fence = llm.tokenizer.encode("```python\n", add_special_tokens=False)
        prompts.append(chat_prompt(llm, request) + fence)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    return Workload("rewrite code", prompts, [params] * batch)


def chat(llm: LLM, batch: int, max_tokens: int) -> Workload:
    prompts = [chat_prompt(llm, QUESTIONS[i % len(QUESTIONS)]) for i in range(batch)]
    params = [SamplingParams(temperature=0.8, max_tokens=max_tokens, seed=i) for i in range(batch)]
    return Workload("chat", prompts, params)


def decode_rate(llm: LLM, workload: Workload, batch: int) -> tuple[float, int]:
    """(decode tokens/s, decode tokens): batch 1 runs the prompts one after another."""
    groups = [range(i, i + batch) for i in range(0, len(workload.prompts), batch)]
    num_tokens = 0
    seconds = 0.0
    for group in groups:
        results = llm.generate(
            [workload.prompts[i] for i in group], [workload.params[i] for i in group]
        )
        outputs = [result.outputs[0] for result in results]
        start = min(o.timings.first_token_time for o in outputs)
        seconds += max(o.timings.finish_time for o in outputs) - start
        num_tokens += sum(len(o.token_ids) - 1 for o in outputs)
    return num_tokens / seconds, num_tokens


def alternating_rates(
    plain: LLM, peer: LLM, workload: Workload, batch: int, rounds: int
) -> tuple[float, float]:
    """(plain, peer) decode tokens/s over `rounds` alternating runs of the workload: on a
    shared machine, load that comes and goes then falls on both sides alike."""
    totals = {"plain": [0, 0.0], "peer": [0, 0.0]}  # name -> [tokens, seconds]
    for _ in range(rounds):
        for name, llm in (("plain", plain), ("peer", peer)):
            rate, tokens = decode_rate(llm, workload, batch)
            totals[name][0] += tokens
            totals[name][1] += tokens / rate
    return (
        totals["plain"][0] / totals["plain"][1],
        totals["peer"][0] / totals["peer"][1],
    )


def spec_summary(llm: LLM, before) -> str:
    stats = llm.stats()
    proposed = stats.num_spec_proposed_tokens - before.num_spec_proposed_tokens
    accepted = stats.num_spec_accepted_tokens - before.num_spec_accepted_tokens
    steps = stats.num_spec_verify_steps - before.num_spec_verify_steps
    if not steps:
        return "no speculation"
    return (
        f"accepted {accepted}/{proposed} ({accepted / proposed:.0%}), {accepted / steps:.2f}/step"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--num-speculative-tokens", type=int, default=8)
    parser.add_argument("--num-threads", type=int, default=1, help="torch threads (default 1)")
    parser.add_argument(
        "--rounds", type=int, default=2, help="alternating plain/speculative runs per row"
    )
    args = parser.parse_args()
    torch.set_num_threads(args.num_threads)
    common = {"kv_cache_bytes": 256 * 2**20, "num_threads": args.num_threads}
    spec = {"speculative_method": "ngram", "num_speculative_tokens": args.num_speculative_tokens}
    log("loading three engines (plain, n-gram, n-gram without the batch switch)")
    engines = {
        "plain": LLM(**common),
        "ngram": LLM(**common, **spec),
        "ngram, switch off": LLM(**common, **spec, speculative_max_batch_size=10**6),
    }
    plain = engines["plain"]
    switch = engines["ngram"].config.speculative.speculative_max_batch_size
    for name, llm in engines.items():
        log(f"warming up {name}")
        llm.generate([chat_prompt(llm, "Hello!")], SamplingParams(temperature=0.0, max_tokens=8))
    rows = []
    for make in (repetitive, chat):
        for batch in (1, 16):
            num_prompts = 4 if batch == 1 else 16
            workload = make(plain, num_prompts, args.max_tokens)
            peers = ["ngram"] if batch == 1 else ["ngram", "ngram, switch off"]
            for peer in peers:
                llm = engines[peer]
                log(f"{workload.name}, batch {batch}: plain and {peer}, alternating")
                before = llm.stats()
                base_rate, rate = alternating_rates(plain, llm, workload, batch, args.rounds)
                rows.append(
                    (workload.name, batch, peer, base_rate, rate, spec_summary(llm, before))
                )
                log(f"  {base_rate:.1f} -> {rate:.1f} tok/s")
    print(
        f"\nSmolLM2-135M, {args.num_threads} torch thread(s), {args.max_tokens} max tokens, "
        f"k <= {args.num_speculative_tokens}, batch switch at {switch} decoding requests"
    )
    print(
        f"{'workload':<14}{'batch':>6}  {'engine':<19}{'plain':>9}{'spec':>9}{'ratio':>8}  detail"
    )
    for name, batch, peer, base, rate, detail in rows:
        ratio = rate / base
        print(f"{name:<14}{batch:>6}  {peer:<19}{base:>9.1f}{rate:>9.1f}{ratio:>7.2f}x  {detail}")


if __name__ == "__main__":
    main()
