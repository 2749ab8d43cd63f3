"""Weight-only quantized linear layers on the CPU: int8 per output channel, int4 in groups of 32.

The weights stay packed in memory; what runs depends on how many rows a product has, because
torch's CPU kernels (`aten._weight_int8pack_mm`, `aten._weight_int4pack_mm_for_cpu`) are fast
only at few rows and only with bfloat16 activations (with float32 ones both fall to a path
4-7x slower: measured below). Rough figures, 2 threads, the 120 products of SmolLM2-135M's
decoder (30 layers of qkv, o, gate_up, down), ms per pass; one throwaway run, not a benchmark:

    rows                          1      4     16     64    256    512
    float32, oneDNN            10.5   10.5   16.7   41     131     -
    bfloat16, oneDNN            7      7.5   12.4   26      71     -
    int8 kernel                 5.7    5.4   16.3   51     189    423
    int4 kernel (group 32)      3.7    4.7   13.3   45     167    331-342
    int8 dequantized + dense     -      -      -     ~56     95    173
    int4 dequantized + dense     -      -      -    130    157    223

So decode rows (few) go through the quantized kernel. From 32 rows an int8 product quantizes
its activations per row and multiplies int8 by int8 (oneDNN's VNNI path through
torch._int_mm): 1.4x float32 at 64 rows with qkv and down in two passes, which their accuracy
needs (`_int8_activation_product` has the figures). An
int4 product from 16 rows takes kernels/cpu/int4_gemm.cpp (below); where that kernel is not
usable, an int4 product with many rows (a prefill chunk) dequantizes the weight to bfloat16 on
the fly, multiplies densely and drops the copy: resident memory stays the packed size (the
point of quantizing), at ~90 ms of dequantizing per forward. The crossovers come from these
tables.

Activations are cast to bfloat16 for the packed kernels and the result back to the caller's
dtype, so the rest of the model keeps its dtype. Group size 32: GGUF's Q4_0/Q4_1 blocks are 32
weights with one scale (and minimum) each, so the same layout holds them exactly
(`int4_from_codes`); it costs 1 bit per weight in bfloat16 scales and zeros (64 would cost 0.5)
and the kernel ran as fast with either.

int4 products of 16 rows or more, on a CPU with AVX512-VNNI (and VBMI), skip all of the above:
kernels/cpu/int4_gemm.cpp reads the same packed bytes, quantizes the float32 activations to int8
per row and group of 32 and multiplies them by the 4-bit codes with VNNI dot products (same 120
products, ms per pass, best of 7, one thread: the other core was busy, and two-thread runs
stalled at their barrier; an earlier quiet two-thread run gave the same ratios, 2.0x at 64):

    rows                      1     4     8    16    32    64   128   256   512
    float32, oneDNN          6.8   9.9  14.1  19.5  37.6  63.9   125   233   475
    int4 VNNI (int4_gemm)    1.2   2.3   4.2   8.2  16.6  32.7  67.8   131   262
    int4, torch's paths      3.8   6.1  11.1  21.2  41.4  83.1   171   227   365

It wins at every row count, but int8 activations add noise that bfloat16 ones do not (about 0.6%
of each product's norm against 0.1-0.2%), and below 16 rows - decode steps of a small batch -
torch's kernel keeps bfloat16 activations: a 2.6-3.2x slower product there, and perplexity on
tests/test_quantization_quality.py's text as before. From 16 rows (prefill chunks, the decode
steps of big batches, where torch's kernel is no faster than float32) the VNNI kernel runs:
its perplexity on that text moved by -0.16% to +1.16% depending only on how the text was
chunked (float32's did not move; an activation near a rounding boundary flips with the last bit
of the attention's sums), around llama.cpp's own +0.41% with the same Q4 x Q8 arithmetic.
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

if TYPE_CHECKING:  # quantized_triton imports this module
    from splitserve.engine.model.quantized_triton import TritonWeight

logger = logging.getLogger(__name__)

GROUP_SIZE = 32
# int8 products with at least this many rows quantize their activations and multiply int8 by
# int8 (torch._int_mm on oneDNN's VNNI path; _int8_activation_product has the figures). At 16
# rows they only tie the packed kernel, which the fused decode loop runs without Python.
INT8_ACTIVATION_QUANT_FROM_ROWS = 32
# int4 products with at least this many rows dequantize on the fly (the module docstring).
INT4_DEQUANTIZE_FROM_ROWS = 256
# int4 products of at least this many rows take kernels/cpu/int4_gemm.cpp where it is usable
# (kInt4VnniFromRows in kernels/cpu/kernels.h: the same number, for the fused decode loop). Not
# below: see the module docstring (accuracy, not speed).
INT4_VNNI_FROM_ROWS = 16
# The int4 kernel's layout packs rows in blocks of 64 (two rows per byte, j and j + 32);
# both kernels misbehaved on inner sizes that are not multiples of 16 (garbage at 40, a
# crash at 5), so both dimensions are padded with zero weights where needed.
_INT4_ROW_BLOCK = 64
_INNER_MULTIPLE = GROUP_SIZE
_ACT_DTYPE = torch.bfloat16


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
    """`weight[n, k] ~= (q[n, k] - 8) * scale[g, n] + zero[g, n]` with g = k // 32 and q in
    0..15: the affine form of torch's int4 kernel, which holds GGUF's Q4_1 (`d * q + m`: scale
    d, zero m + 8d) and Q4_0 (`d * (q - 8)`: zero 0) as they are."""

    packed: torch.Tensor  # [out_padded, in_padded / 2] uint8, the kernel's layout
    scales_zeros: torch.Tensor  # [in_padded / 32, out_padded, 2] bfloat16
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        return _nbytes(self.packed, self.scales_zeros)

    def codes(self) -> torch.Tensor:
        """The 4-bit codes [out_padded, in_padded] uint8, read back from the kernel's layout:
        per block of 64 rows, in_padded runs of 32 bytes, byte j holding row j (low nibble) and
        row j + 32 (high nibble) of that column (checked against the kernel in the tests)."""
        out_padded, in_padded = self.packed.shape[0], self.packed.shape[1] * 2
        blocks = self.packed.view(out_padded // _INT4_ROW_BLOCK, in_padded, 32)
        halves = torch.stack([blocks & 15, blocks >> 4], dim=1)  # [blocks, 2, in, 32]
        return halves.permute(0, 1, 3, 2).reshape(out_padded, in_padded)

    def dequantize(self, dtype: torch.dtype = _ACT_DTYPE) -> torch.Tensor:
        """[out_padded, in_padded] in `dtype`, computed in float32 and rounded once (see
        dequantize_transposed for why)."""
        out_padded, in_padded = self.packed.shape[0], self.packed.shape[1] * 2
        groups = self.codes().float().view(out_padded, in_padded // GROUP_SIZE, GROUP_SIZE)
        scale = self.scales_zeros[..., 0].t().float()[..., None]  # [out, groups, 1]
        zero = self.scales_zeros[..., 1].t().float()[..., None]
        return ((groups - 8) * scale + zero).view(out_padded, in_padded).to(dtype)

    def dequantize_transposed(self) -> torch.Tensor:
        """[in_padded, out_padded] bfloat16, built in the order the packed bytes lie (no
        transposing copy of the result): the on-the-fly path (~90 ms per SmolLM2 forward in
        bfloat16 arithmetic, measured once; float32 arithmetic costs somewhat more).

        The arithmetic is float32, rounded to bfloat16 once at the end: `q * scale + minimum`
        in bfloat16 rounds twice, and where the two terms nearly cancel (weights near zero in a
        block whose minimum is far from it) the error is large against the weight; that cost
        +1.3% perplexity on SmolLM2 against +0.1% rounding once."""
        out_padded, in_padded = self.packed.shape[0], self.packed.shape[1] * 2
        blocks = self.packed.view(out_padded // _INT4_ROW_BLOCK, in_padded, 32)
        out = torch.empty(in_padded, out_padded // _INT4_ROW_BLOCK, 2, 32)
        out[:, :, 0, :].copy_((blocks & 15).permute(1, 0, 2))
        out[:, :, 1, :].copy_((blocks >> 4).permute(1, 0, 2))
        scales_zeros = self.scales_zeros.float()
        scale = scales_zeros[..., 0].unsqueeze(1)  # [groups, 1, out]
        minimum = (scales_zeros[..., 1] - 8 * scales_zeros[..., 0]).unsqueeze(1)
        grouped = out.view(in_padded // GROUP_SIZE, GROUP_SIZE, out_padded)
        grouped.mul_(scale).add_(minimum)
        return out.view(in_padded, out_padded).to(_ACT_DTYPE)

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in_padded] bfloat16 -> [rows, out_padded] bfloat16."""
        return torch.ops.aten._weight_int4pack_mm_for_cpu(
            x, self.packed, GROUP_SIZE, self.scales_zeros
        )

    def matmul(self, x: torch.Tensor, activation_passes: int = 1) -> torch.Tensor:
        """x [rows, in_features] -> [rows, out_features] in x's dtype (the layer's product;
        int4 keeps its activations in bfloat16, so `activation_passes` does not apply)."""
        return quantized_matmul(x, self)


QuantizedWeight = Int8Weight | Int4Weight


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


def quantize_int4(weight: torch.Tensor) -> Int4Weight:
    """Asymmetric int4 of `weight` [out, in] in groups of 32 along `in` (min/max per group)."""
    codes, scale, low = int4_groups(weight)
    return int4_from_codes(codes, scale, low, weight.shape[1])


def int4_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`weight` [out, in] as (codes [out, in_padded] uint8 in 0..15, scale, minimum
    [out, in_padded / 32] float32): min/max per group of 32, round to nearest; any layout's
    int4 (the CPU kernel's, the Triton one's) packs these."""
    w = weight.detach().float()
    out_features, in_features = w.shape
    padded = _pad2d(w, out_features, _pad_to(in_features, GROUP_SIZE))
    groups = padded.view(out_features, -1, GROUP_SIZE)
    low, high = groups.amin(dim=-1), groups.amax(dim=-1)
    scale = ((high - low) / 15).clamp_min(1e-12)
    codes = torch.round((groups - low[..., None]) / scale[..., None]).clamp(0, 15)
    return codes.view(out_features, -1).to(torch.uint8), scale, low


def int4_from_codes(
    codes: torch.Tensor,  # [out, in_padded] uint8 in 0..15
    scale: torch.Tensor,  # [out, in_padded / 32]
    minimum: torch.Tensor,  # [out, in_padded / 32]: weight = scale * code + minimum
    in_features: int,
) -> Int4Weight:
    """Packs affine 4-bit groups of 32 into the kernel's layout (GGUF's Q4_0/Q4_1 included)."""
    out_features, in_padded = codes.shape
    assert in_padded % GROUP_SIZE == 0, f"inner size {in_padded} is not whole groups"
    out_padded = _pad_to(out_features, _INT4_ROW_BLOCK)
    codes32 = _pad2d(codes.to(torch.int32), out_padded, in_padded)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes32.contiguous(), 1)
    scale, minimum = scale.float(), minimum.float()
    # [groups, out, 2]: (scale, zero) with zero = minimum + 8 * scale (the kernel subtracts 8).
    pairs = torch.stack([scale, minimum + 8 * scale], dim=-1).transpose(0, 1)
    pairs = F.pad(pairs, (0, 0, 0, out_padded - out_features))
    return Int4Weight(packed, pairs.to(_ACT_DTYPE).contiguous(), out_features, in_features)


def quantize(weight: torch.Tensor, method: str) -> QuantizedWeight:
    if method == "int8":
        return quantize_int8(weight)
    if method == "int4":
        return quantize_int4(weight)
    raise ValueError(f"no quantized CPU weight for method {method!r}")


def quantized_matmul(
    x: torch.Tensor, weight: QuantizedWeight, activation_passes: int = 1
) -> torch.Tensor:
    """x [rows, in] @ dequantized(weight).T -> [rows, out] in x's dtype: the packed kernel for
    few rows; for many, int8 x int8 products in `activation_passes` (int8 weights), int4_gemm
    from INT4_VNNI_FROM_ROWS where usable, else a transient dense bfloat16 weight (int4)."""
    rows, in_features = x.shape
    if isinstance(weight, Int8Weight) and rows >= INT8_ACTIVATION_QUANT_FROM_ROWS:
        return _int8_activation_product(x, weight, activation_passes).to(x.dtype)
    if isinstance(weight, Int4Weight) and rows >= INT4_VNNI_FROM_ROWS and int4_vnni_usable():
        return int4_vnni_matmul(x, weight)
    xb = x.to(_ACT_DTYPE)
    in_padded = inner_size(weight)
    if in_padded != in_features:
        xb = F.pad(xb, (0, in_padded - in_features))
    if isinstance(weight, Int8Weight):
        out = weight.kernel(xb)
    elif rows < INT4_DEQUANTIZE_FROM_ROWS:
        out = weight.kernel(xb)[:, : weight.out_features]
    else:
        out = torch.mm(xb, weight.dequantize_transposed())[:, : weight.out_features]
    return out.to(x.dtype)


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
    # codes.t() is a column-major view: oneDNN takes it as is (a contiguous copy ran no faster).
    codes = weight.codes.t()
    out: torch.Tensor | None = None
    for _ in range(passes):
        x_scale = xf.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127
        x_codes = torch.round(xf / x_scale)
        part = torch._int_mm(x_codes.to(torch.int8), codes).float().mul_(x_scale)
        out = part if out is None else out.add_(part)
        xf = xf - x_codes.mul_(x_scale)  # what this pass rounded away
    assert out is not None, "passes must be at least 1"
    return out.mul_(weight.scales.float())


def int4_vnni_matmul(x: torch.Tensor, weight: Int4Weight) -> torch.Tensor:
    """x [rows, in_features] @ dequantized(weight).T -> [rows, out_features] in x's dtype, by
    kernels/cpu/int4_gemm.cpp (int8 activations per row and group of 32; needs
    int4_vnni_usable())."""
    module = cpu_kernels.load()
    assert module is not None, "int4_vnni_matmul without the CPU kernels"
    x32 = x.to(torch.float32).contiguous()  # the kernel pads the columns itself
    out = module.int4_gemm(x32, weight.packed, weight.scales_zeros, weight.out_features)
    return out.to(x.dtype)


@functools.cache
def int4_vnni_problem() -> str | None:
    """None when int4_gemm (kernels/cpu) is built, this CPU has its instructions and it gives
    the dequantized product on a small random test; otherwise why not (int4 then keeps torch's
    kernels, as before)."""
    module = cpu_kernels.load()
    if module is None:
        return "the CPU kernels are not built (splitserve.kernels.cpu.load)"
    if not module.int4_gemm_supported():
        return "this CPU lacks AVX512-VNNI or AVX512-VBMI"
    generator = torch.Generator().manual_seed(0)
    weight = quantize_int4(torch.randn(80, 72, generator=generator))
    x = torch.randn(5, 72, generator=generator)
    want = x @ weight.dequantize(torch.float32)[:80, :72].t()
    error = (int4_vnni_matmul(x, weight) - want).abs().max() / want.abs().max()
    if not error < 0.02:  # int8 activations: about 0.5% on this product
        return f"its result is off by {error.item():.3g} (relative) on a test product"
    return None


def int4_vnni_usable() -> bool:
    """Whether int4 products take int4_gemm; logs why not once when they cannot."""
    problem = int4_vnni_problem()
    if problem is not None:
        _log_vnni_fallback(problem)
    return problem is None


@functools.cache
def _log_vnni_fallback(problem: str) -> None:
    logger.info("int4: the VNNI kernel is not used (%s); torch's int4 kernels are", problem)


def inner_size(weight: QuantizedWeight) -> int:
    """The padded inner size the packed kernels multiply over (x is padded to it)."""
    if isinstance(weight, Int4Weight):
        return weight.packed.shape[1] * 2
    return weight.codes.shape[1]


class QuantizedLinear(nn.Module):
    """A bias-free linear layer whose weight is packed; `load` sets it (no parameter, so the
    model's `to(dtype)` never touches the packed tensors)."""

    def __init__(
        self, in_features: int, out_features: int, method: str, activation_passes: int = 1
    ) -> None:
        super().__init__()
        self.in_features, self.out_features, self.method = in_features, out_features, method
        # How many int8 passes an int8 product's activations take from 32 rows: 2 for inputs
        # with a few large features per row (_int8_activation_product says why).
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
        return self.qweight.matmul(x, self.activation_passes)

    def extra_repr(self) -> str:
        passes = f", activation_passes={self.activation_passes}" if self.method == "int8" else ""
        return f"in={self.in_features}, out={self.out_features}, method={self.method}{passes}"


@functools.cache
def cpu_kernel_problem(method: str) -> str | None:
    """None when torch's packed kernel for `method` exists here and gives the right answer on
    a small random product; otherwise why not (the caller falls back, loudly)."""
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(128, 96, generator=generator)
    x = torch.randn(3, 96, generator=generator).to(_ACT_DTYPE)
    try:
        packed = quantize(weight, method)
        got = packed.kernel(x)[:, :128].float()
    except (RuntimeError, AttributeError, NotImplementedError) as exc:
        return f"{type(exc).__name__}: {exc}"
    want = x.float() @ packed.dequantize(torch.float32)[:128].t()
    error = (got - want).abs().max().item() / want.abs().max().item()
    if not error < 0.02:
        return f"its result is off by {error:.3g} (relative) on a test product"
    return None


def kernels_usable(method: str) -> bool:
    """Whether `method`'s kernel path can be used; logs a warning once when it cannot."""
    problem = cpu_kernel_problem(method)
    if problem is not None:
        logger.warning(
            "quantization %r: torch's packed CPU kernel is not usable here (%s); the weights "
            "are dequantized and run densely instead (no memory is saved)",
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
            "quantization %r: torch's packed CPU kernel is not faster than a dense float32 "
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
