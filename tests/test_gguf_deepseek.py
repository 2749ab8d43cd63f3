"""DeepSeek-V2/V3 from GGUF files (llama.cpp's `deepseek2`, shared/model/gguf_deepseek.py): the
tiny checkpoints of tests/test_mla.py written as llama.cpp's converter writes them (its MLA-era
layout: kv_b split per head into attn_k_b and attn_v_b, head_count_kv 1; and the older one:
attn_kv_b whole), loaded, and held to transformers on the Hugging Face directory: greedy
tokens and top-5 logprobs, through chunked prefill and a prefix hit.

torch runs single-threaded (see tests/test_engine_api.py for why).
"""

from __future__ import annotations

import json
import lzma
import os
from pathlib import Path

import gguf
import pytest
import torch
from safetensors.torch import load_file

from splitserve import LLM, SamplingParams
from splitserve.engine.gguf_file import read_gguf
from splitserve.engine.gguf_metadata import GGUFMetadata
from splitserve.engine.model.gguf_deepseek import deepseek_config
from splitserve.engine.model.gguf_loader import load_gguf
from splitserve.engine.model.hf_deepseek import yarn_scaling
from splitserve.engine.tokenizer import Tokenizer
from tests.test_loaders import write_decoder_metadata
from tests.test_mla import CONFIGS, make_checkpoint  # noqa: F401 (the fixture)
from tests.test_model_families import (
    CHUNK,
    KV_BYTES,
    MAX_TOKENS,
    TOP,
    _assert_matches,
    _prompts,
    _reference,
    write_tiny_tokenizer,
)

_ATTENTION = {
    "self_attn.q_a_proj": "attn_q_a", "self_attn.q_a_layernorm": "attn_q_a_norm",
    "self_attn.q_b_proj": "attn_q_b", "self_attn.q_proj": "attn_q",
    "self_attn.kv_a_proj_with_mqa": "attn_kv_a_mqa", "self_attn.kv_a_layernorm": "attn_kv_a_norm",
    "self_attn.kv_b_proj": "attn_kv_b", "self_attn.o_proj": "attn_output",
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
    "mlp.shared_experts.gate_proj": "ffn_gate_shexp", "mlp.shared_experts.up_proj": "ffn_up_shexp",
    "mlp.shared_experts.down_proj": "ffn_down_shexp", "mlp.gate": "ffn_gate_inp",
}  # fmt: skip
DATA = Path(__file__).parent / "data"
_EXPERTS = {"gate_proj": "ffn_gate_exps", "up_proj": "ffn_up_exps", "down_proj": "ffn_down_exps"}


def _write_metadata(writer: gguf.GGUFWriter, config: dict, mla_layout: bool) -> None:
    """What llama.cpp's DeepseekV2Model writes (shared/model/gguf_deepseek.py); the older
    converter (`mla_layout` False) wrote no expert groups and no gating function."""
    write_decoder_metadata(writer, {**config, "num_key_value_heads": 1 if mla_layout else
                                    config["num_attention_heads"]})  # fmt: skip
    nope, rope = config["qk_nope_head_dim"], config["qk_rope_head_dim"]
    if config.get("q_lora_rank"):
        writer.add_q_lora_rank(config["q_lora_rank"])
    writer.add_kv_lora_rank(config["kv_lora_rank"])
    if mla_layout:
        writer.add_key_length(config["kv_lora_rank"] + rope)
        writer.add_value_length(config["kv_lora_rank"])
        writer.add_key_length_mla(nope + rope)
        writer.add_value_length_mla(config["v_head_dim"])
    else:
        writer.add_key_length(nope + rope)
        writer.add_value_length(config["v_head_dim"])
    writer.add_rope_dimension_count(rope)
    writer.add_leading_dense_block_count(config["first_k_dense_replace"])
    writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
    writer.add_expert_count(config["n_routed_experts"])
    writer.add_expert_used_count(config["num_experts_per_tok"])
    writer.add_expert_shared_count(config["n_shared_experts"])
    writer.add_expert_weights_scale(config["routed_scaling_factor"])
    if config.get("norm_topk_prob"):
        writer.add_expert_weights_norm(True)
    if not mla_layout:
        return
    v3 = config["model_type"] == "deepseek_v3"
    writer.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID if v3 else
                                  gguf.ExpertGatingFuncType.SOFTMAX)  # fmt: skip
    writer.add_expert_group_count(config["n_group"])
    writer.add_expert_group_used_count(config["topk_group"])


def _layer_tensors(layer: str, tensors: dict, config: dict, mla_layout: bool) -> dict:
    """One layer's tensors under llama.cpp's names: experts stacked, kv_b split per head."""
    out = {}
    experts = {}
    for name, tensor in tensors.items():
        module, suffix = name.rsplit(".", 1)
        if module.startswith("mlp.experts."):
            _, _, expert, projection = module.split(".")
            experts.setdefault(projection, {})[int(expert)] = tensor
        elif name == "mlp.gate.e_score_correction_bias":
            out[f"blk.{layer}.exp_probs_b.bias"] = tensor
        elif module == "self_attn.kv_b_proj" and mla_layout:
            heads, rank = config["num_attention_heads"], config["kv_lora_rank"]
            nope = config["qk_nope_head_dim"]
            per_head = tensor.view(heads, nope + config["v_head_dim"], rank)
            out[f"blk.{layer}.attn_k_b.weight"] = per_head[:, :nope].transpose(1, 2)
            out[f"blk.{layer}.attn_v_b.weight"] = per_head[:, nope:]
        else:
            out[f"blk.{layer}.{_ATTENTION[module]}.{suffix}"] = tensor
    for projection, by_expert in experts.items():
        stacked = torch.stack([by_expert[e] for e in range(len(by_expert))])
        out[f"blk.{layer}.{_EXPERTS[projection]}.weight"] = stacked
    return out


def deepseek_gguf(
    directory: str,
    path: str,
    mla_layout: bool = True,
    pre_tokenizer: str = "default",
    gating: int | None = None,
) -> str:
    """The Hugging Face checkpoint in `directory` as llama.cpp's converter writes it (with
    `gating`, that expert_gating_func instead of the model's)."""
    with open(os.path.join(directory, "config.json")) as f:
        config = json.load(f)
    config.setdefault("model_type", "deepseek_v2")
    hf = load_file(os.path.join(directory, "model.safetensors"))
    writer = gguf.GGUFWriter(path, arch="deepseek2")
    _write_metadata(writer, config, mla_layout)
    if gating is not None:
        writer.add_uint32("deepseek2.expert_gating_func", gating)
    write_tiny_tokenizer(writer, config["vocab_size"], pre_tokenizer)
    layers: dict[str, dict] = {}
    for name, tensor in hf.items():
        parts = name.split(".")
        if parts[1] == "layers":
            layers.setdefault(parts[2], {})[".".join(parts[3:])] = tensor
        elif parts[0] == "lm_head":
            writer.add_tensor("output.weight", tensor.float().numpy())
        else:
            top = {"embed_tokens": "token_embd", "norm": "output_norm"}[parts[1]]
            writer.add_tensor(f"{top}.{parts[-1]}", tensor.float().numpy())
    for layer, tensors in layers.items():
        for name, tensor in _layer_tensors(layer, tensors, config, mla_layout).items():
            writer.add_tensor(name, tensor.float().contiguous().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize(
    ("name", "mla_layout"),
    # The older layout with the config it can hold (greedy routing, no groups).
    [("q_lora", True), ("no_q_lora", False), ("no_q_lora", True), ("v3", True)],
    ids=["q_lora", "no_q_lora-legacy", "no_q_lora", "v3"],
)
def test_gguf_files_match_transformers(
    single_thread,
    make_checkpoint,  # noqa: F811 (the fixture imported above)
    tmp_path,
    name,
    mla_layout,
):
    directory = make_checkpoint(name)
    path = deepseek_gguf(directory, str(tmp_path / f"{name}.gguf"), mla_layout)
    loaded = load_gguf(path)
    expected_type = CONFIGS[name].get("model_type", "deepseek_v2")
    assert loaded.architecture.name == expected_type and loaded.architecture.mla is not None
    hf = load_file(os.path.join(directory, "model.safetensors"))
    kv_b = "model.layers.1.self_attn.kv_b_proj.weight"
    assert torch.equal(loaded.weights[kv_b], hf[kv_b])  # put back together exactly
    llm = LLM(path, kv_cache_bytes=KV_BYTES, max_num_batched_tokens=CHUNK)
    prompts = _prompts()
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=TOP)
    references = [_reference(directory, prompt) for prompt in prompts]
    for prompt, (tokens, logprobs) in zip(prompts, references):
        _assert_matches(llm.generate([prompt], params)[0].outputs[0], tokens, logprobs)
    assert llm.stats().prefix_cache_hit_tokens >= 32, "the third prompt reuses the second's"


def test_yarn_reads_as_llama_cpp_computes_it(make_checkpoint, tmp_path):  # noqa: F811
    """The file has yarn's factor, original length and 0.1 * mscale_all_dim; cos and sin then
    go unscaled (mscale = mscale_all_dim) and the softmax takes mscale_all_dim's factor."""
    with open(os.path.join(make_checkpoint("q_lora"), "config.json")) as f:
        config = json.load(f)
    path = str(tmp_path / "yarn.gguf")
    writer = gguf.GGUFWriter(path, arch="deepseek2")
    _write_metadata(writer, {**config, "model_type": "deepseek_v2"}, True)
    writer.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    writer.add_rope_scaling_factor(8.0)
    writer.add_rope_scaling_orig_ctx_len(16)
    writer.add_rope_scaling_yarn_log_mul(0.0707)
    writer.add_tensor("token_embd.weight", torch.zeros(4, 8).numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    read = deepseek_config(GGUFMetadata(read_gguf(path)), config["vocab_size"], True)
    scaling = yarn_scaling(read, read["rope_scaling"])
    assert (scaling.factor, scaling.original_max_position_embeddings) == (8.0, 16)
    assert scaling.attention_factor == pytest.approx(1.0)
    assert scaling.mscale_all_dim == pytest.approx(0.707)
    assert read["qk_nope_head_dim"] == 16 and read["v_head_dim"] == 16  # from the *_mla keys


def test_quantization_gguf_is_refused_by_name(make_checkpoint, tmp_path):  # noqa: F811
    path = deepseek_gguf(make_checkpoint("q_lora"), str(tmp_path / "q.gguf"))
    with pytest.raises(ValueError, match="deepseek2"):
        load_gguf(path, keep_quantized=True)


def test_the_deepseek_llm_pre_tokenizer_gives_llama_cpps_ids(tmp_path):
    """DeepSeek LLM / V2's vocabulary and llama.cpp's 46 test texts with the ids its tokenizer
    gives (tests/data/README.md): ours, from the same GGUF file, gives every one of them."""
    path = tmp_path / "vocab.gguf"
    path.write_bytes(lzma.decompress((DATA / "ggml-vocab-deepseek-llm.gguf.xz").read_bytes()))
    tokenizer = Tokenizer.from_gguf_reader(read_gguf(str(path)))
    texts = (DATA / "ggml-vocab-deepseek-llm.gguf.inp").read_text(encoding="utf-8")
    expected = (DATA / "ggml-vocab-deepseek-llm.gguf.out").read_text().splitlines()
    cases = texts.split("\n__ggml_vocab_test__\n")[: len(expected)]
    assert len(cases) == 46
    for text, ids in zip(cases, expected):
        assert tokenizer.encode(text, add_special_tokens=False) == [int(i) for i in ids.split()]


def test_a_v3_file_loads_with_its_pre_tokenizer(make_checkpoint, tmp_path):  # noqa: F811
    """V3's and R1's files name `deepseek-v3` (tests/test_gguf_tokenizers.py checks its split)."""
    directory = make_checkpoint("no_q_lora")
    path = deepseek_gguf(directory, str(tmp_path / "pre.gguf"), pre_tokenizer="deepseek-v3")
    loaded = load_gguf(path)
    assert loaded.architecture.family == "deepseek_v2"
    assert loaded.tokenizer.vocab_size == 512  # the tiny tokenizer, built


def test_unknown_gating_is_refused_by_name(make_checkpoint, tmp_path):  # noqa: F811
    path = deepseek_gguf(make_checkpoint("no_q_lora"), str(tmp_path / "g.gguf"), False, gating=3)
    with pytest.raises(ValueError, match="expert_gating_func 3 is not supported"):
        load_gguf(path)
