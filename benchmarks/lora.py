"""Multi-LoRA throughput: 16 streams decoding with 8 different adapters mixed in the batch,
against the same 16 streams on the base model alone (target: >= 0.8x the base's tokens/s), and
against vLLM's CPU build serving the same adapters on the same prompts (target: >= 1.0x).

    python -m benchmarks.lora [--quick] [--model PATH] [--rank 8] [--max-tokens 64]
        [--rounds 3] [--threads N] [--no-vllm]

The model is the shipped SmolLM2-135M unless --model names another Llama checkpoint; the 8
adapters are random (nonzero A and B, every projection adapted, rank --rank), written in PEFT's
format to a temporary directory. Each round runs the base engine (enable_lora off) and the LoRA
engine on the same prompts, alternating, so a busy machine skews both alike; prints the median
tokens/s (output tokens over the whole generate call, prefill included) and their ratio.

Then vLLM (a peer in its own virtual environment, build/vllm-venv: benchmarks/peer/vllm_venv.py)
runs `LLM(enable_lora=True, max_loras=8)` in a subprocess (benchmarks/peer/vllm_lora.py) on the
same float32 weights (the shipped GGUF exported once: benchmarks/peer/hf_export.py), the same
token ids and the same adapter files, with the same rounds; ours and vLLM's tokens/s print side
by side. Ours is freed before vLLM starts, so the two never share the cores. Where vLLM refuses
LoRA (its engine or an adapter), its exception is printed as the reason instead of a figure.

`--quick` (short outputs, one round) is for a shared 2-core box: its figures are noisy. Final
figures are to be taken on a quiet machine with the defaults.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import subprocess
import tempfile
import time
from dataclasses import dataclass

import torch
from safetensors.torch import save_file

from benchmarks.peer.hf_export import ensure_hf_export
from benchmarks.peer.vllm_venv import ensure_vllm_venv
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
        target_modules = [name for names in MODULES.values() for name in names]
        config = {
            "peft_type": "LORA",
            "r": rank,
            "lora_alpha": 2 * rank,
            "target_modules": target_modules,  # vLLM checks the weights against them
            "bias": "none",
        }
        with open(os.path.join(path, "adapter_config.json"), "w") as file:
            json.dump(config, file)
        requests.append(LoRARequest(f"adapter{index}", index + 1, path))
    return requests


def _tokens_per_s(llm: LLM, prompts: list[str], params: SamplingParams, loras) -> float:
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, lora_request=loras)
    elapsed = time.perf_counter() - start
    return sum(len(out.outputs[0].token_ids) for out in outputs) / elapsed


@dataclass(frozen=True)
class OurFigures:
    base: float  # tokens/s, base model alone
    lora: float  # tokens/s, 8 adapters mixed


@dataclass(frozen=True)
class OurRun:
    figures: OurFigures
    adapters: list[LoRARequest]  # written under the run's directory
    prompts: list[list[int]]  # the rows' token ids, handed to vLLM as they are


def _ours(args: argparse.Namespace, directory: str, texts: list[str], rounds: int,
          params: SamplingParams) -> OurRun:  # fmt: skip
    options: dict = dict(kv_cache_bytes=256 * 2**20, enable_prefix_caching=False)
    if args.threads:
        options["num_threads"] = args.threads
    base = LLM(args.model, **options)
    prompts = [base.tokenizer.encode(text) for text in texts]
    lora = LLM(
        args.model, enable_lora=True, max_loras=NUM_ADAPTERS, max_lora_rank=args.rank, **options
    )
    adapters = _write_adapters(lora, directory, args.rank)
    mixed = [adapters[i % NUM_ADAPTERS] for i in range(NUM_ROWS)]
    _tokens_per_s(lora, prompts[:2], params, mixed[:2])  # warm-up: reads the adapters
    _tokens_per_s(base, prompts[:2], params, None)
    base_rates, lora_rates = [], []
    for _ in range(rounds):
        base_rates.append(_tokens_per_s(base, prompts, params, None))
        lora_rates.append(_tokens_per_s(lora, prompts, params, mixed))
    figures = OurFigures(statistics.median(base_rates), statistics.median(lora_rates))
    return OurRun(figures, adapters, prompts)


def _vllm(args: argparse.Namespace, directory: str, prompts: list[list[int]], rounds: int,
          max_tokens: int, adapters: list[LoRARequest]) -> dict:  # fmt: skip
    """vLLM's figures ({"vllm_lora", "vllm_base"}), or {"vllm_lora": None, "refused": why}."""
    python = ensure_vllm_venv()
    model = args.model or str(ensure_hf_export())
    spec = {
        "model": model,
        "prompts": prompts,
        "adapters": [(a.lora_name, a.lora_path) for a in adapters],
        "rank": args.rank,
        "max_tokens": max_tokens,
        "rounds": rounds,
    }
    spec_path = os.path.join(directory, "vllm_spec.json")
    with open(spec_path, "w") as file:
        json.dump(spec, file)
    # A KV budget of the order of ours (vLLM would otherwise take most of the free memory).
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}
    argv = [str(python), "-m", "benchmarks.peer.vllm_lora", spec_path]
    done = subprocess.run(argv, capture_output=True, text=True, env=env, check=False)
    # vLLM logs to stdout too: the figures are the one JSON line.
    lines = [line for line in done.stdout.splitlines() if line.startswith('{"vllm_lora"')]
    if not lines:
        tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
        return {"vllm_lora": None, "refused": f"exit {done.returncode}: " + " | ".join(tail)}
    return json.loads(lines[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one short round (shared boxes)")
    parser.add_argument("--model", default=None, help="a Llama checkpoint; default SmolLM2")
    parser.add_argument("--rank", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--no-vllm", action="store_true", help="ours only")
    args = parser.parse_args()
    max_tokens, rounds = (12, 1) if args.quick else (args.max_tokens, args.rounds)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    texts = [f"Story {i}: once upon a time in a land far away," for i in range(NUM_ROWS)]
    with tempfile.TemporaryDirectory() as directory:
        ours = _ours(args, directory, texts, rounds, params)
        gc.collect()  # our engines are gone before vLLM starts on the same cores
        theirs = None
        if not args.no_vllm:
            theirs = _vllm(args, directory, ours.prompts, rounds, max_tokens, ours.adapters)
    _print(args, ours.figures, theirs, max_tokens, rounds)


def _print(args: argparse.Namespace, ours: OurFigures, theirs: dict | None, max_tokens: int,
           rounds: int) -> None:  # fmt: skip
    print(
        f"threads {torch.get_num_threads()}, {NUM_ROWS} rows, {max_tokens} tokens each, "
        f"rank {args.rank}, {rounds} round(s){' (quick: noisy)' if args.quick else ''}"
    )
    print(f"{'tokens/s':<26}{'splitserve':>12}{'vLLM':>10}")
    vllm_base = vllm_lora = "-"
    if theirs is not None and theirs.get("vllm_lora") is not None:
        vllm_base, vllm_lora = f"{theirs['vllm_base']:.1f}", f"{theirs['vllm_lora']:.1f}"
    print(f"{'base model alone':<26}{ours.base:>12.1f}{vllm_base:>10}")
    print(f"{f'{NUM_ADAPTERS} adapters mixed':<26}{ours.lora:>12.1f}{vllm_lora:>10}")
    print(f"ours: {NUM_ADAPTERS} adapters / base  {ours.lora / ours.base:6.2f}x  (target >= 0.80x)")
    if theirs is None:
        return
    if theirs.get("vllm_lora") is None:
        print(f"vLLM refused LoRA: {theirs['refused']}")
        return
    ratio = ours.lora / theirs["vllm_lora"]
    print(f"ours / vLLM, adapters mixed  {ratio:6.2f}x  (target >= 1.00x)")


if __name__ == "__main__":
    main()
