"""The one place that picks the attention implementation for a device."""

from __future__ import annotations

import os

import torch

from splitserve.engine.model.attention import TorchPagedAttention
from splitserve.engine.model.attention_metadata import AttentionBackend


def select_attention_backend(
    device: torch.device, dtype: torch.dtype = torch.float32
) -> AttentionBackend:
    """The one place that picks the attention implementation for a device.

    The environment variable SPLITSERVE_ATTENTION_BACKEND=triton|torch overrides the choice:
    tests force the Triton path on the CPU under TRITON_INTERPRET=1, and a GPU run can fall
    back to the PyTorch path to compare the two.
    """
    choice = os.environ.get("SPLITSERVE_ATTENTION_BACKEND", "")
    if choice not in ("", "triton", "torch"):
        raise ValueError(
            f"SPLITSERVE_ATTENTION_BACKEND must be 'triton' or 'torch', got {choice!r}"
        )
    if choice == "triton" or (not choice and device.type == "cuda"):
        # optional: Triton, imported only where the Triton path is chosen
        from splitserve.engine.model.triton_attention import TritonPagedAttention

        return TritonPagedAttention()
    return TorchPagedAttention(dtype)
