"""The dense families beyond Llama, and Qwen3-MoE, on random tiny checkpoints that transformers
builds from its own config and model classes (docs/models.md):

- greedy 12 tokens equal transformers' `generate`, and the top-5 logprobs of every step its
  scores, through chunked prefill (a 16-token budget) and then again through a prefix-cache hit;
- each special part is one the reference depends on (turned off, transformers' logprobs move
  by far more than the tolerance), so the equality above tests it;
- a one-layer self-speculative draft and preemption (a pool too small) keep Gemma 2's tokens;
- a Qwen3 and a Gemma 2 disaggregated request (prefill engine exports pages, decode engine
  takes them) equal the colocated one;
- what is not supported is refused with a message that names it.

The configs set every special part: q/k/v biases (random, not zeros), q/k norms with random
weights, head_dim apart from hidden / heads, windows shorter than the prompt (some not a
multiple of the block size), attention and final logit soft-capping, longrope factors, Gemma 3's
local rotary base. q and k projections are scaled up so attention is far from uniform: random
tiny models barely look at position otherwise, and a wrong window would go unseen.

torch runs single-threaded (see tests/test_engine_api.py for why).
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable
from typing import Any

import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.engine.model.cpu_paths import cpu_report
from splitserve.kernels.cpu import load as load_cpu_kernels
from tests.test_disaggregation_engine import disaggregated

MAX_TOKENS = 12
TOP = 5
KV_BYTES = 8 * 2**20
EOS_TOKEN_ID = 2
CHUNK = 16  # max_num_batched_tokens: the long prompts take several chunks
TOLERANCE = 2e-5

_COMMON = dict(
    vocab_size=512,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=4096,
    bos_token_id=1,
    eos_token_id=EOS_TOKEN_ID,
)
_LONGROPE = {
    "rope_type": "longrope",
    "short_factor": [1.0 + 0.3 * i for i in range(8)],
    "long_factor": [4.0] * 8,
}

# family -> (transformers config class, its options, {what a special part is: the options
# that turn it off}).
FAMILIES: dict[str, tuple[str, dict[str, Any], dict[str, dict[str, Any]]]] = {
    "qwen2": ("Qwen2Config", {}, {}),
    "qwen3": ("Qwen3Config", {"head_dim": 24}, {}),
    "mistral": ("MistralConfig", {"sliding_window": 8}, {"window": {"sliding_window": 4096}}),
    "phi3": (
        "Phi3Config",
        {
            "pad_token_id": 0,
            "sliding_window": 20,
            "original_max_position_embeddings": 1024,
            "rope_scaling": _LONGROPE,
        },
        {
            "window": {"sliding_window": 4096},
            "longrope": {"rope_parameters": {"short_factor": [1.0] * 8}},
        },
    ),
    "gemma2": (
        "Gemma2Config",
        {
            "head_dim": 16,
            "sliding_window": 8,
            "attn_logit_softcapping": 3.0,
            "final_logit_softcapping": 2.0,
            "query_pre_attn_scalar": 24,
        },
        {
            "window": {"sliding_window": 4096},
            "attention cap": {"attn_logit_softcapping": None},
            "final cap": {"final_logit_softcapping": None},
        },
    ),
    "gemma3_text": (
        "Gemma3TextConfig",
        {
            "head_dim": 16,
            "sliding_window": 12,
            "layer_types": ["sliding_attention", "full_attention"],
            "rope_local_base_freq": 50.0,
        },
        {
            "window": {"sliding_window": 4096},
            "local rope": {"rope_parameters": {"sliding_attention": {"rope_theta": 1e6}}},
        },
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32},
        {},
    ),
}


def _hf_model(config_class: str, options: dict[str, Any]) -> Any:
    import transformers

    config = getattr(transformers, config_class)(**{**_COMMON, **options})
    return transformers.AutoModelForCausalLM.from_config(config).float().eval()


def _randomize(model: Any) -> None:
    """Parts whose default initialisation would hide them: biases and norms (zeros and ones),
    and q/k scaled so that attention depends on position."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.3)
            elif "norm" in name:
                param.add_(torch.randn_like(param) * 0.3)
            elif name.endswith(("q_proj.weight", "k_proj.weight", "qkv_proj.weight")):
                param.mul_(12.0)


@pytest.fixture(scope="module")
def make_checkpoint(
    tmp_path_factory: pytest.TempPathFactory, hf_reference_tokenizer: Any
) -> Callable[[str], str]:
    built: dict[str, str] = {}

    def make(family: str) -> str:
        if family not in built:
            config_class, options, _ = FAMILIES[family]
            torch.manual_seed(0)
            model = _hf_model(config_class, options)
            _randomize(model)
            directory = str(tmp_path_factory.mktemp(family))
            model.save_pretrained(directory)
            hf_reference_tokenizer.save_pretrained(directory)
            built[family] = directory
        return built[family]

    return make


def _prompts() -> list[list[int]]:
    """A short prompt, a long one (windows are shorter), and one sharing its first 32 tokens."""
    long = [(7 * i + 3) % 500 + 3 for i in range(45)]
    return [[5, 9, 11], long, long[:32] + [(11 * i) % 400 + 50 for i in range(9)]]


def _reference(
    directory: str,
    prompt: list[int],
    overrides: dict[str, Any] | None = None,
    max_new_tokens: int = MAX_TOKENS,
    eos_token_id: int | None = EOS_TOKEN_ID,
):
    """(greedy tokens up to EOS, [step][vocab] log_softmax of each step's logits); with
    eos_token_id None, all max_new_tokens of them (an engine run with ignore_eos)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    if overrides:
        config = model.config
        for key, value in overrides.items():
            if key == "rope_parameters":  # merged: per layer type (Gemma 3) or whole
                for sub, params in value.items():
                    if isinstance(params, dict):
                        config.rope_parameters[sub].update(params)
                    else:
                        config.rope_parameters[sub] = params
            else:
                setattr(config, key, value)
        changed = type(model)(config).eval()
        changed.load_state_dict(model.state_dict())
        model = changed
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos_token_id,
            pad_token_id=EOS_TOKEN_ID,
            output_scores=True,
            return_dict_in_generate=True,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    if eos_token_id is not None and eos_token_id in tokens:
        tokens = tokens[: tokens.index(eos_token_id) + 1]
    logprobs = [torch.log_softmax(step[0].float(), dim=-1) for step in out.scores]
    return tokens, logprobs


def _assert_matches(output: Any, tokens: list[int], logprobs: list[torch.Tensor]) -> None:
    assert output.token_ids == tokens
    for step, entry in enumerate(output.logprobs):
        expected = logprobs[step]
        assert entry.top[0][0] == int(expected.argmax())
        for token_id, value in entry.top:
            assert value == pytest.approx(expected[token_id].item(), abs=TOLERANCE)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_and_logprobs_match_transformers(single_thread, make_checkpoint, family):
    directory = make_checkpoint(family)
    llm = LLM(directory, kv_cache_bytes=KV_BYTES, max_num_batched_tokens=CHUNK)
    assert llm.engine.architecture.name == family
    prompts = _prompts()
    assert max(len(p) for p in prompts) > 2 * CHUNK
    references = [_reference(directory, prompt) for prompt in prompts]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=TOP)
    for prompt, (tokens, logprobs) in zip(prompts, references):  # one at a time: no hit yet
        _assert_matches(llm.generate([prompt], params)[0].outputs[0], tokens, logprobs)
    assert llm.stats().prefix_cache_hit_tokens >= 32, "the third prompt reuses the second's"
    hits = llm.stats().prefix_cache_hit_tokens
    results = llm.generate(prompts, params)  # batched, every prompt a prefix hit now
    assert llm.stats().prefix_cache_hit_tokens - hits >= 2 * 32
    for result, (tokens, logprobs) in zip(results, references):
        _assert_matches(result.outputs[0], tokens, logprobs)


def cpu_kernels_loaded() -> bool:
    return load_cpu_kernels() is not None


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1",
                    reason="the Triton path runs in Triton's interpreter on the CPU")  # fmt: skip
@pytest.mark.parametrize("family", ["mistral", "gemma2"])
def test_the_triton_path_serves_window_and_capped_layers(
    single_thread, make_checkpoint, monkeypatch, family
):
    """The Triton kernels take the windows (8 tokens, shorter than the prompts and chunks)
    and Gemma 2's soft-capping themselves: greedy tokens and logprobs equal transformers with
    no layer falling back to masked_attention.py."""
    from splitserve.engine.model import llama
    from splitserve.engine.model.triton_attention import TritonPagedAttention

    def no_fallback(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("a window or capped layer fell back to masked_attention")

    monkeypatch.setenv("SPLITSERVE_ATTENTION_BACKEND", "triton")
    monkeypatch.setenv("SPLITSERVE_FUSED_DECODE", "0")  # decode steps through the kernels too
    monkeypatch.setattr(llama, "masked_attention", no_fallback)
    directory = make_checkpoint(family)
    llm = LLM(directory, kv_cache_bytes=KV_BYTES, max_num_batched_tokens=CHUNK)
    assert isinstance(llm.engine.runner.backend, TritonPagedAttention)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=TOP)
    for prompt in _prompts()[:2]:
        tokens, logprobs = _reference(directory, prompt)
        _assert_matches(llm.generate([prompt], params)[0].outputs[0], tokens, logprobs)


SPECIAL_PARTS = [(family, part) for family, spec in FAMILIES.items() for part in spec[2]]


@pytest.mark.parametrize(("family", "part"), SPECIAL_PARTS)
def test_each_special_part_changes_the_reference(make_checkpoint, family, part):
    """Without the part transformers' logprobs move far past the tolerance: the equality
    test above would catch an engine that skipped it."""
    directory = make_checkpoint(family)
    prompt = _prompts()[1]
    _, logprobs = _reference(directory, prompt)
    _, without = _reference(directory, prompt, FAMILIES[family][2][part])
    assert (logprobs[0] - without[0]).abs().max() > 100 * TOLERANCE


def test_architecture_reads_each_part(make_checkpoint):
    archs = {family: LLM(make_checkpoint(family), kv_cache_bytes=KV_BYTES) for family in FAMILIES}
    arch = {family: llm.engine.architecture for family, llm in archs.items()}
    assert arch["qwen2"].attention_bias and not arch["qwen3"].attention_bias
    assert (arch["qwen3"].qk_norm, arch["qwen3"].head_dim) == (True, 24)
    assert arch["mistral"].layer_windows == (8, 8)
    assert arch["phi3"].layer_windows == (20, 20)
    assert arch["phi3"].rope_scaling.rope_type == "longrope"
    assert arch["gemma2"].layer_windows == (8, 0)
    assert (arch["gemma2"].attn_logit_softcap, arch["gemma2"].final_logit_softcap) == (3.0, 2.0)
    assert arch["gemma2"].attention_scale == pytest.approx(24**-0.5)
    assert arch["gemma2"].embedding_multiplier == pytest.approx(8.0)
    assert arch["gemma3_text"].layer_windows == (12, 0)
    assert arch["gemma3_text"].local_rope_theta == 50.0
    assert arch["qwen3_moe"].moe is not None and arch["qwen3_moe"].qk_norm
    # Windows, Qwen2's q/k/v biases, q/k norms and Gemma's parts are in the C++ decode layers
    # (every dense family here decodes through them in float32, so the greedy test above
    # checks them against transformers); mixture-of-experts is not: Qwen3-MoE keeps the
    # Python layers.
    fused = {family for family, llm in archs.items() if llm.engine.runner.model.fused_decode}
    dense = {"mistral", "phi3", "qwen2", "qwen3", "gemma2", "gemma3_text"}
    assert fused == (dense if cpu_kernels_loaded() else set())
    paths = cpu_report()["model_families"]
    assert set(FAMILIES) <= set(paths)
    assert "mixture-of-experts" in paths["qwen3_moe"]
    for family in dense:
        assert paths[family].startswith("fused") == cpu_kernels_loaded()


@pytest.mark.parametrize("family", ["qwen3", "gemma2"])
def test_disaggregated_equals_colocated(single_thread, make_checkpoint, family):
    """Qwen3's q/k norms; Gemma 2's window layers (8 tokens, shorter than the prompts) beside
    global ones and its soft-capping, with pages that hold both kinds of layer."""
    assert_disaggregated_equals_colocated(make_checkpoint(family))


_SLOW_TP_FAMILIES = ("gemma3_text", "qwen2", "phi3", "mistral")  # make test-slow


@pytest.mark.parametrize(
    "family",
    ["qwen3", "gemma2"] + [pytest.param(f, marks=pytest.mark.slow) for f in _SLOW_TP_FAMILIES],
)
def test_tensor_parallel_matches_transformers(make_checkpoint, family):
    """Two ranks, each with two of the four query heads and one of the two KV heads: q/k
    norms per head_dim, Gemma's norms per hidden, biases per head, windows and caps per layer
    all hold on a rank's share."""
    directory = make_checkpoint(family)
    options = {"kv_cache_bytes": KV_BYTES, "max_num_batched_tokens": CHUNK}
    llm = LLM(directory, tensor_parallel_size=2, num_threads=1, adaptive_threads=False, **options)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=TOP)
    try:
        for prompt in _prompts():
            tokens, logprobs = _reference(directory, prompt)
            _assert_matches(llm.generate([prompt], params)[0].outputs[0], tokens, logprobs)
    finally:
        llm.close()


def assert_disaggregated_equals_colocated(directory: str, **engine_options: Any) -> None:
    """Each prompt prefilled by one engine and decoded by another gives the tokens and top
    logprobs of one engine alone, and both engines end with every block free."""
    options = {"kv_cache_bytes": KV_BYTES, "max_num_batched_tokens": CHUNK, **engine_options}
    reference, prefill, decode = (LLM(directory, **options) for _ in range(3))
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=2)
    for i, prompt in enumerate(_prompts()):
        expected = reference.generate([prompt], params)[0].outputs[0]
        _, got = disaggregated(prefill.engine, decode.engine, f"pd-{i}", prompt, params)
        assert got.token_ids == expected.token_ids
        for entry, expected_entry in zip(got.logprobs, expected.logprobs, strict=True):
            assert [t for t, _ in entry.top] == [t for t, _ in expected_entry.top]
            values = [v for _, v in expected_entry.top]
            assert [v for _, v in entry.top] == pytest.approx(values, abs=TOLERANCE)
    assert decode.stats().num_kv_blocks_free == decode.stats().num_kv_blocks_total
    assert prefill.stats().num_kv_blocks_free == prefill.stats().num_kv_blocks_total


@pytest.mark.parametrize(
    ("model_type", "setting", "message"),
    [
        ("gpt_oss", {}, "unsupported model_type 'gpt_oss'"),
        ("gemma2", {"hidden_activation": "relu"}, "hidden_activation"),
        ("qwen3", {"attention_bias": True}, "attention_bias"),
        ("phi3", {"partial_rotary_factor": 0.5}, "partial_rotary_factor"),
        ("gemma3_text", {"layer_types": ["chunked_attention"] * 2}, "layer_types"),
    ],
)
def test_unsupported_settings_are_refused(make_checkpoint, tmp_path, model_type, setting, message):
    source = make_checkpoint("qwen3" if model_type == "gpt_oss" else model_type)
    for name in os.listdir(source):
        os.symlink(os.path.join(source, name), tmp_path / name)
    with open(os.path.join(source, "config.json")) as f:
        config = json.load(f)
    config.update(setting, model_type=model_type)
    os.unlink(tmp_path / "config.json")
    with open(tmp_path / "config.json", "w") as f:
        json.dump(config, f)
    with pytest.raises(ValueError, match=message):
        LLM(str(tmp_path), kv_cache_bytes=KV_BYTES)


def test_pipeline_stages_keep_their_layers_windows(make_checkpoint):
    from splitserve.engine.parallel.pipeline import PipelineLayout

    arch = LLM(make_checkpoint("gemma2"), kv_cache_bytes=KV_BYTES).engine.architecture
    stages = [
        PipelineLayout(pp_size=2, rank=rank, num_layers=2).local_arch(arch) for rank in (0, 1)
    ]
    assert [stage.layer_windows for stage in stages] == [(8,), (0,)]


@pytest.mark.parametrize("family", ["gemma2"])
def test_self_speculative_decoding_and_preemption_keep_the_tokens(
    single_thread, make_checkpoint, family
):
    """A one-layer self-draft (Gemma 2's is its window layer) and a pool too small for the
    batch change the schedule only."""
    assert_speculation_and_preemption_keep_the_tokens(make_checkpoint(family))


def assert_speculation_and_preemption_keep_the_tokens(directory: str) -> None:
    """Greedy tokens with a one-layer self-speculative draft, and in a 4-block pool that
    preempts, equal those of a plain engine."""
    prompts = _prompts()
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    plain = LLM(directory, kv_cache_bytes=KV_BYTES, enable_prefix_caching=False)
    expected = [r.outputs[0].token_ids for r in plain.generate(prompts, params)]
    options = {"speculative_method": "self", "speculative_draft_layers": 1}
    speculative = LLM(directory, kv_cache_bytes=KV_BYTES, **options)
    assert [r.outputs[0].token_ids for r in speculative.generate(prompts, params)] == expected
    assert speculative.stats().num_spec_proposed_tokens > 0
    # In one group: with layer groups (Gemma) the window layers' released blocks leave these
    # 4 room enough not to preempt (tests/test_window_groups.py preempts with groups).
    cramped = LLM(
        directory,
        kv_cache_bytes=KV_BYTES,
        num_blocks_override=4,
        enable_prefix_caching=False,
        group_window_layers=False,
    )
    assert [r.outputs[0].token_ids for r in cramped.generate(prompts, params)] == expected
    assert cramped.stats().num_preemptions > 0


def _dense_gguf(directory: str, path: str, arch: str) -> str:
    """The HF checkpoint in `directory` as llama.cpp's converter writes a qwen2, qwen3 or
    qwen3moe file (experts stacked):
    Hugging Face's tensor order (no Q/K row permutation: llama.cpp's rotary for these is
    rotate-half too), float32, a tiny tokenizer whose EOS is the checkpoint's."""
    import gguf
    from safetensors.torch import load_file

    from tests.test_loaders import write_decoder_metadata

    with open(os.path.join(directory, "config.json")) as f:
        config = json.load(f)
    hf = load_file(os.path.join(directory, "model.safetensors"))
    writer = gguf.GGUFWriter(path, arch=arch)
    write_decoder_metadata(writer, config)
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    # Phi-3's and Gemma's files carry SentencePiece vocabularies, the others byte-level BPE.
    sentencepiece = arch in ("phi3", "gemma2", "gemma3")
    write_tiny_tokenizer(writer, config["vocab_size"], sentencepiece=sentencepiece)
    if arch == "phi3":
        _write_phi3_metadata(writer, config)
    if arch == "gemma2":
        writer.add_sliding_window(config["sliding_window"])
        writer.add_attn_logit_softcapping(config["attn_logit_softcapping"])
        writer.add_final_logit_softcapping(config["final_logit_softcapping"])
    if arch == "gemma3":
        writer.add_sliding_window(config["sliding_window"])
        global_rope = config["rope_parameters"]["full_attention"]
        if global_rope.get("rope_type") == "linear":
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(global_rope["factor"])
    num_experts = config.get("num_experts") or config.get("num_local_experts")
    if num_experts:  # qwen3moe (transformers 5 saves num_experts as num_local_experts)
        writer.add_expert_count(num_experts)
        writer.add_expert_used_count(config["num_experts_per_tok"])
        writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
        hf = _stack_experts(hf, num_experts)
    names = {"embed_tokens": "token_embd", "norm": "output_norm"}
    layer_names = {
        "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
        "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm", "mlp.gate": "ffn_gate_inp",
        "mlp.gate_exps": "ffn_gate_exps", "mlp.up_exps": "ffn_up_exps",
        "mlp.down_exps": "ffn_down_exps", "self_attn.qkv_proj": "attn_qkv",
        "mlp.gate_up_proj": "ffn_up",
    }  # fmt: skip
    if arch in ("gemma2", "gemma3"):  # their own names for the four norms of a layer
        layer_names |= {
            "post_attention_layernorm": "post_attention_norm",
            "pre_feedforward_layernorm": "ffn_norm",
            "post_feedforward_layernorm": "post_ffw_norm",
        }
    for name, tensor in hf.items():
        if arch in ("gemma2", "gemma3") and name.endswith("norm.weight"):
            tensor = tensor + 1.0  # the converter stores Gemma's (1 + w) norms as w + 1
        parts = name.split(".")
        if parts[0] == "lm_head":
            gguf_name = f"output.{parts[-1]}"
        elif parts[1] == "layers":
            gguf_name = f"blk.{parts[2]}.{layer_names['.'.join(parts[3:-1])]}.{parts[-1]}"
        else:
            gguf_name = f"{names[parts[1]]}.{parts[-1]}"
        writer.add_tensor(gguf_name, tensor.float().numpy())
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_tiny_tokenizer(
    writer, vocab_size: int, pre: str = "default", sentencepiece: bool = False
) -> None:
    """A tiny vocabulary of `vocab_size` tokens (prompts use ids up to 500) whose EOS is the
    checkpoints': byte-level with the pre-tokenizer named `pre`, or SentencePiece pieces with
    scores and the 256 byte pieces (ids 3-258) as llama.cpp writes Phi-3's and Gemma's."""
    from tests.test_loaders import _TINY_TOKENS

    if sentencepiece:
        tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{byte:02X}>" for byte in range(256)]
        tokens += ["\u2581", "\u2581a", "a", "b", "ab"]
        tokens += [chr(0x200 + i) for i in range(vocab_size - len(tokens))]
        writer.add_tokenizer_model("llama")
        writer.add_token_scores([-float(token_id) for token_id in range(vocab_size)])
        writer.add_token_types([2, 3, 3] + [6] * 256 + [1] * (vocab_size - 259))
    else:
        tokens = _TINY_TOKENS + [chr(0x200 + i) for i in range(vocab_size - 256)]
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre(pre)
        writer.add_token_types([3, 3, 3] + [1] * (len(tokens) - 3))
    writer.add_token_list(tokens)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(EOS_TOKEN_ID)


def _write_phi3_metadata(writer, config: dict) -> None:
    """What llama.cpp's converter adds for Phi-3: the window, and for longrope the original
    context length, the attention factor and the two factor lists as tensors."""
    import numpy as np

    writer.add_sliding_window(config["sliding_window"])
    rope = config.get("rope_parameters") or config.get("rope_scaling") or {}
    if rope.get("rope_type") != "longrope":
        return
    original = (
        config.get("original_max_position_embeddings") or rope["original_max_position_embeddings"]
    )
    scale = config["max_position_embeddings"] / original
    writer.add_rope_scaling_orig_ctx_len(original)
    writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)))
    writer.add_tensor("rope_factors_long.weight", np.array(rope["long_factor"], np.float32))
    writer.add_tensor("rope_factors_short.weight", np.array(rope["short_factor"], np.float32))


def _stack_experts(hf: dict, num_experts: int) -> dict:
    """Each layer's experts in one tensor per matrix, as llama.cpp stores them:
    mlp.{gate,up,down}_exps.weight [E, out, in]."""
    out = {}
    for name, tensor in hf.items():
        if ".mlp.experts." not in name:
            out[name] = tensor
            continue
        prefix, rest = name.split(".mlp.experts.")
        expert, proj = rest.split(".")[:2]
        if expert == "0":
            part = proj.removesuffix("_proj")
            experts = [hf[f"{prefix}.mlp.experts.{e}.{proj}.weight"] for e in range(num_experts)]
            out[f"{prefix}.mlp.{part}_exps.weight"] = torch.stack(experts)
    return out


@pytest.fixture(scope="module")
def qwen3_moe_renormalised(tmp_path_factory: pytest.TempPathFactory, hf_reference_tokenizer):
    """A Qwen3-MoE checkpoint that renormalises its top-k weights, as llama.cpp's qwen3moe
    graph always does (transformers' GGUF reader sets the same for it)."""
    config_class, options, _ = FAMILIES["qwen3_moe"]
    torch.manual_seed(0)
    model = _hf_model(config_class, {**options, "norm_topk_prob": True})
    _randomize(model)
    directory = str(tmp_path_factory.mktemp("qwen3_moe_norm"))
    model.save_pretrained(directory)
    hf_reference_tokenizer.save_pretrained(directory)
    return directory


@pytest.mark.parametrize(("family", "arch"), [("qwen2", "qwen2"), ("qwen3", "qwen3"),
                                              ("qwen3_moe", "qwen3moe")])  # fmt: skip
def test_a_qwen_gguf_file_serves_as_its_hf_directory(
    single_thread, make_checkpoint, qwen3_moe_renormalised, tmp_path, family, arch
):
    """llama.cpp's qwen2, qwen3 and qwen3moe architectures from GGUF: the biases, q/k norms
    and stacked experts read, greedy tokens and top logprobs equal transformers' on the same
    weights."""
    directory = qwen3_moe_renormalised if family == "qwen3_moe" else make_checkpoint(family)
    path = _dense_gguf(directory, str(tmp_path / f"{family}.gguf"), arch)
    llm = LLM(path, kv_cache_bytes=KV_BYTES, max_num_batched_tokens=CHUNK)
    arch = llm.engine.architecture
    assert (arch.attention_bias, arch.qk_norm) == (family == "qwen2", family != "qwen2")
    assert (arch.moe is not None) == (family == "qwen3_moe")
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=TOP)
    for prompt in _prompts()[:2]:
        tokens, logprobs = _reference(directory, prompt)
        _assert_matches(llm.generate([prompt], params)[0].outputs[0], tokens, logprobs)


def test_a_phi3_gguf_file_serves_as_its_hf_directory(single_thread, make_checkpoint, tmp_path):
    """llama.cpp's phi3 architecture: fused q/k/v and gate/up split, the window and longrope
    read from the file's metadata and factor tensors; the architecture is the HF directory's,
    and greedy tokens and top logprobs (prompts longer than the 20-token window) equal
    transformers' on the same weights."""
    directory = make_checkpoint("phi3")
    path = _dense_gguf(directory, str(tmp_path / "phi3.gguf"), "phi3")
    llm = LLM(path, kv_cache_bytes=KV_BYTES, max_num_batched_tokens=CHUNK)
    from_gguf = llm.engine.architecture
    from_hf = LLM(directory, kv_cache_bytes=KV_BYTES).engine.architecture
    assert from_gguf.layer_windows == from_hf.layer_windows == (20, 20)
    gguf_rope, hf_rope = from_gguf.rope_scaling, from_hf.rope_scaling
    assert gguf_rope.rope_type == hf_rope.rope_type == "longrope"
    assert gguf_rope.factor == hf_rope.factor
    assert gguf_rope.original_max_position_embeddings == hf_rope.original_max_position_embeddings
    # The file holds the factors and the attention factor in float32.
    for field in ("short_factor", "long_factor", "attention_factor"):
        assert getattr(gguf_rope, field) == pytest.approx(getattr(hf_rope, field), rel=1e-6)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=TOP)
    for prompt in _prompts()[:2]:
        tokens, logprobs = _reference(directory, prompt)
        _assert_matches(llm.generate([prompt], params)[0].outputs[0], tokens, logprobs)
    with pytest.raises(ValueError, match="phi3 file's q/k/v"):
        LLM(path, kv_cache_bytes=KV_BYTES, quantization="gguf")


@pytest.fixture(scope="module")
def gemma3_as_llama_cpp_runs_it(tmp_path_factory: pytest.TempPathFactory, hf_reference_tokenizer):
    """A Gemma 3 checkpoint with the choices llama.cpp's gemma3 graph fixes: six layers with
    Hugging Face's default pattern (the sixth global), the window layers' rotary base 10,000,
    queries scaled by 1 / sqrt(head_dim); the global layers' rotary linearly scaled, as the
    4B-27B models' are."""
    config_class, options, _ = FAMILIES["gemma3_text"]
    options = {k: v for k, v in options.items() if k not in ("layer_types", "rope_local_base_freq")}
    rope = {
        "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
        "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
    }
    torch.manual_seed(0)
    model = _hf_model(
        config_class,
        {**options, "num_hidden_layers": 6, "query_pre_attn_scalar": 16, "rope_parameters": rope},
    )
    _randomize(model)
    directory = str(tmp_path_factory.mktemp("gemma3_gguf"))
    model.save_pretrained(directory)
    hf_reference_tokenizer.save_pretrained(directory)
    return directory


def test_a_gemma3_gguf_file_serves_as_its_hf_directory(
    single_thread, gemma3_as_llama_cpp_runs_it, tmp_path
):
    """llama.cpp's gemma3 architecture: q/k norms and the four norms of a layer (w + 1 as
    stored), a window on five layers of six, the window layers' own rotary base and the global
    layers' linear scaling, no soft-caps: the architecture is the HF directory's, and greedy
    tokens and top logprobs equal transformers'."""
    directory = gemma3_as_llama_cpp_runs_it
    path = _dense_gguf(directory, str(tmp_path / "gemma3.gguf"), "gemma3")
    llm = LLM(path, kv_cache_bytes=KV_BYTES, max_num_batched_tokens=CHUNK)
    from_gguf = llm.engine.architecture
    from_hf = LLM(directory, kv_cache_bytes=KV_BYTES).engine.architecture
    for field in ("layer_windows", "attn_logit_softcap", "final_logit_softcap", "qk_norm",
                  "embedding_multiplier", "sandwich_norms", "hidden_act", "local_rope_theta",
                  "rope_theta", "rope_scaling"):  # fmt: skip
        assert getattr(from_gguf, field) == getattr(from_hf, field), field
    assert from_gguf.attention_scale == pytest.approx(from_hf.attention_scale)
    assert from_gguf.layer_windows == (12, 12, 12, 12, 12, 0)
    assert from_gguf.rope_scaling.rope_type == "linear"
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=TOP)
    for prompt in _prompts()[:2]:
        tokens, logprobs = _reference(directory, prompt)
        _assert_matches(llm.generate([prompt], params)[0].outputs[0], tokens, logprobs)


@pytest.fixture(scope="module")
def gemma2_head_dim_scaled(tmp_path_factory: pytest.TempPathFactory, hf_reference_tokenizer):
    """A Gemma 2 checkpoint whose queries are scaled by 1 / sqrt(head_dim), as llama.cpp scales
    every gemma2 model but the 27B (a GGUF file has no query_pre_attn_scalar)."""
    config_class, options, _ = FAMILIES["gemma2"]
    torch.manual_seed(0)
    model = _hf_model(config_class, {**options, "query_pre_attn_scalar": options["head_dim"]})
    _randomize(model)
    directory = str(tmp_path_factory.mktemp("gemma2_gguf"))
    model.save_pretrained(directory)
    hf_reference_tokenizer.save_pretrained(directory)
    return directory


def test_a_gemma2_gguf_file_serves_as_its_hf_directory(
    single_thread, gemma2_head_dim_scaled, tmp_path
):
    """llama.cpp's gemma2 architecture: the four norms of a layer under their own names (w + 1
    as stored), the window on even layers and both soft-caps from the metadata, the embedding
    scale, GeGLU and the attention scale as llama.cpp sets them: the architecture is the HF
    directory's, and greedy tokens and top logprobs equal transformers'."""
    directory = gemma2_head_dim_scaled
    path = _dense_gguf(directory, str(tmp_path / "gemma2.gguf"), "gemma2")
    llm = LLM(path, kv_cache_bytes=KV_BYTES, max_num_batched_tokens=CHUNK)
    from_gguf = llm.engine.architecture
    from_hf = LLM(directory, kv_cache_bytes=KV_BYTES).engine.architecture
    for field in ("layer_windows", "attn_logit_softcap", "final_logit_softcap",
                  "embedding_multiplier", "sandwich_norms", "hidden_act"):  # fmt: skip
        assert getattr(from_gguf, field) == getattr(from_hf, field), field
    assert from_gguf.attention_scale == pytest.approx(from_hf.attention_scale)
    assert from_gguf.layer_windows == (8, 0)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=TOP)
    for prompt in _prompts()[:2]:
        tokens, logprobs = _reference(directory, prompt)
        _assert_matches(llm.generate([prompt], params)[0].outputs[0], tokens, logprobs)


class _Meta:
    """The two GGUFMetadata calls gemma_fields makes, over a plain dict."""

    def __init__(self, values: dict[str, Any]) -> None:
        self.values = values

    def get(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)

    def require(self, key: str) -> Any:
        return self.values[key]


@pytest.mark.parametrize(
    ("pattern", "windows"),
    [
        (None, (8, 8, 8, 8, 8, 0, 8)),  # llama.cpp's six
        (3, (8, 8, 0, 8, 8, 0, 8)),
        ([True, False, True, True, False, True, True], (8, 0, 8, 8, 0, 8, 8)),
    ],
)
def test_gemma3_window_layers_follow_the_files_pattern(pattern, windows):
    from splitserve.engine.model.gguf_gemma import gemma_fields

    values = {
        "gemma3.embedding_length": 64,
        "gemma3.attention.head_count": 4,
        "gemma3.attention.sliding_window": 8,
    }
    if pattern is not None:
        values["gemma3.attention.sliding_window_pattern"] = pattern
    fields = gemma_fields(_Meta(values), "gemma3", num_layers=7, head_dim=16)  # type: ignore[arg-type]
    assert fields["layer_windows"] == windows
    assert fields["local_rope_theta"] == 10000.0 and "attn_logit_softcap" not in fields
    values["gemma3.attention.sliding_window_pattern"] = [True, False]
    with pytest.raises(ValueError, match="lists 2 layers, the model has 7"):
        gemma_fields(_Meta(values), "gemma3", num_layers=7, head_dim=16)  # type: ignore[arg-type]
