"""Loading mixture-of-experts checkpoints: what the HF loader reads from Mixtral and Qwen2-MoE
configs, the tensors it expects, and the clear ValueError for every variant it does not run
(dense layers among sparse ones, sparse every other layer, sliding windows, a bad top-k,
missing expert tensors, GGUF MoE files)."""

from __future__ import annotations

import json
import os

import gguf
import numpy as np
import pytest

from shared.model.architecture import ModelArchitecture, MoEConfig
from shared.model.loader import expected_weight_shapes, load_checkpoint


def _variant(source: str, target, edit_config=None, drop_tensor: str | None = None) -> str:
    """A copy of `source` in `target` with config.json edited or one tensor dropped."""
    from safetensors.torch import load_file, save_file

    for file in os.listdir(source):
        if file == "config.json" and edit_config is not None:
            with open(os.path.join(source, file)) as f:
                config = json.load(f)
            edit_config(config)
            (target / file).write_text(json.dumps(config))
        elif file == "model.safetensors" and drop_tensor is not None:
            tensors = load_file(os.path.join(source, file))
            del tensors[drop_tensor]
            save_file(tensors, str(target / file))
        else:
            os.symlink(os.path.join(source, file), target / file)
    return str(target)


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
        (lambda c: c.update(num_experts_per_tok=0), r"num_experts_per_tok \(0\)"),
    ],
    ids=["sliding", "top_k"],
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


@pytest.mark.parametrize("arch,experts", [("llama", 8), ("qwen2moe", 4)])
def test_gguf_moe_files_are_refused_by_name(tmp_path, arch, experts):
    path = tmp_path / f"{arch}-moe.gguf"
    writer = gguf.GGUFWriter(str(path), arch=arch)
    writer.add_expert_count(experts)
    writer.add_expert_used_count(2)
    writer.add_tensor("token_embd.weight", np.ones((4, 8), np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match="GGUF MoE models are not supported yet"):
        load_checkpoint(str(path))
