"""Quantized weights on the Triton backend (the CUDA path, shared/model/quantized_triton.py):
which backend a device gets, GGUF blocks in its layout bit for bit, its start-up check and
fallback, and a model and the engine multiplying through the dequantizing matmuls.

No GPU here: the kernels run in Triton's interpreter (TRITON_INTERPRET=1, set before Triton is
imported) and SPLITSERVE_QUANTIZED_BACKEND=triton forces the Triton path on the CPU, as
SPLITSERVE_ATTENTION_BACKEND does for attention. `TRITON_INTERPRET=0 pytest
tests/test_quantized_triton.py` runs the same checks with the layers on a GPU (compared with
the CPU backend on the CPU). The kernels themselves are checked against their references in
tests/test_kernels_dequant.py.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

pytest.importorskip("triton")  # Triton wheels exist for Linux only

import logging  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import gguf  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
from gguf.quants import dequantize  # noqa: E402

from splitserve.engine.model.gguf_blocks import read_blocks  # noqa: E402
from splitserve.engine.model.quantization import (  # noqa: E402
    QuantizedEmbedding,
    effective_method,
    pack_weight,
)
from splitserve.engine.model.quantized_linear import quantize, quantized_matmul  # noqa: E402
from splitserve.engine.model.quantized_triton import (  # noqa: E402
    BACKEND_ENV,
    Int4GroupWeight,
    TritonInt8Weight,
    quantize_for_triton,
    select_quantized_backend,
    slow_kernel_note,
    triton_kernel_problem,
    triton_slowness,
)

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
DEVICE = CUDA if os.environ["TRITON_INTERPRET"] == "0" else CPU
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _random(*shape: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator) + 0.1  # never zeros, and not centred


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


@pytest.fixture
def fresh_check():
    """The start-up check is cached per device; these tests change what it finds."""
    triton_kernel_problem.cache_clear()
    yield
    triton_kernel_problem.cache_clear()


# ---- which backend ---------------------------------------------------------------------------


def test_backend_follows_the_device_and_the_override(monkeypatch):
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    assert select_quantized_backend(CPU) == "torch"
    assert select_quantized_backend(CUDA) == "triton"
    assert select_quantized_backend(torch.device("cuda:1")) == "triton"
    with pytest.raises(ValueError, match="CPU or CUDA only, device is meta"):
        select_quantized_backend(torch.device("meta"))
    monkeypatch.setenv(BACKEND_ENV, "triton")
    assert select_quantized_backend(CPU) == "triton"
    monkeypatch.setenv(BACKEND_ENV, "torch")
    assert select_quantized_backend(CPU) == "torch"
    with pytest.raises(ValueError, match="CPU only, device is cuda"):
        select_quantized_backend(CUDA)
    monkeypatch.setenv(BACKEND_ENV, "cuda")
    with pytest.raises(ValueError, match="got 'cuda'"):
        select_quantized_backend(CPU)


# ---- layouts ---------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["Q4_0", "Q4_1"])
def test_gguf_blocks_keep_their_bytes_and_numbers(kind):
    """A Q4 block's 16 nibble bytes are the layout's bytes, its float16 d (and m) the scale and
    minimum exactly; the product equals one with gguf's own dequantization."""
    qtype = gguf.GGMLQuantizationType[kind]
    values = _random(8, 96, seed=1).numpy()
    raw = gguf.quants.quantize(values, qtype)

    class _Tensor:  # the fields read_blocks reads, as GGUFReader gives them
        name, tensor_type, shape, data = kind, qtype, [96, 8], raw

    packed = pack_weight(read_blocks(_Tensor), "gguf", "triton", DEVICE)
    assert isinstance(packed, Int4GroupWeight) and packed.packed.device.type == DEVICE.type
    header = 2 if kind == "Q4_0" else 4
    blocks = raw.reshape(8, 3, header + 16)
    assert np.array_equal(packed.packed.cpu().numpy(), blocks[..., header:].reshape(8, 48))
    d = blocks[..., :2].copy().view(np.float16)[..., 0]
    assert np.array_equal(packed.scales.cpu().numpy(), d)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0] if kind == "Q4_1" else -8 * d
    assert np.array_equal(packed.minimums.cpu().numpy(), m)
    want_weight = torch.from_numpy(dequantize(raw, qtype).reshape(8, 96)).to(DEVICE)
    assert torch.equal(packed.dequantize(), want_weight)
    x = _random(3, 96, seed=2).to(DEVICE)
    assert _relative_error(packed.matmul(x), x @ want_weight.t()) < 1e-5


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_triton_layout_holds_what_the_cpu_layout_holds(method):
    """Same quantization, other layout: the products agree with the CPU path's (which rounds
    activations and scales to bfloat16), and exactly with the layout's own dequantization."""
    weight = _random(200, 96, seed=3)
    packed = quantize_for_triton(weight.to(DEVICE), method)
    assert isinstance(packed, TritonInt8Weight if method == "int8" else Int4GroupWeight)
    assert (packed.out_features, packed.in_features) == (200, 96)
    x = _random(5, 96, seed=4)
    got = packed.matmul(x.to(DEVICE))
    want = x.to(DEVICE) @ packed.dequantize(torch.float32)[:, :96].t()
    assert _relative_error(got, want) < 1e-5
    assert _relative_error(got.cpu(), quantized_matmul(x, quantize(weight, method))) < 0.02


def test_int4_layout_is_a_quarter_of_bfloat16_plus_its_scales():
    packed = quantize_for_triton(_random(64, 1024, seed=5), "int4")
    # 4 bits per weight, and a float16 scale and minimum per 32 weights (1 bit per weight).
    assert packed.nbytes == 64 * 1024 * 5 // 8


# ---- start-up check --------------------------------------------------------------------------


def test_start_up_check_passes_in_the_interpreter(monkeypatch, fresh_check):
    monkeypatch.setenv(BACKEND_ENV, "triton")
    assert triton_kernel_problem(DEVICE) is None
    assert effective_method("int4", DEVICE) == "int4"


def test_missing_triton_falls_back_dense_with_a_warning():
    """An image without Triton (blocked from importing, in a fresh interpreter): a CUDA model
    is built dense, loudly; the CPU path does not need Triton at all."""
    code = (
        "import sys; sys.modules['triton'] = None\n"
        "import logging, torch\n"
        "logging.basicConfig(format='%(message)s')\n"
        "from splitserve.engine.model.quantization import effective_method\n"
        "print(effective_method('gguf', torch.device('cuda')))\n"
        "print(effective_method('int8', torch.device('cpu')))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO_ROOT, check=False
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["none", "int8"]
    assert "Triton is not installed" in done.stderr and "no memory is saved" in done.stderr


def test_triton_forced_without_a_gpu_or_the_interpreter_falls_back(
    monkeypatch, caplog, fresh_check
):
    # The kernels' own device check refuses CPU tensors outside the interpreter: the real
    # failure, caught by the start-up check.
    monkeypatch.setenv(BACKEND_ENV, "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with caplog.at_level(logging.WARNING, logger="splitserve.engine.model.quantization"):
        assert effective_method("int8", CPU) == "none"
    assert "need a GPU tensor" in caplog.text


def test_a_kernel_slower_than_dense_is_named_in_a_warning():
    # On CUDA the start-up check times the kernel at one row against dense bfloat16; off CUDA
    # (the interpreter) it measures nothing.
    assert slow_kernel_note("int4", kernel_ms=0.010, dense_ms=0.030) is None
    note = slow_kernel_note("gguf", kernel_ms=0.050, dense_ms=0.030)
    assert "'gguf'" in note and "0.050 ms against 0.030 ms" in note and "not be faster" in note
    assert triton_slowness("int4", CPU) is None


# ---- a model and the engine ------------------------------------------------------------------


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    from splitserve.engine.model.attention import TorchPagedAttention
    from splitserve.engine.model.attention_metadata import AttentionMetadata, PrefillChunk

    arch, num = model.arch, ids.shape[0]
    shape = (arch.num_layers, 2, 2, 16, arch.num_kv_heads, arch.head_dim)
    cache = torch.zeros(shape, device=DEVICE)
    positions = torch.arange(num, device=DEVICE)
    chunk = PrefillChunk(0, num, num, torch.arange(2, device=DEVICE))
    meta = AttentionMetadata(positions, 0, [chunk])
    # PyTorch attention on either device: only the quantized layers are under test here.
    backend = TorchPagedAttention(torch.float32)
    return model(ids.to(DEVICE), positions, cache, meta, backend, positions)


def _build(checkpoint, quantization: str, weights) -> torch.nn.Module:
    from splitserve.engine.model.llama import LlamaForCausalLM

    model = LlamaForCausalLM(checkpoint.architecture, 256, DEVICE, quantization)
    model.materialize(DEVICE, torch.float32)
    model.load_hf_weights(weights)
    return model


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_model_on_the_triton_path_is_its_weights_dequantized(
    make_tiny_hf_checkpoint, monkeypatch, method
):
    """Every packed layer (the untied int8 head included) multiplies through the Triton kernels,
    and the logits equal a dense float32 model holding the same weights dequantized."""
    from splitserve.engine.model.loader import load_checkpoint

    checkpoint = load_checkpoint(make_tiny_hf_checkpoint(tie_word_embeddings=False))
    monkeypatch.setenv(BACKEND_ENV, "triton")
    model = _build(checkpoint, method, checkpoint.weights)
    assert model.quantized_backend == "triton"
    layout = TritonInt8Weight if method == "int8" else Int4GroupWeight
    assert isinstance(model.layers[1].mlp.down_proj.qweight, layout)
    assert isinstance(model.lm_head.qweight, TritonInt8Weight)
    monkeypatch.delenv(BACKEND_ENV)
    restored = {}
    for name, tensor in checkpoint.weights.items():
        is_vocab = name in ("model.embed_tokens.weight", "lm_head.weight")
        if name == "model.embed_tokens.weight":  # a lookup adds its codes' 4-bit refinement
            embedding = QuantizedEmbedding(*tensor.shape, torch.float32)
            embedding.load(tensor)
            tensor = embedding(torch.arange(tensor.shape[0]))
        elif tensor.dim() == 2:
            packed = quantize_for_triton(tensor, "int8" if is_vocab else method)
            tensor = packed.dequantize(torch.float32)[:, : tensor.shape[1]]
        restored[name] = tensor
    dense = _build(checkpoint, "none", restored)
    ids = torch.randint(100, 40000, (12,), generator=torch.Generator().manual_seed(6))
    assert _relative_error(_logits(model, ids), _logits(dense, ids)) < 1e-4


@pytest.mark.slow  # ~14 s in Triton's interpreter; the fast suite is near its 15 minutes
def test_engine_serves_int4_through_the_triton_path(tiny_hf_checkpoint, monkeypatch):
    """The engine on the Triton backend (decode steps of one row, a prefill of several) picks
    the CPU backend's greedy tokens: the same quantization, another layout and kernel."""
    from splitserve import LLM, SamplingParams

    prompt = torch.randint(100, 40000, (9,), generator=torch.Generator().manual_seed(7)).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    tokens = {}
    for backend, device in (("torch", CPU), ("triton", DEVICE)):
        monkeypatch.setenv(BACKEND_ENV, backend)
        llm = LLM(
            tiny_hf_checkpoint,
            quantization="int4",
            kv_cache_bytes=8 * 2**20,
            num_threads=1,
            device=str(device),
        )
        tokens[backend] = llm.generate([prompt], params)[0].outputs[0].token_ids
    assert len(tokens["triton"]) == 5
    assert tokens["triton"] == tokens["torch"]


@pytest.mark.slow  # the shipped model's 30 layers in the interpreter: ~3 min on 2 shared cores
def test_shipped_gguf_on_the_triton_path_is_the_files_weights(smollm2_gguf_path, monkeypatch):
    """The Q4_1 file's blocks, kept as they are and multiplied by the int4 kernel, are its
    weights exactly (float16 d and m, codes bit for bit): the decoder layers' output equals the
    float32 model's (the file dequantized) up to summation order. The embedding is left out: the
    vocabulary matrix is re-quantized to int8 either way (docs/quantization.md)."""
    from splitserve.engine.model.attention import TorchPagedAttention
    from splitserve.engine.model.attention_metadata import AttentionMetadata, PrefillChunk
    from splitserve.engine.model.loader import load_checkpoint

    monkeypatch.setenv(BACKEND_ENV, "triton")
    blocks = load_checkpoint(smollm2_gguf_path, keep_quantized=True)
    model = _build(blocks, "gguf", blocks.weights)
    assert isinstance(model.layers[0].self_attn.qkv_proj.qweight, Int4GroupWeight)
    del blocks
    monkeypatch.delenv(BACKEND_ENV)
    floats = load_checkpoint(smollm2_gguf_path)
    dense = _build(floats, "none", floats.weights)
    num = 6
    ids = torch.randint(100, 40000, (num,), generator=torch.Generator().manual_seed(8))
    arch = model.arch
    outputs = []
    for each in (model, dense):
        shape = (arch.num_layers, 2, 1, 16, arch.num_kv_heads, arch.head_dim)
        cache = torch.zeros(shape, device=DEVICE)
        positions = torch.arange(num, device=DEVICE)
        chunk = PrefillChunk(0, num, num, torch.arange(1, device=DEVICE))
        meta = AttentionMetadata(positions, 0, [chunk])
        hidden = dense.embed_tokens(ids.to(DEVICE))  # the same input for both
        backend = TorchPagedAttention(torch.float32)
        with torch.inference_mode():
            outputs.append(each.run_layers(hidden, positions, cache, meta, backend))
    assert _relative_error(outputs[0], outputs[1]) < 1e-4
