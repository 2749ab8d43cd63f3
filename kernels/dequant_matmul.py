"""Dequantizing matmuls for weight-only quantized linear layers: `y = x @ dequant(W).T`.

Two layouts, both plain enough for a tile to read its codes straight from memory (no
dequantized copy of the weight is ever made; each program dequantizes the tile it multiplies):

- int8 per output channel: `codes [N, K_pad] int8`, `scales [N]`; `W[n, k] = codes * scales[n]`.
  The scale is constant along k, so it is applied once to the accumulated row, after the loop.
- int4 in groups of 32 along k (`splitserve.kernels.reference.pack_int4_groups` says the byte
order):
  `packed [N, K_pad / 2] uint8`, `scales`, `minimums [N, K_pad / 32]`;
  `W[n, k] = scales[n, g] * code + minimums[n, g]` with g = k // 32. Byte 16g + j holds column
  32g + j in its low nibble and 32g + j + 16 in its high one: ggml's Q4_0 / Q4_1 block order, so
  a GGUF block's 16 nibble bytes are this layout's bytes as they are (Q4_0: minimum = -8 d).
  A tile of BLOCK_K columns is BLOCK_K / 2 consecutive bytes per row; its low nibbles meet the
  first 16 columns of each group and its high nibbles the last 16, so each tile is two dots
  of BLOCK_K / 2, with no interleaving of nibbles.

The weight is dequantized in float32 and rounded once to x's dtype before the dot (rounding
`code * scale` and then `+ minimum` separately loses most of a weight near zero in a group
whose minimum is far from it, see shared/model/quantized_linear.py); products accumulate in
float32. x's K may be shorter than the layout's padded K_pad: columns past K are never read.

int4's inner loop is a launch key, `INT4_LOOP` (issue 41: the per-element loop above ran at
260-350 GB/s on an H100, bound by unpacking and scaling each weight, not by memory):
- "dequant" (the default): each weight dequantized as above, then one dot per tile half.
- "group_dot": the dot takes the raw codes, and each group's scale and minimum apply once per
  output instead of once per weight: sum_k x_k (s c_k + m) = s (x . c) + m sum(x), so a group
  costs two 16-deep dots, a row sum of x shared by every column, and one multiply-add on the
  [BLOCK_M, BLOCK_N] sums. Codes are exact in every float dtype, so nothing is rounded before
  the output: at least as exact as "dequant".
- "gemv": no tl.dot (whose least is 16 rows): each program broadcasts its rows of x over a
  tile of codes, multiplies in float32 and sums over k, with the same per-group scale and
  minimum. For 1 to a few rows; BLOCK_M is then capped at the rows there are.

Tile sizes, split-K and the int4 scale loads come from the GPU's tuned table
(kernels/launch_configs.py, written by benchmarks.triton_tune); a GPU without one, and the
interpreter, run `DEFAULT_LAUNCH`. Split-K: with few rows and few output columns there are too
few tiles to keep every multiprocessor reading, so SPLIT_K programs share each tile's K range,
each writes its float32 partial sums, and one reduction adds them.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import triton
import triton.language as tl

from splitserve.kernels import _checks as checks
from splitserve.kernels._paged_tile import dot, dot_meta
from splitserve.kernels.launch_configs import launch_config, lookup_environment

GROUP_SIZE = 32  # int4 columns sharing one scale and minimum (one GGUF block)
SCALE_DTYPES = checks.FLOAT_DTYPES
# BLOCK_M None: 16 rows (tl.dot's least) for decode steps, up to 64 for prefill chunks.
# BLOCK_K 64: int4 then reads two groups (32 bytes of codes) per row and step.
# INT4_LOOP: the int4 kernel's inner loop (module docstring); SCALE_BROADCAST is "dequant"'s.
DEFAULT_LAUNCH: dict[str, Any] = dict(
    BLOCK_M=None, BLOCK_N=64, BLOCK_K=64, SPLIT_K=1, SCALE_BROADCAST=0, INT4_LOOP="dequant",
    num_warps=4, num_stages=3,
)  # fmt: skip
INT4_LOOPS = ("dequant", "group_dot", "gemv")
# Row counts tuned apart: a decode step of one, a small batch, a full batch, a prefill chunk.
ROW_BUCKETS = (1, 16, 64, 256)


@triton.jit
def _int8_matmul_kernel(
    x_ptr,
    codes_ptr,
    scales_ptr,
    out_ptr,  # [M, N] in x's dtype; with SPLIT_K > 1, [SPLIT_K, M, N] float32 partial sums
    M,
    N,
    K,
    stride_xm,
    stride_cn,
    stride_om,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    rows, cols, row_ok, col_ok = _tile_coords(M, N, BLOCK_M, BLOCK_N)
    k_begin, k_end = _split_range(K, BLOCK_K, SPLIT_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_ok = ks < K
        a = tl.load(
            x_ptr + rows[:, None] * stride_xm + ks[None, :],
            mask=row_ok[:, None] & k_ok[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_K]
        codes = tl.load(
            codes_ptr + cols[None, :].to(tl.int64) * stride_cn + ks[:, None],
            mask=k_ok[:, None] & col_ok[None, :],
            other=0,
        )  # [BLOCK_K, BLOCK_N]: W's [N, K] codes read transposed
        # |code| <= 127 is exact in every float dtype, so only the scale is left to apply.
        # Through float32: Triton's interpreter casts int8 to bfloat16 by reinterpreting the
        # bits (NaNs); on a GPU the extra convert is free beside the load.
        acc += dot(a, codes.to(tl.float32).to(a.dtype), DOT_PRECISION, UPCAST_DOT)
    acc *= tl.load(scales_ptr + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    _store_tile(out_ptr, acc, rows, cols, row_ok, col_ok, M, stride_om, SPLIT_K)


@triton.jit
def _tile_coords(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's output rows and columns, and which of them are inside [M, N]."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    return rows, cols, rows < M, cols < N


@triton.jit
def _split_range(K, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
    """This program's [begin, end) of K: whole BLOCK_K tiles, shared out among SPLIT_K."""
    tiles_per_split = tl.cdiv(tl.cdiv(K, BLOCK_K), SPLIT_K)
    k_begin = tl.program_id(2) * tiles_per_split * BLOCK_K
    return k_begin, tl.minimum(k_begin + tiles_per_split * BLOCK_K, K)


@triton.jit
def _store_tile(out_ptr, acc, rows, cols, row_ok, col_ok, M, stride_om, SPLIT_K: tl.constexpr):
    """The finished tile into out, or this split's float32 partial sums into its slice."""
    mask = row_ok[:, None] & col_ok[None, :]
    if SPLIT_K == 1:
        out = out_ptr + rows[:, None] * stride_om + cols[None, :]
        tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        base = tl.program_id(2).to(tl.int64) * M * stride_om
        tl.store(out_ptr + base + rows[:, None] * stride_om + cols[None, :], acc, mask=mask)


@triton.jit
def _int4_matmul_kernel(
    x_ptr,
    packed_ptr,
    scales_ptr,
    minimums_ptr,
    out_ptr,
    M,
    N,
    K,  # x's columns
    K_PAD,  # the layout's columns (a multiple of 32)
    stride_xm,
    stride_pn,
    stride_sn,
    stride_om,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    SCALE_BROADCAST: tl.constexpr,  # load a tile's scales once per group, not once per byte
):
    rows, cols, row_ok, col_ok = _tile_coords(M, N, BLOCK_M, BLOCK_N)
    k_begin, k_end = _split_range(K_PAD, BLOCK_K, SPLIT_K)
    byte_in_tile = tl.arange(0, BLOCK_K // 2)
    # The column each byte's low nibble holds, relative to the tile's first column: bytes
    # 16g..16g+15 hold columns 32g..32g+15 (low) and 32g+16..32g+31 (high).
    low_col_in_tile = (byte_in_tile // 16) * 32 + byte_in_tile % 16
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        byte = k0 // 2 + byte_in_tile
        byte_ok = byte < K_PAD // 2
        w_mask = byte_ok[:, None] & col_ok[None, :]
        packed = tl.load(
            packed_ptr + cols[None, :].to(tl.int64) * stride_pn + byte[:, None],
            mask=w_mask,
            other=0,
        )  # [BLOCK_K / 2, BLOCK_N] uint8
        scale, minimum = _group_params(scales_ptr, minimums_ptr, k0, byte, w_mask, cols, col_ok,
                                       K_PAD, stride_sn, BLOCK_K, BLOCK_N, SCALE_BROADCAST)
        low_cols = k0 + low_col_in_tile
        a_low = tl.load(
            x_ptr + rows[:, None] * stride_xm + low_cols[None, :],
            mask=row_ok[:, None] & (low_cols < K)[None, :],
            other=0.0,
        )  # [BLOCK_M, BLOCK_K / 2]
        a_high = tl.load(
            x_ptr + rows[:, None] * stride_xm + (low_cols + 16)[None, :],
            mask=row_ok[:, None] & (low_cols + 16 < K)[None, :],
            other=0.0,
        )
        w_low = ((packed & 15).to(tl.float32) * scale + minimum).to(a_low.dtype)
        w_high = ((packed >> 4).to(tl.float32) * scale + minimum).to(a_low.dtype)
        acc += dot(a_low, w_low, DOT_PRECISION, UPCAST_DOT)
        acc += dot(a_high, w_high, DOT_PRECISION, UPCAST_DOT)
    _store_tile(out_ptr, acc, rows, cols, row_ok, col_ok, M, stride_om, SPLIT_K)


@triton.jit
def _group_params(scales_ptr, minimums_ptr, k0, byte, w_mask, cols, col_ok, K_PAD, stride_sn,
                  BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, SCALE_BROADCAST: tl.constexpr):
    """The float32 scale and minimum of each byte of a [BLOCK_K / 2, BLOCK_N] code tile: loaded
    per byte (each group's 16 bytes read the same address, served from cache), or once per
    group and repeated over its 16 bytes in registers."""
    if SCALE_BROADCAST:
        # 32 = GROUP_SIZE columns per group = 16 bytes.
        groups = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        offsets = cols[None, :].to(tl.int64) * stride_sn + groups[:, None]
        mask = (groups < K_PAD // 32)[:, None] & col_ok[None, :]
        scale = tl.load(scales_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        minimum = tl.load(minimums_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        scale = tl.reshape(tl.broadcast_to(scale[:, None, :], (BLOCK_K // 32, 16, BLOCK_N)),
                           (BLOCK_K // 2, BLOCK_N))
        minimum = tl.reshape(tl.broadcast_to(minimum[:, None, :], (BLOCK_K // 32, 16, BLOCK_N)),
                             (BLOCK_K // 2, BLOCK_N))
    else:
        offsets = cols[None, :].to(tl.int64) * stride_sn + (byte // 16)[:, None]
        scale = tl.load(scales_ptr + offsets, mask=w_mask, other=0.0).to(tl.float32)
        minimum = tl.load(minimums_ptr + offsets, mask=w_mask, other=0.0).to(tl.float32)
    return scale, minimum


@triton.jit
def _int4_group_dot_kernel(
    x_ptr,
    packed_ptr,
    scales_ptr,
    minimums_ptr,
    out_ptr,
    M,
    N,
    K,
    K_PAD,
    stride_xm,
    stride_pn,
    stride_sn,
    stride_om,
    DOT_PRECISION: tl.constexpr,
    UPCAST_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    """INT4_LOOP "group_dot" (module docstring): the arguments are _int4_matmul_kernel's."""
    rows, cols, row_ok, col_ok = _tile_coords(M, N, BLOCK_M, BLOCK_N)
    k_begin, k_end = _split_range(K_PAD, BLOCK_K, SPLIT_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        for group_in_tile in tl.static_range(BLOCK_K // 32):
            acc += _group_dot(x_ptr, packed_ptr, scales_ptr, minimums_ptr,
                              k0 // 32 + group_in_tile, rows, row_ok, cols, col_ok, K, K_PAD,
                              stride_xm, stride_pn, stride_sn, DOT_PRECISION, UPCAST_DOT)
    _store_tile(out_ptr, acc, rows, cols, row_ok, col_ok, M, stride_om, SPLIT_K)


@triton.jit
def _group_dot(x_ptr, packed_ptr, scales_ptr, minimums_ptr, group, rows, row_ok, cols, col_ok,
               K, K_PAD, stride_xm, stride_pn, stride_sn,
               DOT_PRECISION: tl.constexpr, UPCAST_DOT: tl.constexpr):
    """One group's float32 share of a [BLOCK_M, BLOCK_N] tile: scale (x . codes) + minimum
    sum(x), the 32 columns as two 16-deep dots (low nibbles, high nibbles)."""
    byte = group * 16 + tl.arange(0, 16)
    # A group past K_PAD (the last tile's tail) would read the next row's bytes and scales.
    byte_ok = byte < K_PAD // 2
    packed = tl.load(
        packed_ptr + cols[None, :].to(tl.int64) * stride_pn + byte[:, None],
        mask=byte_ok[:, None] & col_ok[None, :],
        other=0,
    )  # [16, BLOCK_N] uint8
    low_cols = group * 32 + tl.arange(0, 16)
    x_low = _load_x(x_ptr, rows, row_ok, low_cols, K, stride_xm)  # [BLOCK_M, 16]
    x_high = _load_x(x_ptr, rows, row_ok, low_cols + 16, K, stride_xm)
    codes_low, bias = _biased_codes(packed & 15, x_low.dtype)
    codes_high, bias = _biased_codes(packed >> 4, x_low.dtype)
    dots = dot(x_low, codes_low, DOT_PRECISION, UPCAST_DOT)
    dots += dot(x_high, codes_high, DOT_PRECISION, UPCAST_DOT)
    x_sum = tl.sum(x_low.to(tl.float32), 1) + tl.sum(x_high.to(tl.float32), 1)  # [BLOCK_M]
    offsets = cols.to(tl.int64) * stride_sn + group
    # The group test as a vector: the interpreter refuses a mask of a vector & a scalar.
    params_ok = col_ok & (tl.full(cols.shape, group, tl.int32) < K_PAD // 32)
    scale = tl.load(scales_ptr + offsets, mask=params_ok, other=0.0).to(tl.float32)
    minimum = tl.load(minimums_ptr + offsets, mask=params_ok, other=0.0).to(tl.float32)
    # The dots summed x (bias + code): the bias's share, bias scale sum(x), comes off here.
    return dots * scale[None, :] + x_sum[:, None] * (minimum - bias * scale)[None, :]


@triton.jit
def _load_x(x_ptr, rows, row_ok, x_cols, K, stride_xm):
    """x[rows, x_cols] -> [BLOCK_M, len(x_cols)], 0 past K."""
    return tl.load(
        x_ptr + rows[:, None] * stride_xm + x_cols[None, :],
        mask=row_ok[:, None] & (x_cols < K)[None, :],
        other=0.0,
    )


@triton.jit
def _load_x_groups(x_ptr, rows, row_ok, x_cols, K, stride_xm):
    """x[rows, x_cols] for x_cols [groups, 16] -> [BLOCK_M, groups, 16] float32, 0 past K."""
    return tl.load(
        x_ptr + rows[:, None, None] * stride_xm + x_cols[None, :, :],
        mask=row_ok[:, None, None] & (x_cols < K)[None, :, :],
        other=0.0,
    ).to(tl.float32)


@triton.jit
def _biased_codes(nibbles, dtype: tl.constexpr):
    """Codes 0..15 as `dtype` plus a bias, by setting the bits of `bias + code` rather than
    converting: int-to-float conversion runs at a quarter of the GPU's float rate, and a loop
    bound by two conversions per byte is what "dequant" was. bfloat16's 128 and float16's 1024
    have a unit last mantissa bit, so the code is their last 4 bits. Returns (codes, bias)."""
    if dtype == tl.bfloat16:
        codes = (nibbles.to(tl.int16) | 0x4300).to(tl.int16).to(tl.bfloat16, bitcast=True)
        bias = 128.0
    elif dtype == tl.float16:
        codes = (nibbles.to(tl.int16) | 0x6400).to(tl.int16).to(tl.float16, bitcast=True)
        bias = 1024.0
    else:
        codes = _codes_as_float32(nibbles)
        bias = 0.0
    return codes, bias


@triton.jit
def _codes_as_float32(nibbles):
    """Codes 0..15 as exact float32 without a conversion instruction: 2^23 + code has the code
    in its mantissa's last bits, and subtracting 2^23 is exact."""
    return (nibbles.to(tl.int32) | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def _int4_gemv_kernel(
    x_ptr,
    packed_ptr,
    scales_ptr,
    minimums_ptr,
    out_ptr,
    M,
    N,
    K,
    K_PAD,
    stride_xm,
    stride_pn,
    stride_sn,
    stride_om,
    BLOCK_M: tl.constexpr,  # any power of two: no tl.dot here
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    """INT4_LOOP "gemv" (module docstring): the arguments are _int4_matmul_kernel's. A tile is
    [BLOCK_N, groups, 16] bytes, each column's BLOCK_K / 2 bytes contiguous."""
    rows, cols, row_ok, col_ok = _tile_coords(M, N, BLOCK_M, BLOCK_N)
    k_begin, k_end = _split_range(K_PAD, BLOCK_K, SPLIT_K)
    byte_in_group = tl.arange(0, 16)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(k_begin, k_end, BLOCK_K):
        groups = k0 // 32 + tl.arange(0, BLOCK_K // 32)
        group_ok = groups < K_PAD // 32
        byte = groups[:, None] * 16 + byte_in_group[None, :]  # [groups, 16]
        packed = tl.load(
            packed_ptr + cols[:, None, None].to(tl.int64) * stride_pn + byte[None, :, :],
            mask=col_ok[:, None, None] & group_ok[None, :, None],
            other=0,
        )  # [BLOCK_N, groups, 16] uint8
        low_cols = byte + groups[:, None] * 16  # 32g + j: byte 16g + j's low nibble's column
        x_low = _load_x_groups(x_ptr, rows, row_ok, low_cols, K, stride_xm)
        x_high = _load_x_groups(x_ptr, rows, row_ok, low_cols + 16, K, stride_xm)
        dots = _nibble_dot(x_low, packed & 15) + _nibble_dot(x_high, packed >> 4)
        x_sum = tl.sum(x_low, 2) + tl.sum(x_high, 2)  # [BLOCK_M, groups]
        offsets = cols[:, None].to(tl.int64) * stride_sn + groups[None, :]
        mask = col_ok[:, None] & group_ok[None, :]
        scale = tl.load(scales_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        minimum = tl.load(minimums_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        # [BLOCK_M, BLOCK_N, groups] -> [BLOCK_M, BLOCK_N]
        acc += tl.sum(dots * scale[None, :, :] + x_sum[:, None, :] * minimum[None, :, :], 2)
    _store_tile(out_ptr, acc, rows, cols, row_ok, col_ok, M, stride_om, SPLIT_K)


@triton.jit
def _nibble_dot(x, nibbles):
    """x [BLOCK_M, groups, 16] float32 . codes [BLOCK_N, groups, 16] per group, in float32:
    [BLOCK_M, BLOCK_N, groups]."""
    return tl.sum(x[:, None, :, :] * _codes_as_float32(nibbles)[None, :, :, :], 3)


def default_block_m(num_rows: int) -> int:
    """16 rows (tl.dot's least) for decode steps, up to 64 for prefill chunks."""
    return min(64, max(16, triton.next_power_of_2(num_rows)))


def row_bucket(num_rows: int) -> int:
    """The smallest of ROW_BUCKETS holding num_rows (the largest past it)."""
    return next((bucket for bucket in ROW_BUCKETS if num_rows <= bucket), ROW_BUCKETS[-1])


def matmul_launch_key(kind: str, dtype: torch.dtype, num_rows: int, n: int = 0, k: int = 0) -> str:
    """The tuned table's key: per row bucket, and per weight shape when n and k are given."""
    key = f"{kind}/{str(dtype).removeprefix('torch.')}/m{row_bucket(num_rows)}"
    return f"{key}/n{n}/k{k}" if n else key


def matmul_launch(kind: str, x: torch.Tensor, n: int, k: int) -> dict[str, Any]:
    """The weight shape's own entry over its row bucket's over the defaults (shared between
    calls: not to be changed)."""
    bucket = row_bucket(x.shape[0])
    return _matmul_launch(kind, x.dtype, bucket, n, k, x.device, lookup_environment())


@functools.lru_cache(maxsize=1024)
def _matmul_launch(
    kind: str, dtype: torch.dtype, bucket: int, n: int, k: int, device: torch.device,
    environment: tuple[str | None, str | None],
) -> dict[str, Any]:  # fmt: skip
    kernel = f"{kind}_matmul"
    of_bucket = launch_config(kernel, matmul_launch_key(kind, dtype, bucket), device,
                              DEFAULT_LAUNCH)  # fmt: skip
    return launch_config(kernel, matmul_launch_key(kind, dtype, bucket, n, k), device, of_bucket)


def _target(launch: dict[str, Any], x: torch.Tensor, n: int) -> torch.Tensor:
    """What the kernel writes: out [M, n] in x's dtype, or split-K's [SPLIT_K, M, n] float32."""
    split_k = int(launch["SPLIT_K"])
    if split_k == 1:
        return torch.empty(x.shape[0], n, dtype=x.dtype, device=x.device)
    return torch.empty(split_k, x.shape[0], n, dtype=torch.float32, device=x.device)


def _grid_and_meta(
    kernel, launch: dict[str, Any], x: torch.Tensor, n: int
) -> tuple[tuple[int, int, int], dict[str, Any]]:
    """The launch grid and the kernel's keyword arguments (its meta-parameters, warps, stages,
    dot settings) from `launch`."""
    if launch["BLOCK_M"] is None:  # the default: by the row count
        launch = {**launch, "BLOCK_M": default_block_m(x.shape[0])}
    grid = (
        triton.cdiv(x.shape[0], int(launch["BLOCK_M"])),
        triton.cdiv(n, int(launch["BLOCK_N"])),
        int(launch["SPLIT_K"]),
    )
    # Only what this kernel takes: launch keys of the other loops, and dot settings of a kernel
    # without tl.dot, are left out.
    given = {**launch, **dot_meta(x.dtype)}
    meta = {name: value for name, value in given.items() if name in kernel.arg_names}
    meta.update(num_warps=launch["num_warps"], num_stages=launch["num_stages"])
    return grid, meta


def _finish(target: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """out from what the kernel wrote: split-K's partial sums added."""
    return target if target.dim() == 2 else target.sum(0).to(x.dtype)


def int8_matmul(
    x: torch.Tensor,
    codes: torch.Tensor,
    scales: torch.Tensor,
    launch: dict[str, Any] | None = None,
) -> torch.Tensor:
    """`x @ (codes * scales[:, None])[:, :K].T` -> [M, N] in x's dtype, float32 inside.

    x: [M, K] float, last dim contiguous; codes: [N, K_pad] int8 contiguous, K <= K_pad (the
    padding columns are not read); scales: [N] any float dtype, contiguous. Mutates nothing.
    `launch`: meta-parameters over the tuned table's (benchmarks.triton_tune tries them).
    """
    checks.check_tensor("x", x, 2, checks.FLOAT_DTYPES)
    checks.check_last_dim_contiguous("x", x)
    checks.check_tensor("codes", codes, 2, (torch.int8,))
    checks.check_contiguous("codes", codes)
    _check_inner_size(x, codes.shape[1])
    checks.check_tensor("scales", scales, 1, SCALE_DTYPES)
    checks.check_shape("scales", scales, (codes.shape[0],))
    checks.check_contiguous("scales", scales)
    checks.check_same_device(dict(x=x, codes=codes, scales=scales))
    num_rows, num_cols = x.shape[0], codes.shape[0]
    if num_rows == 0:
        return torch.empty(0, num_cols, dtype=x.dtype, device=x.device)
    launch = {**matmul_launch("int8", x, num_cols, codes.shape[1]), **(launch or {})}
    target = _target(launch, x, num_cols)
    grid, meta = _grid_and_meta(_int8_matmul_kernel, launch, x, num_cols)
    _int8_matmul_kernel[grid](
        x, codes, scales, target, num_rows, num_cols, x.shape[1], x.stride(0), codes.stride(0),
        target.stride(-2), **meta,
    )  # fmt: skip
    return _finish(target, x)


def int4_group_matmul(
    x: torch.Tensor,
    packed: torch.Tensor,
    scales: torch.Tensor,
    minimums: torch.Tensor,
    launch: dict[str, Any] | None = None,
) -> torch.Tensor:
    """`x @ dequant(W)[:, :K].T` -> [M, N] in x's dtype, float32 inside (the module docstring
    gives the layout).

    x: [M, K] float, last dim contiguous; packed: [N, K_pad / 2] uint8 contiguous, K_pad a
    multiple of 32 and K <= K_pad; scales, minimums: [N, K_pad / 32], one float dtype,
    contiguous. Mutates nothing. `launch` as int8_matmul's.
    """
    checks.check_tensor("x", x, 2, checks.FLOAT_DTYPES)
    checks.check_last_dim_contiguous("x", x)
    checks.check_tensor("packed", packed, 2, (torch.uint8,))
    checks.check_contiguous("packed", packed)
    padded = packed.shape[1] * 2
    if padded % GROUP_SIZE:
        raise ValueError(
            f"packed must hold whole groups of {GROUP_SIZE} columns ({GROUP_SIZE // 2} bytes) "
            f"per row, got shape {tuple(packed.shape)}"
        )
    _check_inner_size(x, padded)
    groups = (packed.shape[0], padded // GROUP_SIZE)
    for name, tensor in (("scales", scales), ("minimums", minimums)):
        checks.check_tensor(name, tensor, 2, SCALE_DTYPES)
        checks.check_shape(name, tensor, groups)
        checks.check_contiguous(name, tensor)
    checks.check_same_dtype("minimums", minimums, "scales", scales)
    checks.check_same_device(dict(x=x, packed=packed, scales=scales, minimums=minimums))
    num_rows, num_cols = x.shape[0], packed.shape[0]
    if num_rows == 0:
        return torch.empty(0, num_cols, dtype=x.dtype, device=x.device)
    launch = {**matmul_launch("int4", x, num_cols, padded), **(launch or {})}
    if int(launch["BLOCK_K"]) % GROUP_SIZE:
        raise ValueError(f"int4 BLOCK_K must be a multiple of {GROUP_SIZE}, got {launch}")
    kernel, launch = _int4_loop(launch, num_rows)
    target = _target(launch, x, num_cols)
    grid, meta = _grid_and_meta(kernel, launch, x, num_cols)
    kernel[grid](
        x, packed, scales, minimums, target, num_rows, num_cols, x.shape[1], padded, x.stride(0),
        packed.stride(0), scales.stride(0), target.stride(-2), **meta,
    )  # fmt: skip
    return _finish(target, x)


def _int4_loop(launch: dict[str, Any], num_rows: int) -> tuple[Any, dict[str, Any]]:
    """The kernel of launch's INT4_LOOP, and the launch it runs: "gemv" has no tl.dot and so
    no 16-row least, and takes no more rows per program than there are."""
    loop = launch["INT4_LOOP"]
    if loop == "gemv":
        block_m = min(launch["BLOCK_M"] or 16, triton.next_power_of_2(num_rows))
        return _int4_gemv_kernel, {**launch, "BLOCK_M": block_m}
    if loop == "group_dot":
        return _int4_group_dot_kernel, launch
    if loop != "dequant":
        raise ValueError(f"INT4_LOOP must be one of {INT4_LOOPS}, got {loop!r}")
    return _int4_matmul_kernel, launch


def _check_inner_size(x: torch.Tensor, padded: int) -> None:
    if x.shape[1] > padded:
        raise ValueError(
            f"x has {x.shape[1]} columns but the weight only {padded} (its in_features, padded)"
        )
