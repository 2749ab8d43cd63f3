"""Quantized weights on CUDA: the layouts the Triton dequantizing matmuls read
(kernels/dequant_matmul.py), the one place that picks them for a device, and their start-up
check.

torch's CPU int4 kernel wants its own packed layout (`_convert_weight_to_int4pack_for_cpu`:
rows interleaved in blocks of 64, scales and zeros as [groups, out, 2]), which a Triton tile
cannot read without undoing it. So on the Triton backend the layers keep a plain one instead:

    int8  TritonInt8Weight: Int8Weight's own layout (codes [out, in_pad] int8, a scale per
          output channel), which the kernel reads as it is
    int4  Int4GroupWeight: codes two per byte in ggml's Q4 order, and a float16 scale and
          minimum per group of 32 (`weight = scale * code + minimum`)

GGUF's Q4_0 / Q4_1 blocks land in the int4 one bit for bit: the nibble bytes are the same
bytes, and float16 holds the blocks' d and m (Q4_0's minimum, -8 d) exactly, where the CPU
layout rounds them to bfloat16.

No GPU has run this path yet: the kernels are checked in Triton's interpreter against
kernels/reference.py, and the layers through them on the CPU with
SPLITSERVE_QUANTIZED_BACKEND=triton (tests/test_quantized_triton.py).
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from splitserve.engine.model.quantized_linear import (
    GROUP_SIZE,
    Int8Weight,
    int4_groups,
    quantize_int8,
)
from splitserve.kernels import has_triton
from splitserve.kernels.reference import dequantize_int4_groups, pack_int4_groups

QuantizedBackend = Literal["torch", "triton"]
BACKEND_ENV = "SPLITSERVE_QUANTIZED_BACKEND"
# float16 holds GGUF's d and m as they are; bfloat16 (the CPU layout's) would round them. Its
# range is enough for scales quantized from float weights: a group whose values span less than
# ~6e-8 gets a scale rounded toward zero, an error below that span; none reaches 65504.
_SCALE_DTYPE = torch.float16


def select_quantized_backend(device: torch.device) -> QuantizedBackend:
    """Which kernels a quantized layer on `device` multiplies with: torch's packed CPU kernels
    ("torch") on the CPU, the Triton dequantizing matmuls on CUDA.

    SPLITSERVE_QUANTIZED_BACKEND=triton|torch overrides it, as SPLITSERVE_ATTENTION_BACKEND
    does for attention: the tests force "triton" on the CPU under TRITON_INTERPRET=1. torch's
    CPU kernels take CPU tensors only, so "torch" with a CUDA device is refused."""
    choice = os.environ.get(BACKEND_ENV, "")
    if choice not in ("", "triton", "torch"):
        raise ValueError(f"{BACKEND_ENV} must be 'triton' or 'torch', got {choice!r}")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"quantization runs on the CPU or CUDA only, device is {device}")
    if device.type == "cuda" and choice == "torch":
        raise ValueError(
            f"{BACKEND_ENV}=torch: torch's packed int8/int4 kernels here run on the CPU only, "
            f"device is {device}"
        )
    if choice == "triton" or device.type == "cuda":
        return "triton"
    return "torch"


@dataclass(frozen=True)
class TritonInt8Weight(Int8Weight):
    """Int8Weight's layout, multiplied by the Triton kernel."""

    def matmul(self, x: torch.Tensor, activation_passes: int = 1) -> torch.Tensor:
        """x [rows, in_features] -> [rows, out] in x's dtype. Weight-only: the activations are
        multiplied as they are, so `activation_passes` (the CPU int8 x int8 path's) does not
        apply."""
        from splitserve.kernels.dequant_matmul import int8_matmul  # optional: Triton

        return int8_matmul(x.contiguous(), self.codes, self.scales)


@dataclass(frozen=True)
class Int4GroupWeight:
    """`weight[n, k] = scales[n, g] * code[n, k] + minimums[n, g]`, g = k // 32, code in
    0..15 (splitserve.kernels.reference.pack_int4_groups gives the byte order)."""

    packed: torch.Tensor  # [out, in_pad / 2] uint8
    scales: torch.Tensor  # [out, in_pad / 32] float16
    minimums: torch.Tensor  # [out, in_pad / 32] float16
    in_features: int

    @property
    def out_features(self) -> int:
        return self.packed.shape[0]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales, self.minimums))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """[out, in_pad] in `dtype` (for tests and checks: the kernel never makes this copy)."""
        return dequantize_int4_groups(self.packed, self.scales, self.minimums).to(dtype)

    def matmul(self, x: torch.Tensor, activation_passes: int = 1) -> torch.Tensor:
        """x [rows, in_features] -> [rows, out] in x's dtype (weight-only, as TritonInt8Weight)."""
        from splitserve.kernels.dequant_matmul import int4_group_matmul  # optional: Triton

        return int4_group_matmul(x.contiguous(), self.packed, self.scales, self.minimums)


TritonWeight = TritonInt8Weight | Int4GroupWeight


def int4_group_weight(
    codes: torch.Tensor,  # [out, in_pad] in 0..15, in_pad a multiple of 32
    scale: torch.Tensor,  # [out, in_pad / 32]
    minimum: torch.Tensor,  # [out, in_pad / 32]
    in_features: int,
) -> Int4GroupWeight:
    """Affine 4-bit groups of 32 (GGUF's Q4_0 / Q4_1 included) in the Triton layout."""
    assert codes.shape[1] % GROUP_SIZE == 0, f"inner size {codes.shape[1]} is not whole groups"
    return Int4GroupWeight(
        pack_int4_groups(codes).contiguous(),
        scale.to(_SCALE_DTYPE).contiguous(),
        minimum.to(_SCALE_DTYPE).contiguous(),
        in_features,
    )


def quantize_for_triton(weight: torch.Tensor, method: str) -> TritonWeight:
    """`weight` [out, in] quantized as `method` in the Triton layout, on weight's device."""
    if method == "int8":
        return to_triton_int8(quantize_int8(weight))
    if method == "int4":
        codes, scale, minimum = int4_groups(weight)
        return int4_group_weight(codes, scale, minimum, weight.shape[1])
    raise ValueError(f"no quantized Triton weight for method {method!r}")


def to_triton_int8(weight: Int8Weight) -> TritonInt8Weight:
    return TritonInt8Weight(weight.codes, weight.scales, weight.in_features)


@functools.cache
def triton_kernel_problem(device: torch.device) -> str | None:
    """None when both Triton kernels run on `device` and match their float reference on a small
    random product; otherwise why not (the caller falls back, loudly). Compiles the kernels
    once, so a GPU's first quantized step pays nothing for it."""
    if not has_triton():
        return "Triton is not installed"
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(128, 80, generator=generator).to(device)
    x = torch.randn(3, 80, generator=generator).to(device)
    for method in ("int8", "int4"):
        packed = quantize_for_triton(weight, method)
        try:
            got = packed.matmul(x)
        except _kernel_errors() as exc:
            return f"the {method} kernel failed: {type(exc).__name__}: {exc}"
        want = x @ packed.dequantize(torch.float32)[:, :80].t()
        error = (got - want).abs().max().item() / want.abs().max().item()
        if not error < 1e-3:  # float32 in and out: only summation order differs
            return f"the {method} kernel's result is off by {error:.3g} (relative)"
    return None


def _kernel_errors() -> tuple[type[Exception], ...]:
    """What a kernel that cannot run here raises: a missing driver or device (RuntimeError),
    refused arguments (ValueError), Triton's compile and resource errors (TritonError)."""
    errors: tuple[type[Exception], ...] = (RuntimeError, ImportError, ValueError)
    try:
        from triton.errors import TritonError
    except ImportError:  # Triton missing, or a version without the common base class
        return errors
    return (*errors, TritonError)


def slow_kernel_note(method: str, kernel_ms: float, dense_ms: float) -> str | None:
    """The warning when `method`'s kernel at a decode step's shape is not faster than the dense
    bfloat16 product it replaces; None when it is."""
    if kernel_ms < dense_ms:
        return None
    return (
        f"quantization {method!r}: the Triton dequantizing matmul is not faster than a dense "
        f"bfloat16 product here ({kernel_ms:.3f} ms against {dense_ms:.3f} ms, 4096 x 4096, one "
        "row): the weights take less memory, but decoding will not be faster"
    )


@functools.cache
def triton_slowness(method: str, device: torch.device) -> str | None:
    """On CUDA, times `method`'s kernel against dense bfloat16 at one row (what a decode step
    multiplies), best of a few runs, and returns slow_kernel_note's warning; None elsewhere (the
    interpreter's timings mean nothing). A few ms, once per process."""
    if device.type != "cuda":
        return None
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(4096, 4096, generator=generator).to(device, torch.bfloat16)
    x = torch.randn(1, 4096, generator=generator).to(device, torch.bfloat16)
    packed = quantize_for_triton(weight, "int8" if method == "int8" else "int4")
    kernel_ms = _best_cuda_ms(lambda: packed.matmul(x))
    dense_ms = _best_cuda_ms(lambda: F.linear(x, weight))
    return slow_kernel_note(method, kernel_ms, dense_ms)


def _best_cuda_ms(product: Callable[[], object], runs: int = 5, calls: int = 20) -> float:
    product()  # compile, allocate
    best = float("inf")
    for _ in range(runs):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            product()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - start) * 1e3 / calls)
    return best
