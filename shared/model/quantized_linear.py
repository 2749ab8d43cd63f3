"""Weight-only quantized linear layers on the CPU: int8 per output channel, int4 in groups of 32.

The weights stay packed in memory. int8 products depend on how many rows they have, because
torch's int8 kernel (`aten._weight_int8pack_mm`) is fast only at few rows and only with
bfloat16 activations (float32 ones fall to a path 4-7x slower). Rough figures, 2 threads, the
120 products of SmolLM2-135M's decoder (30 layers of qkv, o, gate_up, down), ms per pass; one
throwaway run on an AVX-512 machine, not a benchmark:

    rows                          1      4     16     64    256    512
    float32, oneDNN            10.5   10.5   16.7   41     131     -
    bfloat16, oneDNN            7      7.5   12.4   26      71     -
    int8 kernel                 5.7    5.4   16.3   51     189    423
    int8 dequantized + dense     -      -      -     ~56     95    173

So int8 decode rows (few) went through torch's kernel, activations cast to bfloat16 for the product
only; with our C++ kernels loaded they now take kernels/cpu/int8_gemv.cpp instead: activations
rounded to int16 per group of 32 columns (2e-5 of a product, against bfloat16's 4e-3), and faster at
every row count below 32 (2-core AVX2 EPYC, 2026-12-02: SmolLM2's int8 head at 1 row 2.1-3.2 ms
against torch's 4.2 on float32 activations, 1.15x a plain read of its codes since int16; its gate_up
at 16 rows 0.64 against 1.13 ms). From 32 rows an int8 product quantizes its activations per row and
multiplies int8 by int8 (oneDNN through torch._int_mm): 1.4x float32 at 64 rows with qkv and down in
two passes, which their accuracy needs (`_int8_activation_product` has the figures). Without VNNI
that product is no gain (`int8_by_int8_problem`): on an AVX2 CPU torch runs its own reference loop
(exact, 14x float32's time), and oneDNN capped to AVX2 on a VNNI CPU saturates full-range codes
(`int8_product_problem`; its 7-bit two-pass remedy was the slowest path there). So there, from 32
rows, the weight is dequantized to float32 for the product (`_dequantized_product`).

int4 (and GGUF's Q4_0/Q4_1, `int4_from_codes`) is packed in our own layout
(kernels/cpu/int4_gemm.h) and multiplied at every row count by kernels/cpu/int4_gemm.cpp, which
quantizes the float32 activations to int8 per row and group of 32 and multiplies them by the
4-bit codes as integers (llama.cpp's Q4 x Q8 arithmetic): AVX-512 VNNI, AVX2 or generic C++,
chosen at run time (splitserve.kernels.cpu.isa), all three giving the same bits. Below 16 rows
(decode steps) the activations of qkv and down (the layer's `activation_passes`, inputs with a few
large features per row, as for int8) take two int8 passes, the second quantizing what the first
rounded away, so the product is float32-exact to ~1e-5 (bfloat16 activations, torch's kernel before,
left 0.1-0.2% of a product's norm); o and gate_up two as well where the kernel runs its AVX-512 VNNI
variant, one elsewhere (`plain_input_activation_passes` says why); every product from 16 rows
(prefill chunks, big decode batches, compute-bound) one pass, about 0.5% of a product's norm, as
llama.cpp's Q8 activations. Two passes everywhere cost AVX2 CPUs decode time (no 4-byte dot product:
the second pass doubles the arithmetic that hides the weights' reads) and bought nothing measurable:
the quality text in chunks of 8 had perplexity +0.25% against float32 with two passes on all four
products, +0.06% with o and gate_up in one, and greedy agreement with float32 on the test prompts
was the same (2-core AVX2 EPYC, 2026-12-02; the +0.06% was the one pass's luck with torch's AVX2
kernels: +0.60% with its AVX-512 ones). Same 120 products, ms per pass, one thread, one rough
run on the shared AVX-512 machine (others' jobs running; ratios only):

    rows                            1     4     8    16    64    256
    float32, oneDNN               20    20    24    36   116    625
    int4_gemm, AVX-512 VNNI        3.0   6.5  11.4  12.0  45    368
    int4_gemm, AVX2 variant        3.8  12.2  24.0  24.5 101    985
    torch's int4 kernel            6.4  10.6  22.2  41.9 287   1323

(At 4-8 rows the two passes cost what they save: the earlier one-pass kernel took 4.2 and 7.9
there, torch's kernel, which those rows used, 10.6 and 22.2.) The perplexity of
tests/test_quantization_quality.py's text moved by +0.06% (one prefill) and +0.29% (chunks of
8) against float32, all of it from the int8 vocabulary matrix (quantization.QuantizedEmbedding).

Where our kernels are not loaded (no compiler, SPLITSERVE_CPU_KERNELS=0, an x86 CPU below
AVX2), int4 weights are packed by torch in this process for its own kernel
(`TorchInt4Weight`, bfloat16 activations at every row count); their bytes are never read here,
because torch's layout depends on the CPU capability it dispatches to. Group size 32: GGUF's
blocks are 32 weights with one scale (and minimum) each, so the layout holds them exactly; it
costs 1 bit per weight in float16 scales and minimums.
"""

from __future__ import annotations

import functools
import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.kernels import cpu as cpu_kernels
from splitserve.kernels.cpu.isa import CpuFeatures, cpu_features, kernel_isa

if TYPE_CHECKING:  # quantized_triton imports this module
    from splitserve.engine.model.quantized_triton import TritonWeight

logger = logging.getLogger(__name__)

GROUP_SIZE = 32
# int8 products with at least this many rows quantize their activations and multiply int8 by
# int8 (torch._int_mm on oneDNN's VNNI path; _int8_activation_product has the figures). At 16
# rows they only tie the packed kernel, which the fused decode loop runs without Python.
INT8_ACTIVATION_QUANT_FROM_ROWS = 32
# int4 products of fewer rows quantize their activations in their layer's activation_passes
# (one or two int8 passes), from here in one
# (kInt4OnePassFromRows in kernels/cpu/kernels.h, which the tests hold equal; the module
# docstring says why).
INT4_ONE_PASS_FROM_ROWS = 16
_TILE_OUTPUTS = 16  # outputs per tile of our int4 layout (kernels/cpu/int4_gemm.h)
# torch's own int4 layout packs rows in blocks of up to 64; its kernels misbehaved on inner
# sizes that are not multiples of 16 (garbage at 40, a crash at 5), so both dimensions are
# padded with zero weights where needed.
_TORCH_INT4_ROW_BLOCK = 64
_INNER_MULTIPLE = GROUP_SIZE
_ACT_DTYPE = torch.bfloat16


def plain_input_activation_passes(features: CpuFeatures | None = None) -> int:
    """Activation passes below INT4_ONE_PASS_FROM_ROWS rows for the products whose inputs
    have no few large features (o and gate_up; qkv and down always take two): two where
    int4_gemm runs its AVX-512 VNNI variant, one elsewhere. In one pass the quality text's
    perplexity in chunks of 8 (tests/test_quantization_quality.py) moved with float noise
    the pass rounds one way or the other: +0.06%, +0.29% and +0.60% against float32 with
    torch's elementwise kernels at AVX2, scalar and AVX-512 (a Zen 5 EPYC, 2026-12-03), the
    last past the 0.41% bound; in two, +0.24-0.25% at all three. VNNI's 4-byte dot products
    take the second pass at no cost measurable there; AVX2 has none, and its variant (forced
    on that Zen 5) paid ~20% of its 8-row decode rate for it in one noisy A/B, so it keeps one
    pass (+0.06% where torch runs its AVX2 kernels too). `features`: this CPU's by default."""
    return 2 if kernel_isa(features).name == "avx512_vnni" else 1


def _pad_to(size: int, multiple: int) -> int:
    return -(-size // multiple) * multiple


def _pad2d(tensor: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    return F.pad(tensor, (0, cols - tensor.shape[1], 0, rows - tensor.shape[0]))


@dataclass(frozen=True)
class Int8Weight:
    """`weight[n, k] ~= codes[n, k] * scales[n]`: one scale per output channel."""

    codes: torch.Tensor  # [out, in_padded] int8
    scales: torch.Tensor  # [out] bfloat16
    in_features: int

    @property
    def out_features(self) -> int:
        return self.codes.shape[0]

    @property
    def nbytes(self) -> int:
        return _nbytes(self.codes, self.scales)

    def dequantize(self, dtype: torch.dtype = _ACT_DTYPE) -> torch.Tensor:
        """[out, in_padded] in `dtype` (columns past in_features are zero)."""
        return self.codes.to(dtype) * self.scales.to(dtype)[:, None]

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in_padded] bfloat16 -> [rows, out] bfloat16."""
        return torch.ops.aten._weight_int8pack_mm(x, self.codes, self.scales)

    def matmul(self, x: torch.Tensor, activation_passes: int = 1) -> torch.Tensor:
        """x [rows, in_features] -> [rows, out] in x's dtype (the layer's product); from 32 rows
        in `activation_passes` int8 x int8 products (quantized_matmul)."""
        return quantized_matmul(x, self, activation_passes)


@dataclass(frozen=True)
class Int4Weight:
    """`weight[n, k] = scale[n, g] * code[n, k] + minimum[n, g]` with g = k // 32 and codes in
    0..15 (GGUF's Q4_1 `d * q + m` as it is, Q4_0's `d * (q - 8)` with minimum -8d), in our own
    tiled layout (kernels/cpu/int4_gemm.h): multiplied by kernels/cpu/int4_gemm.cpp at every
    row count, read back here by `codes()` and `scales()`. No other library reads it."""

    packed: torch.Tensor  # [tiles, groups, 256] uint8: 16 outputs x 32 columns per tile and group
    scales_minimums: torch.Tensor  # [tiles, groups, 2, 16] float16
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        return _nbytes(self.packed, self.scales_minimums)

    @property
    def in_padded(self) -> int:
        return self.packed.shape[1] * GROUP_SIZE

    def codes(self) -> torch.Tensor:
        """The 4-bit codes [out_padded, in_padded] uint8 (int4_gemm.h's byte order undone)."""
        tiles, groups = self.packed.shape[:2]
        chunks = self.packed.view(tiles, groups, 4, _TILE_OUTPUTS, 4)  # [t, g, chunk, n, i]
        halves = torch.stack([chunks & 15, chunks >> 4], dim=4)  # [t, g, chunk, n, half, i]
        return halves.permute(0, 3, 1, 2, 4, 5).reshape(tiles * _TILE_OUTPUTS, self.in_padded)

    def scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(scale, minimum) [out_padded, groups] float32."""
        tiles, groups = self.packed.shape[:2]
        pairs = self.scales_minimums.float().permute(2, 0, 3, 1)  # [2, tiles, 16, groups]
        scale, minimum = pairs.reshape(2, tiles * _TILE_OUTPUTS, groups)
        return scale, minimum

    def dequantize(self, dtype: torch.dtype = _ACT_DTYPE) -> torch.Tensor:
        """[out_padded, in_padded] in `dtype`, computed in float32 and rounded once."""
        codes = self.codes().float()
        out_padded = codes.shape[0]
        scale, minimum = self.scales()
        groups = codes.view(out_padded, -1, GROUP_SIZE) * scale[..., None] + minimum[..., None]
        return groups.view(out_padded, self.in_padded).to(dtype)

    def matmul(self, x: torch.Tensor, activation_passes: int = 1) -> torch.Tensor:
        """x [rows, in_features] -> [rows, out_features] in x's dtype, by int4_gemm (its
        activations take `activation_passes` int8 passes below INT4_ONE_PASS_FROM_ROWS rows and
        one from there)."""
        module = cpu_kernels.load()
        assert module is not None, "an Int4Weight without the CPU kernels (int4_layout decides)"
        x32 = x.to(torch.float32).contiguous()  # the kernel pads the columns itself
        out = module.int4_gemm(
            x32, self.packed, self.scales_minimums, self.out_features, activation_passes
        )
        return out.to(x.dtype)


@dataclass(frozen=True)
class TorchInt4Weight:
    """The same weight in torch's own packed layout, for `aten._weight_int4pack_mm_for_cpu`:
    the int4 path where our C++ kernels are not loaded. That layout depends on the CPU
    capability torch dispatches to (rows in blocks of 64 under AVX-512, of 32 under AVX2), so
    torch packs it in this process (`pack_int4_for_torch`) and only torch reads it: nothing
    here looks at its bytes, and `dequantize()` asks torch's kernel for the weight."""

    packed: torch.Tensor  # torch's opaque layout
    scales_zeros: torch.Tensor  # [groups, out_padded, 2] bfloat16: zero = minimum + 8 * scale
    out_features: int
    in_features: int
    in_padded: int

    @property
    def nbytes(self) -> int:
        return _nbytes(self.packed, self.scales_zeros)

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in_padded] bfloat16 -> [rows, out_padded] bfloat16."""
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, self.packed, GROUP_SIZE, self.scales_zeros
        )

    def dequantize(self, dtype: torch.dtype = _ACT_DTYPE) -> torch.Tensor:
        """[out_padded, in_padded] in `dtype`: torch's kernel applied to the identity (its
        bfloat16 rounding of each weight; for checks, not for products)."""
        identity = torch.eye(self.in_padded, dtype=_ACT_DTYPE)
        return self.kernel(identity).t().to(dtype)

    def matmul(self, x: torch.Tensor, activation_passes: int = 1) -> torch.Tensor:
        """x [rows, in_features] -> [rows, out_features] in x's dtype: torch's kernel on
        bfloat16 activations at every row count."""
        xb = x.to(_ACT_DTYPE)
        if self.in_padded != x.shape[1]:
            xb = F.pad(xb, (0, self.in_padded - x.shape[1]))
        return self.kernel(xb)[:, : self.out_features].to(x.dtype)


QuantizedWeight = Int8Weight | Int4Weight | TorchInt4Weight


def _nbytes(*tensors: torch.Tensor) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def quantize_int8(weight: torch.Tensor) -> Int8Weight:
    """Symmetric per-output-channel int8 of `weight` [out, in] (round to nearest)."""
    w = weight.detach().float()
    out_features, in_features = w.shape
    w = _pad2d(w, out_features, _pad_to(in_features, _INNER_MULTIPLE))
    # Scales are rounded to bfloat16 first, so codes are computed against the scale used.
    scales = (w.abs().amax(dim=1) / 127).clamp_min(1e-12).to(_ACT_DTYPE)
    codes = torch.round(w / scales.float()[:, None]).clamp(-127, 127).to(torch.int8)
    return Int8Weight(codes.contiguous(), scales, in_features)


def quantize_int4(weight: torch.Tensor) -> Int4Weight | TorchInt4Weight:
    """Asymmetric int4 of `weight` [out, in] in groups of 32 along `in` (min/max per group)."""
    codes, scale, low = int4_groups(weight)
    return int4_from_codes(codes, scale, low, weight.shape[1])


def int4_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`weight` [out, in] as (codes [out, in_padded] uint8 in 0..15, scale, minimum
    [out, in_padded / 32] float32, both float16 values): min/max per group of 32, round to
    nearest against the float16 scale and minimum the layouts keep (so the codes fit the
    numbers they are multiplied by); any layout's int4 (ours, torch's, the Triton one) packs
    these."""
    w = weight.detach().float()
    out_features, in_features = w.shape
    padded = _pad2d(w, out_features, _pad_to(in_features, GROUP_SIZE))
    groups = padded.view(out_features, -1, GROUP_SIZE)
    low = groups.amin(dim=-1).to(torch.float16).float()
    scale = ((groups.amax(dim=-1) - low) / 15).to(torch.float16).float()
    if not (torch.isfinite(scale).all() and torch.isfinite(low).all()):
        raise ValueError("int4 needs weights within float16's range (|w| < 65504)")
    # A group whose values span less than float16's smallest step has scale 0: all codes 0,
    # every weight its minimum.
    steps = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round((groups - low[..., None]) / steps[..., None]).clamp(0, 15)
    return codes.view(out_features, -1).to(torch.uint8), scale, low


def int4_from_codes(
    codes: torch.Tensor,  # [out, in_padded] uint8 in 0..15
    scale: torch.Tensor,  # [out, in_padded / 32]
    minimum: torch.Tensor,  # [out, in_padded / 32]: weight = scale * code + minimum
    in_features: int,
) -> Int4Weight | TorchInt4Weight:
    """Affine 4-bit groups of 32 (GGUF's Q4_0/Q4_1 included) in the layout this machine's int4
    path reads (int4_layout)."""
    if int4_layout() == "ours":
        return pack_int4_tiles(codes, scale, minimum, in_features)
    return pack_int4_for_torch(codes, scale, minimum, in_features)


def pack_int4_tiles(
    codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, in_features: int
) -> Int4Weight:
    """Our layout (kernels/cpu/int4_gemm.h): per tile of 16 outputs and group of 32 columns,
    4 chunks of 8 columns, byte (n, i) of a chunk holding output n's codes of columns i (low
    nibble) and 4 + i (high); scale and minimum rounded to float16 (GGUF's d and m exactly)."""
    out_features, in_padded = codes.shape
    assert in_padded % GROUP_SIZE == 0, f"inner size {in_padded} is not whole groups"
    out_padded = _pad_to(out_features, _TILE_OUTPUTS)
    tiles, groups = out_padded // _TILE_OUTPUTS, in_padded // GROUP_SIZE
    padded = _pad2d(codes.to(torch.uint8), out_padded, in_padded)
    # [tile, n, group, chunk, half, i] -> bytes [tile, group, chunk, n, i]
    split = padded.view(tiles, _TILE_OUTPUTS, groups, 4, 2, 4)
    packed = split[:, :, :, :, 0, :] | (split[:, :, :, :, 1, :] << 4)
    packed = packed.permute(0, 2, 3, 1, 4).reshape(tiles, groups, 4 * 4 * _TILE_OUTPUTS)
    pairs = torch.stack([scale.float(), minimum.float()])  # [2, out, groups]
    pairs = F.pad(pairs, (0, 0, 0, out_padded - out_features)).to(torch.float16)
    pairs = pairs.view(2, tiles, _TILE_OUTPUTS, groups).permute(1, 3, 0, 2)
    return Int4Weight(packed.contiguous(), pairs.contiguous(), out_features, in_features)


def pack_int4_for_torch(
    codes: torch.Tensor, scale: torch.Tensor, minimum: torch.Tensor, in_features: int
) -> TorchInt4Weight:
    """torch's layout, packed by torch in this process (TorchInt4Weight says why): rows padded
    to its widest block, scales and zeros in bfloat16 (its kernel's form, `(q - 8) * scale +
    zero`)."""
    out_features, in_padded = codes.shape
    assert in_padded % GROUP_SIZE == 0, f"inner size {in_padded} is not whole groups"
    out_padded = _pad_to(out_features, _TORCH_INT4_ROW_BLOCK)
    codes32 = _pad2d(codes.to(torch.int32), out_padded, in_padded)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes32.contiguous(), 1)
    scale, minimum = scale.float(), minimum.float()
    pairs = torch.stack([scale, minimum + 8 * scale], dim=-1).transpose(0, 1)  # [groups, out, 2]
    pairs = F.pad(pairs, (0, 0, 0, out_padded - out_features))
    return TorchInt4Weight(
        packed, pairs.to(_ACT_DTYPE).contiguous(), out_features, in_features, in_padded
    )


def quantize(weight: torch.Tensor, method: str) -> QuantizedWeight:
    if method == "int8":
        return quantize_int8(weight)
    if method == "int4":
        return quantize_int4(weight)
    raise ValueError(f"no quantized CPU weight for method {method!r}")


def quantized_matmul(
    x: torch.Tensor, weight: QuantizedWeight, activation_passes: int = 1
) -> torch.Tensor:
    """x [rows, in] @ dequantized(weight).T -> [rows, out] in x's dtype. int8: for few rows
    our int8_gemv on int16 activations (torch's packed kernel on bfloat16 ones where our
    kernels are not loaded), int8 x int8 products in `activation_passes` for many; int4: its
    layout's kernel at every row count (Int4Weight.matmul: `activation_passes` at decode rows,
    TorchInt4Weight.matmul)."""
    if not isinstance(weight, Int8Weight):
        return weight.matmul(x, activation_passes)
    rows, in_features = x.shape
    if rows >= INT8_ACTIVATION_QUANT_FROM_ROWS:
        if int8_by_int8_problem() is not None:
            return _dequantized_product(x, weight)
        return _int8_activation_product(x, weight, activation_passes).to(x.dtype)
    module = cpu_kernels.load()
    if module is not None and x.device.type == "cpu":
        # Activations in int16 steps per group of 32 (2e-5 of a product), and faster at every
        # row count here (int8_gemv.cpp).
        x32 = x.to(torch.float32).contiguous()
        return module.int8_gemv(x32, weight.codes, weight.scales).to(x.dtype)
    xb = x.to(_ACT_DTYPE)
    in_padded = inner_size(weight)
    if in_padded != in_features:
        xb = F.pad(xb, (0, in_padded - in_features))
    return weight.kernel(xb).to(x.dtype)


def _dequantized_product(x: torch.Tensor, weight: Int8Weight) -> torch.Tensor:
    """x @ weight.T with the weight dequantized to float32 for this product (oneDNN's float32
    path), where int8 x int8 has no VNNI (AVX2 CPUs): there the 7-bit two-pass product was the
    slowest path from 32 rows. Forced to AVX2 on the quiet machine, ms per SmolLM2 layer (a
    throwaway timing): 64 rows 3.2 against 3.6, 128 rows 3.9 against 6.7; float32 weights 1.7
    and 2.9. Exact to weight-only int8 (no activation rounding)."""
    in_padded = weight.codes.shape[1]
    xf = x.float()
    if in_padded != xf.shape[1]:
        xf = F.pad(xf, (0, in_padded - xf.shape[1]))
    return F.linear(xf, weight.dequantize(torch.float32)).to(x.dtype)


def _int8_activation_product(x: torch.Tensor, weight: Int8Weight, passes: int) -> torch.Tensor:
    """x [rows, in] @ weight.T in float32 through int8 x int8 -> int32 products: each row of x
    is quantized symmetrically with its own scale (max|x| / 127), so
    `out[m, n] = x_scale[m] * w_scale[n] * sum_k xq[m, k] * codes[n, k]`. With two passes the
    rounding error of the first is quantized and multiplied too (its steps are 1/254 of the
    first's), which leaves the product as close to weight-only int8 as float32 gets.

    Why: from 32 rows a step's products are compute-bound, and oneDNN's int8 product (VNNI dot
    products, four multiply-adds per byte lane) beats every float path. SmolLM2-135M's four
    decoder shapes, 2 threads, ms per layer, one throwaway run (quantizing x included):

        rows                    8      16     32     64    128    256
        float32, oneDNN       0.22   0.31   0.55   0.99   1.90   3.69
        int8 packed kernel    0.20   0.37   0.73   1.44   2.87   6.08
        int8 x int8, 1 pass   0.19   0.23   0.31   0.47   0.77   1.47
        qkv, down in 2 passes  -     0.35   0.47   0.70   1.13   2.06

    One pass costs SmolLM2 +6.9% perplexity when every product takes it: the attention input
    (qkv) and the MLP's SwiGLU output (down) carry a few large features per row, which coarsen
    the steps of all the others. Those two take two passes (shared/model/llama.py), as does the
    vocabulary head (shared/model/quantization.py); o and gate_up keep one (docs/quantization.md
    has the per-product figures)."""
    xf = x.float()
    in_padded = weight.codes.shape[1]
    if in_padded != xf.shape[1]:
        xf = F.pad(xf, (0, in_padded - xf.shape[1]))
    levels = int8_activation_levels()
    if levels < 127:
        # One pass of 7-bit codes per row cost +5.1% perplexity on the quality text (o and
        # gate_up, one pass at 8 bits, had cost nothing measurable): every product takes two.
        passes = max(passes, 2)
    out: torch.Tensor | None = None
    for _ in range(passes):
        x_scale = xf.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / levels
        x_codes = torch.round(xf / x_scale)
        part = _int8_codes_product(x_codes.to(torch.int8), weight.codes, levels)
        part = part.float().mul_(x_scale)
        out = part if out is None else out.add_(part)
        xf = xf - x_codes.mul_(x_scale)  # what this pass rounded away
    assert out is not None, "passes must be at least 1"
    return out.mul_(weight.scales.float()).contiguous()


def _int8_codes_product(x_codes: torch.Tensor, codes: torch.Tensor, levels: int) -> torch.Tensor:
    """x_codes [rows, in] @ codes [out, in].T -> int32 [rows, out], exactly."""
    if levels == 127:
        # codes.t() is a column-major view: oneDNN takes it as is (a contiguous copy ran no
        # faster).
        return torch._int_mm(x_codes, codes.t())
    # 7-bit activations go second: the operand oneDNN's u8 x s8 pairs must keep small.
    return torch._int_mm(codes, x_codes.t()).t()


def int8_activation_levels() -> int:
    """Codes per sign an int8 x int8 product's activations are quantized to: 127, or 64 where
    oneDNN's int8 product saturates (int8_product_problem)."""
    return 127 if int8_product_problem() is None else 64


@functools.cache
def int8_by_int8_problem() -> str | None:
    """None when products of many rows should quantize their activations and multiply int8 by
    int8 here (exact, and on VNNI dot products); otherwise why the weight is dequantized to
    float32 for them instead (_dequantized_product)."""
    return int8_dot_products_problem(cpu_features()) or int8_product_problem()


def int8_dot_products_problem(features: CpuFeatures) -> str | None:
    """None when torch._int_mm can be expected to reach oneDNN's int8 dot products on this
    CPU. Seen: a CPU with AVX-512 VNNI reaches oneDNN; a 2-core AVX2 EPYC never does (torch's
    own reference loop, exact, but 14x float32's time for a 256-row SmolLM2 product). torch's
    VNNI check (at::cpu::is_cpu_support_vnni) reads AVX-512 VNNI only, so AVX-VNNI alone counts
    as none (no such CPU was at hand to confirm)."""
    if features.has("avx512_vnni"):
        return None
    return "no AVX-512 VNNI on this CPU: torch._int_mm runs a reference loop, slower than float32"


@functools.cache
def int8_product_problem() -> str | None:
    """None when torch._int_mm multiplies full-range int8 exactly here; otherwise what goes
    wrong. Without VNNI (AVX2 CPUs, or ONEDNN_MAX_CPU_ISA=AVX2) oneDNN multiplies s8 by s8 as
    (s8 + 128) u8 x s8 with vpmaddubsw, whose int16 pair sums saturate once the second
    operand's codes pass 64 (255 x 127 x 2 > 32767): products came out wrong by up to 40%, and
    greedy int8 output left float32's after a few tokens. Asked once, on the inputs that
    saturate; where they do, activations take 64 codes per sign as the second operand
    (255 x 64 x 2 = 32640 fits)."""
    ones = torch.full((32, 64), 127, dtype=torch.int8)
    got = torch._int_mm(ones, ones.t().contiguous())[0, 0].item()
    want = 64 * 127 * 127
    if got == want:
        return None
    return f"oneDNN's int8 product saturates here (127 x 127 over 64 terms gave {got}, not {want})"


@functools.cache
def int4_kernel_problem() -> str | None:
    """None when our int4 product (kernels/cpu/int4_gemm.cpp, in the variant isa.py chose)
    is loaded and gives the dequantized product on a small random test, in both its
    activation modes; otherwise why not (int4 then takes torch's kernel: int4_layout)."""
    module = cpu_kernels.load()
    if module is None:
        return f"the CPU kernels are not loaded ({cpu_kernels.unavailable_reason()})"
    generator = torch.Generator().manual_seed(0)
    weight = pack_int4_tiles(*int4_groups(torch.randn(80, 72, generator=generator)), 72)
    reference = weight.dequantize(torch.float32)[:80, :72]
    for rows in (3, INT4_ONE_PASS_FROM_ROWS + 1):  # two activation passes, then one
        x = torch.randn(rows, 72, generator=generator)
        want = x @ reference.t()
        error = (weight.matmul(x, activation_passes=2) - want).abs().max() / want.abs().max()
        if not error < 0.02:  # int8 activations in one pass: about 0.5% on this product
            return (
                f"int4_gemm ({module.int4_isa()}) is off by {error.item():.3g} (relative) on a "
                f"test product of {rows} rows"
            )
    return None


def int4_layout() -> str:
    """"ours" (Int4Weight, int4_gemm) where int4_kernel_problem() is None, else "torch"
    (TorchInt4Weight, torch's kernel); logs why once when it is torch's."""
    problem = int4_kernel_problem()
    if problem is not None:
        _log_torch_int4(problem)
    return "ours" if problem is None else "torch"


@functools.cache
def _log_torch_int4(problem: str) -> None:
    logger.info("int4: our kernel is not used (%s); torch's int4 kernel is", problem)


def inner_size(weight: QuantizedWeight) -> int:
    """The padded inner size the packed kernels multiply over (x is padded to it)."""
    if isinstance(weight, Int8Weight):
        return weight.codes.shape[1]
    return weight.in_padded


class QuantizedLinear(nn.Module):
    """A linear layer whose weight is packed; `load` sets it (no parameter, so the model's
    `to(dtype)` never touches the packed tensors). `bias`: a dense bias added to the product
    (Qwen2's q/k/v), a parameter in the model's dtype, loaded as any other."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        method: str,
        activation_passes: int = 1,
        bias: bool = False,
    ) -> None:
        super().__init__()
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        self.in_features, self.out_features, self.method = in_features, out_features, method
        # How many int8 passes the activations take: an int8 product's from 32 rows, an int4
        # product's below INT4_ONE_PASS_FROM_ROWS. 2 for inputs with a few large features per
        # row (_int8_activation_product says why).
        self.activation_passes = activation_passes
        # Any packed layout with `matmul`: the CPU ones here, or quantized_triton's on CUDA.
        self.qweight: QuantizedWeight | TritonWeight | None = None

    def load(self, packed: QuantizedWeight | TritonWeight) -> None:
        """Sets the packed weight (splitserve.engine.model.quantization.pack_weight makes it)."""
        shape = (packed.out_features, packed.in_features)
        if shape != (self.out_features, self.in_features):
            raise ValueError(
                f"quantized weight has shape {shape}, expected "
                f"{(self.out_features, self.in_features)}"
            )
        self.qweight = packed

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        assert self.qweight is not None, "QuantizedLinear used before load()"
        out = self.qweight.matmul(x, self.activation_passes)
        return out if self.bias is None else out + self.bias

    def extra_repr(self) -> str:
        passes = f", activation_passes={self.activation_passes}"
        bias = ", bias" if self.bias is not None else ""
        return f"in={self.in_features}, out={self.out_features}, method={self.method}{passes}{bias}"


@functools.cache
def cpu_kernel_problem(method: str) -> str | None:
    """None when `method`'s packed products run here and give the right answer on a small
    random product (int4: ours, or else torch's, int4_layout); otherwise why not (the caller
    falls back, loudly)."""
    if method == "int4" and int4_kernel_problem() is None:
        return None
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(128, 96, generator=generator)
    x = torch.randn(3, 96, generator=generator).to(_ACT_DTYPE)
    packed: Int8Weight | TorchInt4Weight
    try:
        if method == "int8":
            packed = quantize_int8(weight)
            reference = packed.dequantize(torch.float32)
        else:
            codes, scale, minimum = int4_groups(weight)
            packed = pack_int4_for_torch(codes, scale, minimum, 96)
            groups = codes.float().view(128, -1, GROUP_SIZE)  # from the codes, not torch's bytes
            reference = (groups * scale[..., None] + minimum[..., None]).view(128, 96)
        got = packed.kernel(x)[:, :128].float()
    except (RuntimeError, AttributeError, NotImplementedError) as exc:
        return _int4_prefix(method) + f"{type(exc).__name__}: {exc}"
    want = x.float() @ reference[:128, :96].t()
    error = (got - want).abs().max().item() / want.abs().max().item()
    if not error < 0.02:
        return _int4_prefix(method) + f"its result is off by {error:.3g} (relative)"
    return None


def _int4_prefix(method: str) -> str:
    if method != "int4":
        return ""
    return f"{int4_kernel_problem()}; torch's int4 kernel: "


def kernels_usable(method: str) -> bool:
    """Whether `method`'s kernel path can be used; logs a warning once when it cannot."""
    problem = cpu_kernel_problem(method)
    if problem is not None:
        logger.warning(
            "quantization %r: no packed CPU kernel is usable here (%s); the weights are "
            "dequantized and run densely instead (no memory is saved)",
            method,
            problem,
        )
    return problem is None


@functools.cache
def warn_if_kernel_is_slow(method: str) -> None:
    """Times the packed kernel against a dense float32 product at one row (a decode step's
    shape) on one thread, best of a few runs, and warns when it is not faster: a torch build
    or CPU without the fast bfloat16 path still answers right (cpu_kernel_problem) but
    slowly. Warns only: the packed weights still save their memory. Tens of ms (quantizing the
    test matrix), once per process."""
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(1024, 2048, generator=generator)
    x = torch.randn(1, 2048, generator=generator)
    packed = quantize(weight, method)
    # One thread: another process holding a core slows a parallel kernel at its barrier,
    # which says nothing about the kernel; the fast path's presence shows on one thread.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        dense_s = _best_seconds(lambda: F.linear(x, weight))
        packed_s = _best_seconds(lambda: quantized_matmul(x, packed))
    finally:
        torch.set_num_threads(threads)
    if packed_s >= dense_s:
        logger.warning(
            "quantization %r: the packed CPU kernel is not faster than a dense float32 "
            "product here (%.2f ms against %.2f ms, 1024 x 2048, one row, one thread): the weights "
            "take less memory, but decoding will not be faster",
            method,
            packed_s * 1e3,
            dense_s * 1e3,
        )


def _best_seconds(product, runs: int = 5) -> float:
    product()  # first call: allocations, dispatch
    best = float("inf")
    for _ in range(runs):
        start = time.perf_counter()
        product()
        best = min(best, time.perf_counter() - start)
    return best
