"""Loading mixture-of-experts checkpoints: what the HF loader reads from Mixtral and Qwen2-MoE
configs, the tensors it expects, and the clear ValueError for every variant it does not run
(dense layers among sparse ones, sparse every other layer, sliding windows, a bad top-k,
missing expert tensors, GGUF MoE architectures other than Mixtral and qwen2moe); GGUF Mixtral
and qwen2moe files written as llama.cpp's converter writes them load the same model as the
Hugging Face directory they came from."""

from __future__ import annotations

import json
import os

import gguf
import numpy as np
import pytest
import torch

from splitserve.engine.model.architecture import ModelArchitecture, MoEConfig
from splitserve.engine.model.loader import expected_weight_shapes, load_checkpoint
from tests.test_loaders import (
    _TINY_TOKENS,
    _variant,
    llama_cpp_permute,
    write_decoder_metadata,
)


@pytest.fixture(scope="module")
def mixtral(make_tiny_moe_checkpoint) -> str:
    return make_tiny_moe_checkpoint("mixtral")


@pytest.fixture(scope="module")
def qwen2_moe(make_tiny_moe_checkpoint) -> str:
    return make_tiny_moe_checkpoint("qwen2_moe")


def test_mixtral_architecture(mixtral):
    checkpoint = load_checkpoint(mixtral)
    arch = checkpoint.architecture
    assert (arch.family, arch.attention_bias) == ("mixtral", False)
    assert arch.moe == MoEConfig(
        num_experts=8, num_experts_per_tok=2, expert_intermediate_size=32, norm_topk_prob=True
    )
    assert set(checkpoint.weights) == set(expected_weight_shapes(arch))
    assert "model.layers.1.block_sparse_moe.experts.7.w3.weight" in checkpoint.weights


def test_qwen2_moe_architecture(qwen2_moe):
    checkpoint = load_checkpoint(qwen2_moe)
    arch = checkpoint.architecture
    assert (arch.family, arch.attention_bias) == ("qwen2_moe", True)
    assert arch.moe == MoEConfig(
        num_experts=8,
        num_experts_per_tok=2,
        expert_intermediate_size=32,
        norm_topk_prob=False,
        shared_expert_intermediate_size=48,
    )
    assert set(checkpoint.weights) == set(expected_weight_shapes(arch))
    assert "model.layers.0.mlp.shared_expert_gate.weight" in checkpoint.weights
    assert "model.layers.0.self_attn.q_proj.bias" in checkpoint.weights


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda c: c.update(mlp_only_layers=[1]), r"mlp_only_layers"),
        (lambda c: c.update(decoder_sparse_step=2), r"decoder_sparse_step"),
        (lambda c: c.update(use_sliding_window=True), r"use_sliding_window"),
        (lambda c: c.update(layer_types=["full_attention", "sliding_attention"]), "layer_types"),
        (lambda c: c.update(num_experts=0), r"num_experts"),
        (lambda c: c.update(num_experts_per_tok=9), r"num_experts_per_tok \(9\)"),
        (lambda c: c.update(hidden_act="gelu"), r"hidden_act"),
    ],
    ids=["mlp_only_layers", "sparse_step", "sliding", "layer_types", "no_experts", "top_k", "act"],
)
def test_unsupported_qwen2_moe_variants(qwen2_moe, tmp_path, edit, message):
    with pytest.raises(ValueError, match=message):
        load_checkpoint(_variant(qwen2_moe, tmp_path, edit))


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda c: c.update(sliding_window=4096), r"sliding_window"),
        (lambda c: c.pop("num_local_experts"), r"needs an integer 'num_local_experts'"),
        (lambda c: c.update(num_experts_per_tok=0), r"num_experts_per_tok \(0\)"),
    ],
    ids=["sliding", "no_num_experts", "top_k"],
)
def test_unsupported_mixtral_variants(mixtral, tmp_path, edit, message):
    with pytest.raises(ValueError, match=message):
        load_checkpoint(_variant(mixtral, tmp_path, edit))


def test_missing_expert_tensor_is_named(mixtral, tmp_path):
    name = "model.layers.1.block_sparse_moe.experts.5.w2.weight"
    with pytest.raises(ValueError, match=rf"missing: {name}"):
        load_checkpoint(_variant(mixtral, tmp_path, drop_tensor=name))


def test_architecture_refuses_family_and_moe_that_disagree():
    base = dict(
        name="x", vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=1, num_heads=2,
        num_kv_heads=1, head_dim=4, rms_norm_eps=1e-6, rope_theta=1e4,
        max_position_embeddings=64, tie_word_embeddings=False, bos_token_id=None,
        eos_token_ids=(2,),
    )  # fmt: skip
    moe = MoEConfig(num_experts=4, num_experts_per_tok=2, expert_intermediate_size=8,
                    norm_topk_prob=True)  # fmt: skip
    with pytest.raises(ValueError, match="disagree"):
        ModelArchitecture(**base, family="mixtral")
    with pytest.raises(ValueError, match="disagree"):
        ModelArchitecture(**base, moe=moe)
    with pytest.raises(ValueError, match="unknown model family 'deepseek_v3'"):
        ModelArchitecture(**base, family="deepseek_v3", moe=moe)
    with pytest.raises(ValueError, match="shared_expert_intermediate_size"):
        MoEConfig(4, 2, 8, True, shared_expert_intermediate_size=-1)


def _gguf_from_hf(directory: str, path, family: str) -> str:
    """The checkpoint in `directory` written as llama.cpp's converter writes it: Mixtral as a
    `llama` with experts (Q/K rows permuted), Qwen2-MoE as `qwen2moe`; experts stacked."""
    from safetensors.torch import load_file

    with open(os.path.join(directory, "config.json")) as f:
        config = json.load(f)
    hf = {
        name: t.numpy()
        for name, t in load_file(os.path.join(directory, "model.safetensors")).items()
    }
    arch = "llama" if family == "mixtral" else "qwen2moe"
    writer = gguf.GGUFWriter(str(path), arch=arch)
    _write_metadata(writer, config, family)
    for name, values in _gguf_tensors(hf, config, family).items():
        writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def _write_metadata(writer: gguf.GGUFWriter, config: dict, family: str) -> None:
    write_decoder_metadata(writer, config)
    writer.add_expert_used_count(config["num_experts_per_tok"])
    if family == "mixtral":
        writer.add_expert_count(config["num_local_experts"])
    else:
        writer.add_expert_count(config["num_experts"])
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
        writer.add_expert_shared_feed_forward_length(config["shared_expert_intermediate_size"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(_TINY_TOKENS)
    writer.add_token_types([3, 3, 3] + [1] * (len(_TINY_TOKENS) - 3))
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)


def _gguf_tensors(hf: dict, config: dict, family: str) -> dict:
    out = {
        "token_embd.weight": hf["model.embed_tokens.weight"],
        "output_norm.weight": hf["model.norm.weight"],
        "output.weight": hf["lm_head.weight"],
    }
    heads = {"q": config["num_attention_heads"], "k": config["num_key_value_heads"]}
    moe = "block_sparse_moe." if family == "mixtral" else "mlp."
    parts = {"gate": "w1", "up": "w3", "down": "w2"} if family == "mixtral" else {
        p: f"{p}_proj" for p in ("gate", "up", "down")
    }  # fmt: skip
    num_experts = config.get("num_local_experts") or config["num_experts"]
    for i in range(config["num_hidden_layers"]):
        src, dst = f"model.layers.{i}.", f"blk.{i}."
        out[dst + "attn_norm.weight"] = hf[src + "input_layernorm.weight"]
        out[dst + "ffn_norm.weight"] = hf[src + "post_attention_layernorm.weight"]
        for proj, kind in (("q", "attn_q"), ("k", "attn_k"), ("v", "attn_v"), ("o", "attn_output")):
            for suffix in ("weight", "bias"):
                values = hf.get(f"{src}self_attn.{proj}_proj.{suffix}")
                if values is not None and family == "mixtral" and proj in heads:
                    values = llama_cpp_permute(values, heads[proj])
                if values is not None:
                    out[f"{dst}{kind}.{suffix}"] = values
        out[dst + "ffn_gate_inp.weight"] = hf[f"{src}{moe}gate.weight"]
        for part, name in parts.items():
            out[f"{dst}ffn_{part}_exps.weight"] = np.stack(
                [hf[f"{src}{moe}experts.{e}.{name}.weight"] for e in range(num_experts)]
            )
        if family == "qwen2_moe":
            for part in ("gate", "up", "down"):
                out[f"{dst}ffn_{part}_shexp.weight"] = hf[
                    f"{src}mlp.shared_expert.{part}_proj.weight"
                ]
            out[dst + "ffn_gate_inp_shexp.weight"] = hf[src + "mlp.shared_expert_gate.weight"][0]
    return out


@pytest.mark.parametrize("family", ["mixtral", "qwen2_moe"])
def test_gguf_moe_loads_the_same_model_as_the_hf_directory(
    make_tiny_moe_checkpoint, tmp_path, family
):
    directory = make_tiny_moe_checkpoint(family)
    from_hf = load_checkpoint(directory)
    from_gguf = load_checkpoint(_gguf_from_hf(directory, tmp_path / "moe.gguf", family))
    assert set(from_gguf.weights) == set(from_hf.weights)
    for name, tensor in from_hf.weights.items():
        assert torch.equal(from_gguf.weights[name], tensor), name
    model_fields = ("family", "moe", "attention_bias", "hidden_size", "num_layers", "num_heads")
    model_fields += ("num_kv_heads", "head_dim", "rope_theta", "tie_word_embeddings")
    for field in model_fields:
        assert getattr(from_gguf.architecture, field) == getattr(from_hf.architecture, field)


def test_gguf_moe_architecture_not_supported_is_named(tmp_path):
    path = tmp_path / "olmoe.gguf"
    writer = gguf.GGUFWriter(str(path), arch="olmoe")
    writer.add_expert_count(8)
    writer.add_tensor("token_embd.weight", np.ones((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="'olmoe' mixture-of-experts model, which is not"):
        load_checkpoint(str(path))


def test_moe_models_refuse_quantization_and_pipeline_ranks(mixtral):
    """Tensor and expert parallel MoE: tests/test_expert_parallel.py."""
    from splitserve import LLM

    with pytest.raises(ValueError, match="quantization 'int8' does not support mixture-of-experts"):
        LLM(mixtral, quantization="int8", kv_cache_bytes=2**20)
    with pytest.raises(ValueError, match="support mixture-of-experts models \\(mixtral\\)"):
        LLM(mixtral, pipeline_parallel_size=2, kv_cache_bytes=2**20)
