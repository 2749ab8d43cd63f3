"""A linear layer (with a bias only where a checkpoint has one: Qwen2's q/k/v), and the CPU
kernel its products (and the vocabulary projection) run on.

On the CPU, F.linear goes to MKL's sgemm, which on AMD processors takes a generic code path: on
this project's machines (AMD EPYC, AVX-512) oneDNN's inner product ran the decoder's 120
products of a decode step 2.5x faster at 1 row and 3-4x faster at 4 to 16 rows than the best
MKL layout, and 2.4x faster for a 512-token prefill chunk (`python -m benchmarks.matmul_rows`;
MKL_ENABLE_INSTRUCTIONS did not help MKL). oneDNN's cost also stays nearly flat from 1 to 8
rows, as a memory-bound product should: the weights are read once whatever the batch. So on
the CPU each weight is reordered once, after loading, into oneDNN's layout, and every product
goes through oneDNN; on CUDA, or with a torch built without oneDNN, F.linear.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
from torch import nn

# SPLITSERVE_CPU_LINEAR=torch keeps F.linear on the CPU too (to compare the two).
_CPU_LINEAR_ENV = "SPLITSERVE_CPU_LINEAR"


class Linear(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False) if bias else None
        # The weight in oneDNN's layout; set by prepare_cpu_kernel, None elsewhere.
        self.onednn_weight: torch.Tensor | None = None

    def prepare_cpu_kernel(self) -> None:
        """Call once, after the weight is loaded. Where oneDNN takes the products, its
        reordered copy replaces the weight: `weight` stays as a meta tensor (shape and dtype,
        no storage), so the layer holds its weights once."""
        self.onednn_weight = onednn_weight(self.weight)
        if self.onednn_weight is not None:
            self.weight = nn.Parameter(self.weight.detach().to("meta"), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = linear(x, self.weight, self.onednn_weight)
        return out if self.bias is None else out + self.bias


def onednn_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` [out, in] reordered for oneDNN's inner product; None where it is not to be used
    (not on the CPU, no oneDNN in this torch, SPLITSERVE_CPU_LINEAR=torch, or a bfloat16 weight
    where oneDNN refuses bfloat16: onednn_bfloat16_problem)."""
    if weight.device.type != "cpu" or not onednn_available():
        return None
    if weight.dtype == torch.bfloat16 and onednn_bfloat16_problem() is not None:
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)


def onednn_available() -> bool:
    """Whether CPU products go through oneDNN: a torch built with it, unless
    SPLITSERVE_CPU_LINEAR=torch."""
    choice = os.environ.get(_CPU_LINEAR_ENV, "onednn")
    if choice not in ("onednn", "torch"):
        raise ValueError(f"{_CPU_LINEAR_ENV} must be 'onednn' or 'torch', got {choice!r}")
    return choice == "onednn" and torch.backends.mkldnn.is_available()


@functools.cache
def onednn_bfloat16_problem() -> str | None:
    """None when oneDNN takes bfloat16 weights here; otherwise its refusal. Its bfloat16 path
    needs AVX512-BW/VL/DQ or AVX-NE-CONVERT (and ONEDNN_MAX_CPU_ISA may cap it below them):
    without them the reorder raises, so a tiny weight asks it once at start-up, and bfloat16
    products keep F.linear there instead of failing at load."""
    if not onednn_available():
        return "oneDNN is not in use"
    try:
        weight = torch.ones(16, 16, dtype=torch.bfloat16)
        reordered = torch.ops.mkldnn._reorder_linear_weight(weight, None)
        torch.ops.mkldnn._linear_pointwise(weight, reordered, None, "none", [], "")
    except RuntimeError as error:
        return str(error).splitlines()[0]
    return None


def linear(x: torch.Tensor, weight: torch.Tensor, reordered: torch.Tensor | None) -> torch.Tensor:
    """x [rows, in] @ weight [out, in].T -> [rows, out], through oneDNN when `reordered` is
    the weight in its layout."""
    if reordered is None:
        return F.linear(x, weight)
    return torch.ops.mkldnn._linear_pointwise(x, reordered, None, "none", [], "")
