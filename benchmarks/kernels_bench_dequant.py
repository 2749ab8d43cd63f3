"""`python -m benchmarks.kernels_bench`'s step for the dequantizing matmuls
(kernels/dequant_matmul.py).

For each weight shape and row count: the int8 and int4 kernels checked against their
references, then timed beside a dense product of the same sizes in the run's dtype
(`F.linear`, cuBLAS on a GPU: what `quantization: none` runs). A decode step is a few rows, so
the kernels should beat the dense product there by reading a quarter (int4) or half (int8) of
its bytes; by a few hundred rows (prefill) the product is compute-bound and dense may win.
Each row's bandwidth counts the bytes the product must move (weights, x, out).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from benchmarks.kernels_bench_harness import BenchContext, Timing, nbytes
from splitserve.kernels import reference


def _int8_weight(ctx: BenchContext, out: int, inner: int) -> tuple[torch.Tensor, torch.Tensor]:
    codes = torch.randint(-127, 128, (out, inner), dtype=torch.int8, device=ctx.device)
    scales = (torch.rand(out, device=ctx.device) + 0.5) / 127
    return codes, scales.to(torch.bfloat16)


def _int4_weight(ctx: BenchContext, out: int, inner: int) -> tuple[torch.Tensor, ...]:
    groups = inner // reference.INT4_GROUP_SIZE
    codes = torch.randint(0, 16, (out, inner), device=ctx.device)
    scales = (torch.rand(out, groups, device=ctx.device) + 0.5) / 15
    minimums = -8 * scales + 0.1 * torch.rand(out, groups, device=ctx.device)
    packed = reference.pack_int4_groups(codes)
    return packed, scales.to(torch.float16), minimums.to(torch.float16)


@dataclass(frozen=True)
class _Weights:
    """One weight shape in the three forms compared."""

    codes: torch.Tensor  # int8 [out, in]
    scales: torch.Tensor  # [out]
    packed: torch.Tensor  # int4 [out, in / 2]
    group_scales: torch.Tensor  # [out, in / 32]
    minimums: torch.Tensor
    dense: torch.Tensor  # [out, in] in the run's dtype

    @property
    def size(self) -> tuple[int, int]:
        return tuple(self.dense.shape)  # type: ignore[return-value]


def bench_dequant_matmul(ctx: BenchContext) -> list[Timing]:
    timings = []
    for out, inner in ctx.shapes.dequant_shapes:
        weights = _Weights(
            *_int8_weight(ctx, out, inner), *_int4_weight(ctx, out, inner), ctx.randn(out, inner)
        )
        for rows in ctx.shapes.dequant_rows:
            timings += _bench_rows(ctx, weights, ctx.randn(rows, inner))
    return timings


def _bench_rows(ctx: BenchContext, w: _Weights, x: torch.Tensor) -> list[Timing]:
    from splitserve.kernels.dequant_matmul import int4_group_matmul, int8_matmul

    (rows, inner), out = x.shape, w.size[0]
    size = f"{rows}x{inner}->{out}"
    y = torch.empty(rows, out, dtype=ctx.dtype, device=ctx.device)  # only for its byte count
    want = reference.int8_matmul(x.float(), w.codes, w.scales)
    ctx.checker.check(f"int8 matmul {size}", int8_matmul(x, w.codes, w.scales), want)
    want = reference.int4_group_matmul(x.float(), w.packed, w.group_scales, w.minimums)
    got = int4_group_matmul(x, w.packed, w.group_scales, w.minimums)
    ctx.checker.check(f"int4 matmul {size}", got, want)
    int8_ms = ctx.time_ms(lambda: int8_matmul(x, w.codes, w.scales))
    int4_ms = ctx.time_ms(lambda: int4_group_matmul(x, w.packed, w.group_scales, w.minimums))
    dense_ms = ctx.time_ms(lambda: F.linear(x, w.dense))
    dtype = str(ctx.dtype).removeprefix("torch.")
    return [
        Timing(f"int8 matmul {size}", int8_ms, nbytes(w.codes, w.scales, x, y)),
        Timing(f"int4 matmul {size}", int4_ms, nbytes(w.packed, w.group_scales, w.minimums, x, y)),
        Timing(
            f"dense {dtype} matmul {size}", dense_ms, nbytes(w.dense, x, y), 2 * x.numel() * out
        ),
    ]
