"""Weight-only quantized products against their float references, and GGUF blocks repacked
bit for bit (shared/model/quantized_linear.py, gguf_blocks.py, quantization.py).

Every product runs on fresh random inputs (never zeros) at 1, 3, 16, 64 and 300 rows (int8: our
int8_gemv below 32 rows, int8 x int8 products (or the weight dequantized) from there; int4: our
int4_gemm, two activation passes below 16 rows and one from there, or torch's kernel on weights
torch packed here), with odd sizes that need padding.
"""

from __future__ import annotations

import logging

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize

from splitserve.engine.config import ModelConfig
from splitserve.engine.model import quantized_linear
from splitserve.engine.model.gguf_blocks import BlockQuantized, read_blocks
from splitserve.engine.model.gguf_loader import unpermute_rope_rows
from splitserve.engine.model.quantization import QuantizedEmbedding, effective_method, pack_weight
from splitserve.engine.model.quantized_linear import (
    INT4_ONE_PASS_FROM_ROWS,
    INT8_ACTIVATION_QUANT_FROM_ROWS,
    Int4Weight,
    cpu_kernel_problem,
    int4_from_codes,
    int4_groups,
    int4_kernel_problem,
    int8_activation_levels,
    int8_by_int8_problem,
    int8_dot_products_problem,
    int8_product_problem,
    pack_int4_for_torch,
    quantize,
    quantized_matmul,
)
from splitserve.kernels import cpu as cpu_kernels
from splitserve.kernels import reference as kernel_reference
from splitserve.kernels.cpu.isa import CpuFeatures, cpu_features

ROWS = (1, 3, 16, 64, 300)
# (out, in): SmolLM2's qkv and down shapes, and odd ones (rows padded to 64, columns to 32).
SHAPES = ((960, 576), (576, 1536), (200, 96), (7, 50))
# A product of bfloat16 activations with bfloat16-scaled weights, against float32: relative to
# the largest output, what bfloat16's 8-bit mantissa leaves (a few 2^-9 over hundreds of terms);
# int4_gemm's one int8 activation pass per group of 32 leaves ~0.5% (tests/test_int4_gemm.py).
PRODUCT_TOLERANCE = 0.01
# int8 x int8 products round each activation to a step of max|x| / 127 of its row (half a step
# is 0.4% of the largest input): on random rows that leaves ~1% of the largest output.
ACTIVATION_QUANT_TOLERANCE = 0.02


def _random(*shape: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator) + 0.1  # never zeros, and not centred


def _relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got - want).abs().max() / want.abs().max()).item()


def test_kernels_are_usable_on_this_machine():
    # The start-up check the model runs: None means the fast path is there and answers right.
    assert cpu_kernel_problem("int8") is None
    assert cpu_kernel_problem("int4") is None
    assert effective_method("int4", torch.device("cpu")) == "int4"


@pytest.mark.parametrize("method", ["int8", "int4"])
@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
def test_product_matches_its_float_reference(method, out_features, in_features):
    weight = _random(out_features, in_features, seed=out_features)
    packed = quantize(weight, method)
    reference = packed.dequantize(torch.float32)[:out_features, :in_features]
    for rows in ROWS:
        x = _random(rows, in_features, seed=rows)
        got = quantized_matmul(x, packed)
        assert got.shape == (rows, out_features) and got.dtype == torch.float32
        error = _relative_error(got, x @ reference.t())
        int8_products = method == "int8" and rows >= INT8_ACTIVATION_QUANT_FROM_ROWS
        tolerance = ACTIVATION_QUANT_TOLERANCE if int8_products else PRODUCT_TOLERANCE
        assert error < tolerance, f"{method} {rows} rows: {error:.4f}"


def test_both_paths_are_exercised_by_the_row_counts():
    # Few rows go through the packed kernel; many through int8 x int8 products (int8); int4
    # activations take two passes below INT4_ONE_PASS_FROM_ROWS, one from there.
    assert min(ROWS) < INT8_ACTIVATION_QUANT_FROM_ROWS <= max(ROWS)
    assert min(ROWS) < INT4_ONE_PASS_FROM_ROWS <= max(ROWS)


@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
def test_torchs_int4_kernel_on_weights_torch_packed_here(out_features, in_features):
    # The int4 path without our kernels: torch packs in this process, under its own dispatch,
    # and only torch reads the bytes (the reference comes from the codes, not from them).
    weight = _random(out_features, in_features, seed=out_features + 1)
    codes, scale, minimum = int4_groups(weight)
    packed = pack_int4_for_torch(codes, scale, minimum, in_features)
    groups = codes.float().view(out_features, -1, 32) * scale[..., None] + minimum[..., None]
    reference = groups.view(out_features, -1)[:, :in_features]
    for rows in ROWS:
        x = _random(rows, in_features, seed=rows)
        error = _relative_error(quantized_matmul(x, packed), x @ reference.t())
        assert error < PRODUCT_TOLERANCE, f"{rows} rows: {error:.4f}"
    dequantized = packed.dequantize(torch.float32)[:out_features, :in_features]
    assert _relative_error(dequantized, reference) < 2**-7  # bfloat16 rounding of each weight


@pytest.mark.parametrize(("out_features", "in_features"), SHAPES)
def test_int8_products_of_few_rows_are_the_weight_times_int16_activations(
    out_features, in_features
):
    # kernels/cpu/int8_gemv.cpp: activations rounded to int16 per group of 32 columns, times the
    # int8 codes, scaled per output, at every row count below INT8_ACTIVATION_QUANT_FROM_ROWS
    # (1-4 rows per pass over the weight, then blocks of 4; outputs 4 or 2 at a time with a
    # remainder; a last group shorter than 32 where in_features is not a multiple of 32).
    weight = _random(out_features, in_features, seed=out_features + 2)
    packed = quantize(weight, "int8")
    reference = packed.dequantize(torch.float64)[:, :in_features]
    for rows in (1, 2, 3, 4, 5, 8, 16, INT8_ACTIVATION_QUANT_FROM_ROWS - 1):
        x = _random(rows, in_features, seed=rows + 7)
        got = quantized_matmul(x, packed)
        assert got.shape == (rows, out_features) and got.dtype == torch.float32
        rounded = kernel_reference.int16_group_activations(x)
        error = _relative_error(got.double(), rounded @ reference.t())
        assert error < 1e-6, f"{rows} rows: {error:.2e}"  # float32 sums of exact int32 dots
        # Against float activations: what the rounding to 2^-16 of each group's largest left
        # (about 2e-5), far below bfloat16 activations' 4e-3.
        error = _relative_error(got.double(), x.double() @ reference.t())
        assert error < 1e-4, f"{rows} rows against float activations: {error:.2e}"


def test_int8_products_keep_small_activations_beside_a_large_one():
    # A row with one huge feature (the final norm's output has a few per row). The weight's
    # first group of columns is zero, so the product is what the other groups' small values
    # give: per-group steps keep those at int16 precision, where one step for the whole row
    # (1000 / 32767) would round values of 0.01 to a few levels.
    weight = _random(64, 256, seed=5)
    weight[:, :32] = 0.0
    packed = quantize(weight, "int8")
    x = _random(1, 256, seed=6) * 0.01
    x[0, 3] = 1000.0
    reference = packed.dequantize(torch.float64)[:, :256]
    got = quantized_matmul(x, packed).double()
    assert _relative_error(got, x.double() @ reference.t()) < 1e-4


def test_int8_products_of_few_rows_carry_non_finite_activations_and_tiny_ones():
    # A NaN or an infinity among the activations makes the row's outputs NaN, as a float
    # product's would be (never finite garbage); a group of values too small to scale counts
    # as zeros, the others still count.
    weight = _random(40, 96, seed=9)
    packed = quantize(weight, "int8")
    x = _random(3, 96, seed=10)
    x[0, 50] = float("nan")
    x[1, 2] = float("inf")
    x[2, :32] = 1e-38
    got = quantized_matmul(x, packed)
    assert torch.isnan(got[:2]).all()
    reference = packed.dequantize(torch.float64)[:, :96]
    want = x[2:].double() @ reference.t()
    assert torch.isfinite(got[2]).all()
    assert _relative_error(got[2:].double(), want) < 1e-4


def test_int8_gemv_refuses_what_it_cannot_multiply():
    module = cpu_kernels.load()
    assert module is not None
    packed = quantize(_random(16, 64, seed=1), "int8")
    x = _random(2, 64, seed=2)
    with pytest.raises(RuntimeError, match="float32"):
        module.int8_gemv(x.bfloat16(), packed.codes, packed.scales)
    with pytest.raises(RuntimeError, match="columns"):
        module.int8_gemv(_random(2, 96, seed=3), packed.codes, packed.scales)
    with pytest.raises(RuntimeError, match="scales"):
        module.int8_gemv(x, packed.codes, packed.scales[:8].contiguous())
    with pytest.raises(RuntimeError, match="multiple of 32"):
        module.int8_gemv(x, packed.codes[:, :48].contiguous(), packed.scales)


def test_int8_products_of_few_rows_without_our_kernels_take_torchs(monkeypatch):
    # Where the C++ module is not loaded, torch's packed kernel on bfloat16 activations.
    weight = _random(200, 96, seed=11)
    packed = quantize(weight, "int8")
    x = _random(3, 96, seed=12)
    with_ours = quantized_matmul(x, packed)
    monkeypatch.setattr(cpu_kernels, "load", lambda: None)
    without = quantized_matmul(x, packed)
    reference = x @ packed.dequantize(torch.float32)[:, :96].t()
    assert _relative_error(without, reference) < PRODUCT_TOLERANCE
    assert not torch.equal(without, with_ours)  # bfloat16 activations: a different rounding


def test_int8_products_from_16_rows_multiply_per_row_quantized_activations():
    weight = _random(200, 96, seed=5)
    packed = quantize(weight, "int8")
    x = _random(INT8_ACTIVATION_QUANT_FROM_ROWS, 96, seed=6)
    # The exact integer products of what the path claims to compute, in float64: one pass of
    # 127 codes per sign, or two of 64 where oneDNN's int8 product would saturate
    # (int8_product_problem).
    levels = int8_activation_levels()
    exact, rest = torch.zeros(x.shape[0], 200, dtype=torch.float64), x
    for _ in range(1 if levels == 127 else 2):
        x_scale = rest.abs().amax(dim=1, keepdim=True) / levels
        x_codes = torch.round(rest / x_scale)
        products = x_codes.double() @ packed.codes[:, :96].double().t()
        exact += products * x_scale.double()
        rest = rest - x_codes * x_scale
    exact = exact * packed.scales.double()
    if int8_by_int8_problem() is not None:
        # Without VNNI the product dequantizes the weight instead (the faster path there):
        # weight-only int8, the activations as they are.
        exact = x.double() @ packed.dequantize(torch.float64)[:, :96].t()
    got = quantized_matmul(x, packed)
    assert torch.allclose(got.double(), exact, rtol=1e-5, atol=1e-5)
    # One row a thousand times larger leaves the others' products as they were alone: each
    # row has its own scale.
    loud = x.clone()
    loud[0] *= 1000
    assert torch.equal(quantized_matmul(loud, packed)[1:], got[1:])


def test_int8_by_int8_needs_avx512_vnni_in_the_cpu_flags():
    # Without it torch._int_mm never reaches oneDNN (a reference loop, 14x float32's time on an
    # AVX2 EPYC): an AVX2-only CPU and one with AVX-VNNI alone dequantize the weight instead.
    avx2 = CpuFeatures("x86_64", "AMD EPYC", frozenset({"avx2", "fma", "f16c"}))
    avx_vnni = CpuFeatures("x86_64", "Core", frozenset({"avx2", "fma", "avx_vnni"}))
    vnni = CpuFeatures("x86_64", "Xeon", frozenset({"avx2", "avx512f", "avx512_vnni"}))
    assert "AVX-512 VNNI" in (int8_dot_products_problem(avx2) or "")
    assert int8_dot_products_problem(avx_vnni) is not None
    assert int8_dot_products_problem(vnni) is None
    if int8_dot_products_problem(cpu_features()) is not None:
        assert int8_by_int8_problem() is not None


def test_int8_products_are_exact_where_onednn_would_saturate():
    # Full-range codes (127) in both operands: oneDNN without VNNI saturates them, so there
    # the activations take 64 codes per sign; either way the integer product must be exact.
    levels = int8_activation_levels()
    assert (levels == 127) == (int8_product_problem() is None)
    generator = torch.Generator().manual_seed(11)
    codes = torch.randint(-127, 128, (96, 200), generator=generator, dtype=torch.int32)
    x_codes = torch.randint(-levels, levels + 1, (40, 200), generator=generator, dtype=torch.int32)
    got = quantized_linear._int8_codes_product(
        x_codes.to(torch.int8), codes.to(torch.int8), levels
    )
    assert torch.equal(got.long(), x_codes.long() @ codes.long().t())


def test_two_activation_passes_leave_the_weight_only_product():
    weight = _random(200, 96, seed=7)
    packed = quantize(weight, "int8")
    x = _random(INT8_ACTIVATION_QUANT_FROM_ROWS, 96, seed=8)
    x[:, 3] *= 40  # one large feature per row, as qkv's and down's inputs have
    weight_only = x @ packed.dequantize(torch.float32)[:, :96].t()
    one_pass = _relative_error(quantized_matmul(x, packed, activation_passes=1), weight_only)
    two_passes = _relative_error(quantized_matmul(x, packed, activation_passes=2), weight_only)
    assert two_passes < 1e-3, two_passes
    if int8_by_int8_problem() is not None:  # the weight is dequantized: passes change nothing
        assert one_pass == two_passes
    else:
        assert one_pass > 1e-3 and two_passes < one_pass / 50, (one_pass, two_passes)


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_quantization_error_is_what_the_format_allows(method):
    weight = _random(256, 256, seed=1)
    restored = quantize(weight, method).dequantize(torch.float32)
    # int8: half a step of max|w|/127 per row; int4: half a step of (max-min)/15 per group of
    # 32, plus bfloat16 rounding of the scales.
    bound = 0.5 / 127 + 2**-8 if method == "int8" else 0.5 / 15 * 2 + 2**-7
    assert _relative_error(restored, weight) < bound


@pytest.mark.skipif(int4_kernel_problem() is not None, reason=f"{int4_kernel_problem()}")
def test_int4_codes_read_back_from_the_kernels_layout():
    codes = torch.randint(0, 16, (128, 64), generator=torch.Generator().manual_seed(2))
    scale = (torch.rand(128, 2) + 0.5).half().float()
    packed = int4_from_codes(codes.to(torch.uint8), scale, -8 * scale, in_features=64)
    assert torch.equal(packed.codes(), codes.to(torch.uint8))
    # The kernel itself, fed the identity, gives the weight it holds: the layout we read is
    # the one it reads (x = 1 quantizes to 127 steps of 1/127, exact but for float rounding).
    from_kernel = quantized_matmul(torch.eye(64), packed).t()
    assert _relative_error(from_kernel, packed.dequantize(torch.float32)) < 1e-6


def test_quantized_embedding_looks_up_and_projects_with_one_copy():
    weight = _random(300, 64, seed=3)
    embedding = QuantizedEmbedding(300, 64, torch.float32)
    embedding.load(weight)
    ids = torch.tensor([0, 5, 299, 5])
    restored = embedding.qweight.dequantize(torch.float32)
    # A lookup refines each int8 code by its 4-bit residual: within a 28th of the row's step
    # (the codes alone: within half a step).
    step = embedding.qweight.scales.float()[ids, None]
    assert ((embedding(ids) - weight[ids]).abs() <= step / 28 + 1e-6).all()
    assert ((restored[ids] - weight[ids]).abs() > step / 8).any()
    hidden = _random(3, 64, seed=4)
    assert _relative_error(embedding.project(hidden), hidden @ restored.t()) < PRODUCT_TOLERANCE
    assert embedding.lookup_residual.shape == (300, 32)  # half a byte per value
    # From INT8_ACTIVATION_QUANT_FROM_ROWS rows the product takes the refinement too: the
    # weights it multiplies are the lookup's, not the codes alone.
    many = _random(INT8_ACTIVATION_QUANT_FROM_ROWS, 64, seed=5)
    refined = embedding(torch.arange(300))
    assert _relative_error(embedding.project(many), many @ refined.t()) < 1e-3
    assert _relative_error(many @ restored.t(), many @ refined.t()) > 2e-3


def test_quantized_embedding_kernel_equals_its_torch_lookup_bit_for_bit():
    # kernels/cpu/step_lookups.cpp's int8_embedding: the same float32 operations as
    # torch_lookup, odd hidden sizes (padded codes) and bfloat16 models too.
    for vocab, hidden, dtype in ((300, 64, torch.float32), (97, 50, torch.float32),
                                 (40, 96, torch.bfloat16)):
        embedding = QuantizedEmbedding(vocab, hidden, dtype)
        embedding.load(_random(vocab, hidden, seed=vocab))
        ids = torch.tensor([0, vocab - 1, 3, 3, vocab // 2])
        got = embedding(ids)
        assert got.dtype == dtype and got.shape == (5, hidden)
        assert torch.equal(got, embedding.torch_lookup(ids))
        assert torch.equal(embedding(ids.to(torch.int32)), got)
        assert embedding(torch.tensor([], dtype=torch.int64)).shape == (0, hidden)


def test_quantized_embedding_kernel_refuses_ids_outside_the_vocabulary():
    embedding = QuantizedEmbedding(50, 32, torch.float32)
    embedding.load(_random(50, 32, seed=1))
    for bad in (50, -1):
        with pytest.raises((RuntimeError, IndexError), match="outside the vocabulary|out of"):
            embedding(torch.tensor([1, bad]))


# ---- GGUF blocks --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def gguf_reader(smollm2_gguf_path) -> gguf.GGUFReader:
    return gguf.GGUFReader(smollm2_gguf_path)


def _tensor(reader: gguf.GGUFReader, name: str) -> gguf.ReaderTensor:
    return next(t for t in reader.tensors if t.name == name)


def test_shipped_file_is_q4_1_with_a_q8_0_embedding(gguf_reader):
    # What the gguf mode has to handle in the shipped model (docs/quantization.md says so).
    types = {t.tensor_type.name for t in gguf_reader.tensors if len(t.shape) == 2}
    assert types == {"Q4_1", "Q8_0"}
    assert _tensor(gguf_reader, "token_embd.weight").tensor_type.name == "Q8_0"


@pytest.mark.parametrize("name", ["blk.0.ffn_down.weight", "blk.3.attn_q.weight"])
def test_blocks_equal_ggufs_own_dequantization(gguf_reader, name):
    tensor = _tensor(gguf_reader, name)
    blocks = read_blocks(tensor)
    want = dequantize(tensor.data, tensor.tensor_type).reshape(blocks.shape)
    assert np.array_equal(blocks.dequantize().numpy(), want)


def test_q4_0_blocks_read_like_ggufs(gguf_reader):
    # No Q4_0 tensor ships: quantize random values with gguf's own Q4_0 and read them back.
    values = _random(8, 64, seed=5).numpy()
    raw = gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q4_0)

    class _Tensor:  # the two fields read_blocks reads, as GGUFReader gives them
        name, tensor_type, shape, data = "q4_0", gguf.GGMLQuantizationType.Q4_0, [64, 8], raw

    want = dequantize(raw, gguf.GGMLQuantizationType.Q4_0).reshape(8, 64)
    assert np.array_equal(read_blocks(_Tensor).dequantize().numpy(), want)


@pytest.mark.skipif(int4_kernel_problem() is not None, reason=f"{int4_kernel_problem()}")
def test_repacked_q4_1_keeps_the_codes_and_the_numbers(gguf_reader):
    tensor = _tensor(gguf_reader, "blk.0.ffn_gate.weight")
    blocks = read_blocks(tensor)
    packed = pack_weight(blocks, "gguf")
    assert isinstance(packed, Int4Weight)
    rows = blocks.shape[0]
    assert torch.equal(packed.codes()[:rows], blocks.codes)
    # Q4_1's weight = d * q + m is our layout's scale * code + minimum, d and m float16 in the
    # file and in the layout: nothing is rounded.
    scale, minimum = packed.scales()
    assert torch.equal(scale[:rows], blocks.scale) and torch.equal(minimum[:rows], blocks.minimum)
    assert torch.equal(packed.dequantize(torch.float32)[:rows], blocks.dequantize())


def test_q_and_k_blocks_get_the_float_paths_row_order(gguf_reader, smollm2_gguf_path):
    from splitserve.engine.model.loader import load_checkpoint

    packed = load_checkpoint(smollm2_gguf_path, keep_quantized=True).weights
    dense = load_checkpoint(smollm2_gguf_path).weights
    for name in ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "mlp.up_proj.weight"):
        blocks = packed[f"model.layers.2.{name}"]
        assert isinstance(blocks, BlockQuantized)
        assert torch.equal(blocks.dequantize(), dense[f"model.layers.2.{name}"])
    # The permutation is not the identity (the check above would hold trivially otherwise).
    order = unpermute_rope_rows(np.arange(576), 9)
    assert not np.array_equal(order, np.arange(576))
    assert torch.equal(packed["model.embed_tokens.weight"], dense["model.embed_tokens.weight"])


# ---- configuration and fallback ----------------------------------------------------------


@pytest.mark.parametrize("bad", ["int3", "fp8", "", "INT4"])
def test_config_rejects_unknown_methods_naming_them(bad):
    with pytest.raises(ValueError, match=repr(bad)):
        ModelConfig(quantization=bad)


def test_gguf_needs_a_gguf_file():
    with pytest.raises(ValueError, match="not a .gguf file"):
        ModelConfig(model="/models/llama-dir", quantization="gguf")
    ModelConfig(model=None, quantization="gguf")  # the shipped GGUF
    ModelConfig(model="/models/llama-dir", quantization="int4")


def test_quantization_needs_the_cpu_or_cuda():
    # CUDA multiplies through the Triton dequantizing matmuls (tests/test_quantized_triton.py).
    with pytest.raises(ValueError, match="CPU or CUDA only"):
        ModelConfig(quantization="int4", device="mps")
    ModelConfig(quantization="int4", device="cuda")
    ModelConfig(quantization="none", device="mps")


def test_missing_kernel_falls_back_to_dense_with_a_warning(monkeypatch, caplog):
    # Stands in for a torch build without the int4 kernel: the model is built dense, loudly.
    monkeypatch.setattr(
        quantized_linear, "cpu_kernel_problem", lambda method: f"no {method} kernel"
    )
    with caplog.at_level(logging.WARNING, logger="splitserve.engine.model.quantized_linear"):
        assert effective_method("int4", torch.device("cpu")) == "none"
    assert "no int8 kernel" in caplog.text and "no memory is saved" in caplog.text


def test_quantization_is_cpu_or_cuda_only():
    with pytest.raises(ValueError, match="CPU or CUDA only"):
        effective_method("int8", torch.device("meta"))


# ---- flags -------------------------------------------------------------------------------


def test_pod_flag_reaches_the_engine_config_and_refuses_bad_values():
    import argparse

    from splitserve.engine.config import EngineConfig
    from splitserve.pod.flags import add_engine_flags, engine_options

    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    config = EngineConfig.from_options(
        **engine_options(parser.parse_args(["--quantization", "int4"]))
    )
    assert config.model.quantization == "int4"
    assert (
        EngineConfig.from_options(**engine_options(parser.parse_args([]))).model.quantization
        == "none"
    )
    with pytest.raises(SystemExit):
        parser.parse_args(["--quantization", "q4"])


def test_splitserve_up_passes_each_role_its_quantization():
    from splitserve.cli import build_parser
    from splitserve.launcher import plan

    def flag(argv: list[str]) -> str:
        return argv[argv.index("--quantization") + 1]

    args = build_parser().parse_args(
        ["up", "--quantization", "gguf", "--prefill-quantization", "none"]
    )
    specs = plan(args, prefill_available=True, redis_url="redis://127.0.0.1:1").specs
    roles = {spec.name.split("-")[0]: spec.argv for spec in specs if "-" in spec.name}
    assert flag(roles["decode"]) == "gguf" and flag(roles["prefill"]) == "none"
    same = plan(
        build_parser().parse_args(["up", "--quantization", "int8"]), True, "redis://x"
    ).specs
    assert {flag(s.argv) for s in same if "--quantization" in s.argv} == {"int8"}


# ---- a whole model ---------------------------------------------------------------------------


@pytest.mark.parametrize("method", ["int8", "int4"])
def test_untied_hf_model_quantizes_its_head_apart(make_tiny_hf_checkpoint, method):
    """A Hugging Face directory with its own lm_head: both vocabulary matrices are int8, the
    logits stay near float32's, and the engine serves it."""
    from splitserve import LLM, SamplingParams
    from splitserve.engine.model.attention_backend import select_attention_backend
    from splitserve.engine.model.attention_metadata import AttentionMetadata, PrefillChunk
    from splitserve.engine.model.llama import LlamaForCausalLM
    from splitserve.engine.model.loader import load_checkpoint

    directory = make_tiny_hf_checkpoint(tie_word_embeddings=False)
    checkpoint = load_checkpoint(directory)
    assert not checkpoint.architecture.tie_word_embeddings
    ids = torch.randint(100, 40000, (20,), generator=torch.Generator().manual_seed(6))
    logits = {}
    for name in ("none", method):
        model = LlamaForCausalLM(checkpoint.architecture, 256, torch.device("cpu"), name)
        model.materialize(torch.device("cpu"), torch.float32)
        model.load_hf_weights(checkpoint.weights)
        arch = model.arch
        cache = torch.zeros(arch.num_layers, 2, 2, 16, arch.num_kv_heads, arch.head_dim)
        meta = AttentionMetadata(torch.arange(20), 0, [PrefillChunk(0, 20, 20, torch.arange(2))])
        backend = select_attention_backend(torch.device("cpu"), torch.float32)
        logits[name] = model(ids, torch.arange(20), cache, meta, backend, torch.arange(20))
    assert model.lm_head is not model.embed_tokens
    # Random Gaussian weights are int4's worst case (no structure; a group's step is ~1/4 of
    # a weight's spread): ~10% of the largest logit after two layers, int8 ~1%.
    bound = {"int8": 0.05, "int4": 0.2}[method]
    assert _relative_error(logits[method], logits["none"]) < bound
    if method == "int4":  # one engine start is enough for the file's time budget
        llm = LLM(directory, quantization=method, kv_cache_bytes=8 * 2**20, num_threads=1)
        output = llm.generate([ids.tolist()], SamplingParams(temperature=0.0, max_tokens=4))
        assert len(output[0].outputs[0].token_ids) == 4


@pytest.mark.slow  # two engines
def test_prefill_and_decode_pods_may_differ_in_weight_format():
    """A dense prefill pod's pages go to a gguf decode pod: the KV format is the same whatever
    the weights, so the decode pod takes them and finishes the request."""
    from splitserve import LLM, SamplingParams
    from tests.test_disaggregation_engine import disaggregated

    options = {"kv_cache_bytes": 32 * 2**20, "num_threads": 1}
    prefill, decode = LLM(**options), LLM(quantization="gguf", **options)
    params = SamplingParams(temperature=0.0, max_tokens=8)
    prompt = prefill.tokenizer.encode("The lighthouse keeper climbed the stairs every evening and")
    dense_first = prefill.generate([prompt], params)[0].outputs[0].token_ids[0]
    # disaggregated() checks the exported pages have the shape the decode pod reserved.
    _, final = disaggregated(prefill.engine, decode.engine, "mixed", prompt, params)
    assert final.token_ids[0] == dense_first  # the prefill pod's token
    assert len(final.token_ids) == 8
    assert decode.stats().num_kv_blocks_free == decode.stats().num_kv_blocks_total
