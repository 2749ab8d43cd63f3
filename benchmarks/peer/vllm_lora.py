"""Runs inside vLLM's virtual environment (`benchmarks.lora` starts it): the multi-LoRA measure
with vLLM's `LLM(enable_lora=True)`, printed as one JSON line starting `{"vllm_lora"`.

    python -m benchmarks.peer.vllm_lora SPEC.json

SPEC.json (written by benchmarks.lora): model, prompts (token ids, one per row), adapters
(name, path; row i takes adapters[i % len]), rank, max_tokens, rounds. The same prompts and
adapter files as ours, greedy, ignore_eos. Each round times the mixed batch and the same rows
on the base (no adapter, same engine), after a warm-up that loads every adapter (vLLM compiles
per shape on first use). When vLLM refuses the engine or an adapter, the line is
`{"vllm_lora": null, "refused": "<exception>: <message>"}` instead.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
import traceback


def main(spec_path: str) -> None:
    with open(spec_path) as file:
        spec = json.load(file)
    try:
        figures = _measure(spec)
    except Exception as error:  # reported to the caller by name: it prints why vLLM refused
        traceback.print_exc()
        figures = {"vllm_lora": None, "refused": f"{type(error).__name__}: {error}"}
    print(json.dumps(figures), flush=True)


def _measure(spec: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.lora.request import LoRARequest

    adapters = [
        LoRARequest(name, index + 1, path) for index, (name, path) in enumerate(spec["adapters"])
    ]
    prompts = [{"prompt_token_ids": ids} for ids in spec["prompts"]]
    mixed = [adapters[i % len(adapters)] for i in range(len(prompts))]
    llm = LLM(
        model=spec["model"],
        dtype="float32",
        max_model_len=2048,
        seed=0,
        enable_lora=True,
        max_loras=len(adapters),
        max_lora_rank=spec["rank"],
        max_num_seqs=max(len(prompts), 16),
    )
    params = SamplingParams(temperature=0.0, max_tokens=spec["max_tokens"], ignore_eos=True)

    def tokens_per_s(loras: list | None) -> float:
        start = time.perf_counter()
        outputs = llm.generate(prompts, params, lora_request=loras, use_tqdm=False)
        elapsed = time.perf_counter() - start
        return sum(len(out.outputs[0].token_ids) for out in outputs) / elapsed

    tokens_per_s(mixed)  # warm-up: loads every adapter, compiles the shapes
    tokens_per_s(None)
    lora_rates, base_rates = [], []
    for _ in range(spec["rounds"]):
        base_rates.append(tokens_per_s(None))
        lora_rates.append(tokens_per_s(mixed))
    return {
        "vllm_lora": statistics.median(lora_rates),
        "vllm_base": statistics.median(base_rates),
    }


if __name__ == "__main__":
    main(sys.argv[1])
