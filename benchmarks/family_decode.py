"""Decode steps of the model families through the fused C++ layers against the Python layers.

    python -m benchmarks.family_decode [--families qwen3 gemma2 gemma3_text llama qwen2]
                                       [--batches 1 8] [--steps 24] [--rounds 5] [--threads 2]
                                       [--quantization none|int8|int4]

Each family is a random checkpoint of SmolLM2-135M's shape (hidden 576, 30 layers, 9 heads of
64, 3 KV heads, MLP 1536, its 49,152-token vocabulary), saved as a Hugging Face directory with
SmolLM2's tokenizer, with its family's parts switched on (Qwen3's q/k norms; Gemma 2's window
layers (64 tokens, shorter than the context), soft-caps and sandwich norms; Gemma 3's q/k norms
and local rotary base). For each batch size, that many ~128-token prompts are prefilled, then
the same engine runs 2 x `--steps` x `--rounds` decode steps, taking the C++ layers and the
Python layers (shared/model/fused_decode.py off) in turn, step by step in the order ABBA, so
that both see the same contexts (128 tokens growing to ~370 at the defaults) and the
machine's noise alike. Prints the median ms per step of each and their ratio.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from typing import Any

import torch

from benchmarks.machine import machine_line
from splitserve import LLM, SamplingParams
from splitserve.engine.model_paths import default_model_path

SHAPE = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    max_position_embeddings=2048,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=True,
)
WINDOW = 64
# model_type -> (transformers config class, the family's own options)
FAMILIES: dict[str, tuple[str, dict[str, Any]]] = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {}),
    "gemma2": (
        "Gemma2Config",
        {
            "sliding_window": WINDOW,
            "query_pre_attn_scalar": 64,
            "attn_logit_softcapping": 50.0,
            "final_logit_softcapping": 30.0,
        },
    ),
    "gemma3_text": (
        "Gemma3TextConfig",
        {"sliding_window": WINDOW, "query_pre_attn_scalar": 64, "rope_local_base_freq": 10000.0},
    ),
}


def write_checkpoint(root: str, family: str) -> str:
    import transformers  # lazy: only the benchmark builds checkpoints
    from transformers import AutoTokenizer  # lazy: as above

    config_class, options = FAMILIES[family]
    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**{**SHAPE, **options})
    model = transformers.AutoModelForCausalLM.from_config(config).float().eval()
    directory = os.path.join(root, family)
    model.save_pretrained(directory)
    gguf_directory, name = os.path.split(default_model_path())
    AutoTokenizer.from_pretrained(gguf_directory, gguf_file=name).save_pretrained(directory)
    return directory


def step_ms(llm: LLM, batch: int, steps: int, rounds: int) -> tuple[float, float]:
    """(median ms per decode step through the fused layers, through the Python layers):
    `steps * rounds` steps of each, interleaved ABBA."""
    engine = llm.engine
    model = engine.runner.model
    fused = model.fused_decode
    if fused is None:
        raise SystemExit("this model does not take the fused C++ layers here")
    served = 0
    original_run = fused.run

    def counted_run(*args: Any, **kwargs: Any) -> torch.Tensor:
        nonlocal served
        served += 1
        return original_run(*args, **kwargs)

    fused.run = counted_run  # type: ignore[method-assign]
    params = SamplingParams(temperature=0.0, max_tokens=2 * steps * rounds + 8, ignore_eos=True)
    for i in range(batch):
        prompt = llm.tokenizer.encode(f"Request {batch}-{i}: " + "a story about the sea. " * 20)
        engine.add_request(f"b{batch}-{i}", prompt[:128], params)
    while any(r.num_output_tokens == 0 for r in engine.scheduler.requests.values()):
        engine.step()  # prefill outside the timed steps
    for use_fused in (True, False, True, False):  # both paths warmed
        model.fused_decode = fused if use_fused else None
        engine.step()
    served = 0
    times: dict[bool, list[float]] = {True: [], False: []}
    for step in range(2 * steps * rounds):
        use_fused = step % 4 in (0, 3)  # A B B A: neither path always goes first
        model.fused_decode = fused if use_fused else None
        start = time.perf_counter()
        engine.step()
        times[use_fused].append(time.perf_counter() - start)
    model.fused_decode = fused
    del fused.run  # the class's run again: the next batch counts afresh
    assert served == len(times[True]), "every fused step should take the C++ layers"
    engine.abort_requests(list(engine.scheduler.requests))
    medians = [1000 * statistics.median(times[use_fused]) for use_fused in (True, False)]
    return medians[0], medians[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--families", nargs="+", default=["qwen3", "gemma2", "gemma3_text"],
                        choices=sorted(FAMILIES))  # fmt: skip
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--quantization", default="none", choices=["none", "int8", "int4"])
    args = parser.parse_args()
    print(machine_line(), flush=True)
    rows = []
    with tempfile.TemporaryDirectory() as root:
        for family in args.families:
            print(f"[{family}] writing a random checkpoint of SmolLM2's shape", flush=True)
            directory = write_checkpoint(root, family)
            llm = LLM(
                directory,
                num_threads=args.threads,
                kv_cache_bytes=256 * 2**20,
                quantization=args.quantization,
            )
            for batch in args.batches:
                print(f"[{family}] batch {batch}: {args.rounds} rounds", flush=True)
                fused_ms, python_ms = step_ms(llm, batch, args.steps, args.rounds)
                rows.append((family, batch, fused_ms, python_ms))
            del llm
    print(f"\n{'family':<12} {'batch':>5} {'fused ms':>9} {'python ms':>10} {'python/fused':>13}")
    for family, batch, fused_ms, python_ms in rows:
        ratio = python_ms / fused_ms
        print(f"{family:<12} {batch:>5} {fused_ms:>9.2f} {python_ms:>10.2f} {ratio:>12.2f}x")


if __name__ == "__main__":
    main()
