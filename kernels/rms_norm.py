"""Residual add fused with RMSNorm: one read of x and residual, one write of each result."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels import _checks as checks
from splitserve.kernels.reference import AddRMSNormOutput


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    normed_ptr,
    new_residual_ptr,
    stride_x,
    stride_residual,
    stride_normed,
    stride_new_residual,
    hidden_size,
    eps,
    HAS_RESIDUAL: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < hidden_size
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_residual + cols, mask=mask, other=0.0)
        # Rounded to the activation dtype before the norm, exactly as an unfused add would be,
        # so fused and unfused models agree on the residual stream.
        summed = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)
        tl.store(new_residual_ptr + row * stride_new_residual + cols, summed, mask=mask)
    else:
        summed = x
    hidden = summed.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(hidden * hidden, 0) / hidden_size + eps)
    weight = tl.load(weight_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    normed = hidden * rstd * weight
    tl.store(normed_ptr + row * stride_normed + cols, normed.to(x.dtype), mask=mask)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> AddRMSNormOutput:
    """`new_residual = x + residual` (or x itself when residual is None, no copy) and
    `normed = rmsnorm(new_residual) * weight`, in float32 inside, both in x's dtype.

    x, residual: [num_tokens, hidden_size]; weight: [hidden_size], any float dtype. Mutates
    nothing.
    """
    checks.check_tensor("x", x, 2, checks.FLOAT_DTYPES)
    checks.check_last_dim_contiguous("x", x)
    tensors = dict(x=x, weight=weight)
    if residual is not None:
        checks.check_tensor("residual", residual, 2, checks.FLOAT_DTYPES)
        checks.check_shape("residual", residual, tuple(x.shape))
        checks.check_same_dtype("residual", residual, "x", x)
        checks.check_last_dim_contiguous("residual", residual)
        tensors["residual"] = residual
    checks.check_tensor("weight", weight, 1, checks.FLOAT_DTYPES)
    checks.check_shape("weight", weight, (x.shape[1],))
    checks.check_contiguous("weight", weight)
    if isinstance(eps, bool) or not isinstance(eps, int | float) or not eps > 0:
        raise ValueError(f"eps must be a positive float, got {eps!r}")
    checks.check_same_device(tensors)
    normed = torch.empty_like(x)
    new_residual = x if residual is None else torch.empty_like(x)
    if x.shape[0] == 0:
        return AddRMSNormOutput(normed, new_residual)
    block_h = triton.next_power_of_2(x.shape[1])
    _add_rms_norm_kernel[(x.shape[0],)](
        x, x if residual is None else residual, weight, normed, new_residual, x.stride(0),
        x.stride(0) if residual is None else residual.stride(0), normed.stride(0),
        new_residual.stride(0), x.shape[1], float(eps), HAS_RESIDUAL=residual is not None,
        BLOCK_H=block_h, num_warps=min(max(block_h // 256, 1), 8),
    )
    return AddRMSNormOutput(normed, new_residual)
