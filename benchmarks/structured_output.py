"""Structured against unconstrained decoding on the same engine, prompts and token counts.

Both sides generate exactly `--tokens` tokens per request: the unconstrained side with
ignore_eos, the constrained side under a JSON schema whose shortest instance is longer than
that (an array of at least 200 small records), so the ratio compares equal work. Rounds
alternate between the two sides, and the median round is reported, because these machines are
noisy. Then the grammar compile time: a schema never seen before (its first request pays it)
and the same schema again (cached).

    python -m benchmarks.structured_output [--tokens 96] [--rounds 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

from splitserve import LLM, SamplingParams
from splitserve.engine.structured_output.spec import StructuredOutput

RECORDS = {
    "type": "array",
    "minItems": 200,
    "items": {
        "type": "object",
        "properties": {
            "id": {"type": "integer", "minimum": 0, "maximum": 999},
            "name": {"type": "string", "maxLength": 8},
            "tier": {"enum": ["gold", "silver", "bronze"]},
        },
        "required": ["id", "name", "tier"],
        "additionalProperties": False,
    },
}


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def prompts(llm: LLM, batch: int, round_index: int) -> list[list[int]]:
    """Different every round, so the prefix cache does not shorten one side's prefill."""
    return [
        llm.tokenizer.encode(
            llm.tokenizer.apply_chat_template(
                [{"role": "user", "content": f"List customer records, batch {round_index}-{i}."}]
            ),
            add_special_tokens=False,
        )
        for i in range(batch)
    ]


def tokens_per_second(llm: LLM, batch: int, params: SamplingParams, round_index: int) -> float:
    work = prompts(llm, batch, round_index)
    start = time.perf_counter()
    results = llm.generate(work, params)
    seconds = time.perf_counter() - start
    num_tokens = sum(len(r.outputs[0].token_ids) for r in results)
    assert num_tokens == batch * params.max_tokens, "both sides must generate every token"
    return num_tokens / seconds


def compare(llm: LLM, batch: int, num_tokens: int, rounds: int) -> tuple[float, float]:
    free = SamplingParams(temperature=0.0, max_tokens=num_tokens, ignore_eos=True)
    constrained = SamplingParams(
        temperature=0.0,
        max_tokens=num_tokens,
        structured_output=StructuredOutput.json_schema(RECORDS),
    )
    tokens_per_second(llm, batch, constrained, -1)  # warm: the schema compiles here
    free_rates, constrained_rates = [], []
    for r in range(rounds):
        free_rates.append(tokens_per_second(llm, batch, free, 2 * r))
        constrained_rates.append(tokens_per_second(llm, batch, constrained, 2 * r + 1))
        log(f"batch {batch} round {r + 1}/{rounds}: free {free_rates[-1]:.1f} tok/s, "
            f"structured {constrained_rates[-1]:.1f} tok/s")
    return statistics.median(free_rates), statistics.median(constrained_rates)


def compile_times(llm: LLM) -> tuple[float, float]:
    """Seconds to compile a schema never seen before, and the same schema again."""
    schema = dict(RECORDS, description=f"fresh {time.time_ns()}")  # a new cache key
    output = StructuredOutput.json_schema(schema)
    start = time.perf_counter()
    llm.engine.grammars.new_sequence(output)
    first = time.perf_counter() - start
    start = time.perf_counter()
    llm.engine.grammars.new_sequence(output)
    return first, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=96)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16])
    args = parser.parse_args()
    log("loading the engine")
    llm = LLM(kv_cache_bytes=256 * 2**20)
    rows = []
    for batch in args.batches:
        free, constrained = compare(llm, batch, args.tokens, args.rounds)
        rows.append((batch, free, constrained))
    first, cached = compile_times(llm)
    print(f"{'batch':>5} {'free tok/s':>11} {'structured tok/s':>17} {'ratio':>6}")
    for batch, free, constrained in rows:
        print(f"{batch:>5} {free:>11.1f} {constrained:>17.1f} {constrained / free:>6.2f}")
    print(f"grammar compile: first {first * 1e3:.2f} ms, cached {cached * 1e3:.3f} ms")


if __name__ == "__main__":
    main()
