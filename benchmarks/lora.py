"""Multi-LoRA throughput: 16 streams decoding with 8 different adapters mixed in the batch,
against the same 16 streams on the base model alone (target: >= 0.8x the base's tokens/s).

    python -m benchmarks.lora [--quick] [--model PATH] [--rank 8] [--max-tokens 64]
        [--rounds 3] [--threads N]

The model is the shipped SmolLM2-135M unless --model names another Llama checkpoint; the 8
adapters are random (nonzero A and B, every projection adapted, rank --rank), written in PEFT's
format to a temporary directory. Each round runs the base engine (enable_lora off) and the LoRA
engine on the same prompts, alternating, so a busy machine skews both alike; prints the median
tokens/s (output tokens over the whole generate call, prefill included) and their ratio.

`--quick` (short outputs, one round) is for a shared 2-core box: its figures are noisy. Final
figures are to be taken on a quiet machine with the defaults.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

import torch
from safetensors.torch import save_file

from splitserve import LLM, LoRARequest, SamplingParams

NUM_ROWS = 16
NUM_ADAPTERS = 8
MODULES = {
    "self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}


def _write_adapters(llm: LLM, directory: str, rank: int) -> list[LoRARequest]:
    arch = llm.engine.architecture
    q, kv = arch.num_heads * arch.head_dim, arch.num_kv_heads * arch.head_dim
    shapes = {  # module -> (out, in)
        "q_proj": (q, arch.hidden_size),
        "k_proj": (kv, arch.hidden_size),
        "v_proj": (kv, arch.hidden_size),
        "o_proj": (arch.hidden_size, q),
        "gate_proj": (arch.intermediate_size, arch.hidden_size),
        "up_proj": (arch.intermediate_size, arch.hidden_size),
        "down_proj": (arch.hidden_size, arch.intermediate_size),
    }
    requests = []
    for index in range(NUM_ADAPTERS):
        generator = torch.Generator().manual_seed(index)
        tensors = {}
        for layer in range(arch.num_layers):
            for parent, names in MODULES.items():
                for name in names:
                    out, inp = shapes[name]
                    key = f"base_model.model.model.layers.{layer}.{parent}.{name}"
                    tensors[f"{key}.lora_A.weight"] = torch.randn(rank, inp, generator=generator)
                    tensors[f"{key}.lora_B.weight"] = 0.01 * torch.randn(
                        out, rank, generator=generator
                    )
        path = os.path.join(directory, f"adapter{index}")
        os.makedirs(path)
        save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
        config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": []}
        with open(os.path.join(path, "adapter_config.json"), "w") as file:
            json.dump(config, file)
        requests.append(LoRARequest(f"adapter{index}", index + 1, path))
    return requests


def _tokens_per_s(llm: LLM, prompts: list[str], params: SamplingParams, loras) -> float:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, lora_request=loras)
    elapsed = time.perf_counter() - start
    return sum(len(out.outputs[0].token_ids) for out in outputs) / elapsed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one short round (shared boxes)")
    parser.add_argument("--model", default=None, help="a Llama checkpoint; default SmolLM2")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    max_tokens, rounds = (12, 1) if args.quick else (args.max_tokens, args.rounds)
    options = dict(kv_cache_bytes=256 * 2**20, enable_prefix_caching=False)
    if args.threads:
        options["num_threads"] = args.threads
    base = LLM(args.model, **options)
    lora = LLM(
        args.model, enable_lora=True, max_loras=NUM_ADAPTERS, max_lora_rank=args.rank, **options
    )
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    prompts = [f"Story {i}: once upon a time in a land far away," for i in range(NUM_ROWS)]
    with tempfile.TemporaryDirectory() as directory:
        adapters = _write_adapters(lora, directory, args.rank)
        mixed = [adapters[i % NUM_ADAPTERS] for i in range(NUM_ROWS)]
        _tokens_per_s(lora, prompts[:2], params, mixed[:2])  # warm-up: reads the adapters
        _tokens_per_s(base, prompts[:2], params, None)
        base_rates, lora_rates = [], []
        for _ in range(rounds):
            base_rates.append(_tokens_per_s(base, prompts, params, None))
            lora_rates.append(_tokens_per_s(lora, prompts, params, mixed))
    base_rate, lora_rate = statistics.median(base_rates), statistics.median(lora_rates)
    print(
        f"threads {torch.get_num_threads()}, {NUM_ROWS} rows, {max_tokens} tokens each, "
        f"rank {args.rank}, {rounds} round(s){' (quick: noisy)' if args.quick else ''}"
    )
    print(f"base model alone          {base_rate:8.1f} tokens/s")
    print(f"{NUM_ADAPTERS} adapters mixed         {lora_rate:8.1f} tokens/s")
    print(f"ratio                     {lora_rate / base_rate:8.2f}x  (target >= 0.80x)")


if __name__ == "__main__":
    main()
