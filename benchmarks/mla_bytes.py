"""P->D bytes per prompt token: DeepSeek-V2's latent KV pages against a GQA (Llama) model of the
same hidden size.

    python -m benchmarks.mla_bytes [--prompt-tokens 512] [--dtype bfloat16]

Two parts:
- measured: a tiny DeepSeek-V2-shaped model and a tiny Llama GQA model (random weights built with
  transformers' config classes, hidden 512, 4 layers, 16 heads) each prefill the same prompt on a
  prefill engine that exports its pages for a decode engine, as the pods do (the decode engine
  reserves the blocks, the prefill engine exports them, the decode engine unpacks them); printed:
  the exported bytes per prompt token and per token per layer, the ratio, the pack + unpack
  time of the pages in process, and the median time to send those pages over UCX (the
  project's default options) from a sender to a receiver in this process, checked equal on
  arrival (between two processes: benchmarks/kv_transfer_bandwidth.py's GB/s);
- at full size, from the engine's own page sizing (`bytes_per_block` of the architecture the
  loader would build): DeepSeek-V2 and -V3 against GQA models of the same hidden size.

Quick figures from a shared machine; timings are to be taken again on a quiet one.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import tempfile
import time
from dataclasses import replace
from typing import Any

import torch

from splitserve import LLM, SamplingParams
from splitserve.engine.kv.cache import bytes_per_block
from splitserve.engine.kv.disaggregation import RemotePrefillResult
from splitserve.engine.kv.transfer import (
    KVTransferConfig,
    KVTransferDescriptor,
    create_kv_transport,
)
from splitserve.engine.model.architecture import MLAConfig, ModelArchitecture
from splitserve.engine.model_paths import default_model_path

HIDDEN, LAYERS, HEADS = 512, 4, 16
_COMMON = dict(
    vocab_size=49152,  # SmolLM2's tokenizer, saved beside the weights
    hidden_size=HIDDEN,
    intermediate_size=1024,
    num_hidden_layers=LAYERS,
    num_attention_heads=HEADS,
    max_position_embeddings=4096,
    bos_token_id=1,
    eos_token_id=2,
)
# DeepSeek-V2's shape scaled to hidden 512: latent 128 + rope 16 per token per layer.
DEEPSEEK = dict(
    num_key_value_heads=HEADS,
    kv_lora_rank=128,
    q_lora_rank=192,
    qk_rope_head_dim=16,
    qk_nope_head_dim=32,
    v_head_dim=32,
    n_routed_experts=8,
    n_shared_experts=2,
    num_experts_per_tok=2,
    moe_intermediate_size=128,
    first_k_dense_replace=1,
    n_group=4,
    topk_group=2,
    topk_method="group_limited_greedy",
)
LLAMA = dict(num_key_value_heads=4, head_dim=HIDDEN // HEADS)  # GQA: 4 KV heads of 32


def _tokenizer() -> Any:
    from transformers import AutoTokenizer

    directory, name = os.path.split(default_model_path())
    return AutoTokenizer.from_pretrained(directory, gguf_file=name)


def _checkpoint(root: str, name: str, config_class: str, options: dict[str, Any]) -> str:
    import transformers

    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**{**_COMMON, **options})
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    directory = os.path.join(root, name)
    model.save_pretrained(directory)
    _tokenizer().save_pretrained(directory)
    return directory


def _export(
    directory: str, prompt: list[int], dtype: str, repeats: int
) -> tuple[torch.Tensor, float]:
    """(the exported pages, median pack + unpack seconds) of `prompt` prefilled on one engine
    and taken by another."""
    options: dict[str, Any] = {"kv_cache_bytes": 256 * 2**20, "dtype": dtype}
    prefill, decode = LLM(directory, **options).engine, LLM(directory, **options).engine
    params = SamplingParams(temperature=0.0, max_tokens=1)
    plan = decode.reserve_remote_prefill("r", prompt, params)
    assert plan is not None, "the decode engine has room for the prompt"
    prefill.add_request("r", prompt, params, export_kv_from_block=plan.first_block_index)
    first = None
    while prefill.has_unfinished_requests():
        for delta in prefill.step():
            if delta.final is not None:
                first = delta.final.token_ids[0]
    pages = prefill.take_exported_pages("r")
    assert pages is not None and first is not None, "the prefill engine exported the pages"
    decode.complete_remote_prefill("r", RemotePrefillResult(first, None, pages))
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        packed = prefill.pages.pack(plan.block_ids)
        decode.pages.unpack(packed, plan.block_ids)
        seconds.append(time.perf_counter() - start)
    return pages, statistics.median(seconds)


async def _ucx_seconds(all_pages: list[torch.Tensor], repeats: int) -> list[float]:
    """For each of `all_pages`, the median seconds to send it over UCX to a receiver in this
    process (a warm-up transfer first); every arrival is checked byte for byte. One transport
    for all: ucxx does not survive a second one after the first closed in one process."""
    transport = create_kv_transport(KVTransferConfig(backend="ucx", offer_wait_s=30.0))
    receiver = await transport.start_receiver()
    sender = transport.create_sender()
    medians = []
    try:
        for n, pages in enumerate(all_pages):
            destination = torch.empty_like(pages)
            seconds = []
            for i in range(repeats + 1):
                request_id = f"{n}-{i}"
                descriptor = KVTransferDescriptor.for_buffer(request_id, range(len(pages)), pages)
                destination.zero_()
                start = time.perf_counter()
                await asyncio.gather(
                    sender.send(receiver.address, descriptor, pages, 30.0),
                    receiver.receive(request_id, destination, 30.0),
                )
                seconds.append(time.perf_counter() - start)
                assert torch.equal(destination.view(torch.uint8), pages.view(torch.uint8))
            medians.append(statistics.median(seconds[1:]))
    finally:
        await sender.close()
        await receiver.close()
    return medians


def _full_size_rows() -> list[tuple[str, ModelArchitecture]]:
    """Published shapes, built as the loader would (only the page sizing is read)."""
    base = ModelArchitecture(
        name="gqa",
        vocab_size=1,
        hidden_size=5120,
        intermediate_size=1,
        num_layers=60,
        num_heads=128,
        num_kv_heads=8,
        head_dim=128,
        rms_norm_eps=1e-6,
        rope_theta=1e4,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        bos_token_id=None,
        eos_token_ids=(),
    )
    v2_mla = MLAConfig(kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128)
    v2 = replace(
        base, name="deepseek-v2 (MLA, 60 layers, latent 512 + rope 64)", head_dim=64,
        num_kv_heads=128, mla=v2_mla, family="deepseek_v2", moe=_any_moe(),
    )  # fmt: skip
    gqa_v2 = replace(base, name="GQA, hidden 5120, 60 layers, 8 KV heads of 128")
    v3 = replace(v2, name="deepseek-v3 (MLA, 61 layers, latent 512 + rope 64)", num_layers=61)
    llama70 = replace(
        base, name="llama-3-70b (GQA, hidden 8192, 80 layers, 8 KV heads)", num_layers=80,
        hidden_size=8192, num_heads=64,
    )  # fmt: skip
    return [(v2.name, v2), (gqa_v2.name, gqa_v2), (v3.name, v3), (llama70.name, llama70)]


def _any_moe() -> Any:
    from splitserve.engine.model.architecture import MoEConfig

    return MoEConfig(num_experts=2, num_experts_per_tok=1, expert_intermediate_size=1,
                     norm_topk_prob=False, topk_method="greedy")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt-tokens", type=int, default=512)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    prompt = [(7 * i + 3) % 40000 + 3 for i in range(args.prompt_tokens)]
    itemsize = getattr(torch, args.dtype).itemsize
    print(f"prompt {args.prompt_tokens} tokens, {args.dtype}, hidden {HIDDEN}, {LAYERS} layers")
    results, exported = {}, []
    with tempfile.TemporaryDirectory() as root:
        for name, config_class, options in (
            ("deepseek_v2 (MLA, latent 128 + rope 16)", "DeepseekV2Config", DEEPSEEK),
            ("llama (GQA, 4 KV heads of 32)", "LlamaConfig", LLAMA),
        ):
            directory = _checkpoint(root, name.split()[0], config_class, options)
            pages, seconds = _export(directory, prompt, args.dtype, args.repeats)
            exported.append((name, pages, seconds))
    sent = asyncio.run(_ucx_seconds([pages for _, pages, _ in exported], args.repeats))
    for (name, pages, seconds), ucx_s in zip(exported, sent):
        num_bytes = pages.numel() * pages.element_size()
        results[name] = num_bytes
        per_token = num_bytes / args.prompt_tokens
        print(
            f"  {name:42s} {num_bytes:>10,d} B exported, {per_token:8.1f} B/token, "
            f"{per_token / LAYERS / itemsize:6.1f} values/token/layer, "
            f"pack+unpack {seconds * 1e3:6.2f} ms, over UCX {ucx_s * 1e3:6.2f} ms"
        )
    mla, gqa = results.values()
    print(f"  GQA / MLA bytes per prompt token: {gqa / mla:.2f}x")
    print(f"full size ({args.dtype}, from bytes_per_block of each architecture):")
    rows = _full_size_rows()
    per_token = [bytes_per_block(arch, 16, getattr(torch, args.dtype)) / 16 for _, arch in rows]
    for (name, _), size in zip(rows, per_token):
        print(f"  {name:58s} {size / 1024:8.1f} KiB/token")
    ratio = per_token[1] / per_token[0]
    print(f"  GQA / deepseek-v2: {ratio:.2f}x at the same hidden size and depth")
    print(f"  llama-3-70b / deepseek-v3: {per_token[3] / per_token[2]:.2f}x")
    print("(timings from a shared machine; take them again on a quiet one)")


if __name__ == "__main__":
    main()
