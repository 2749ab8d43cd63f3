"""Triton kernels for the engine's hot paths, each beside its PyTorch reference.

`splitserve.kernels.reference` holds the plain PyTorch versions (what the engine runs on the CPU)
and
imports no Triton. The Triton wrappers below are imported on first use, so `import kernels`
works where Triton is not installed; `has_triton()` says whether they can be used.

| wrapper                                  | module                    |
| ---------------------------------------- | ------------------------- |
| paged_decode_attention                   | splitserve.kernels.decode_attention  |
| paged_prefill_attention                  | splitserve.kernels.prefill_attention |
| write_kv, pack_kv_pages, unpack_kv_pages | splitserve.kernels.kv_cache_ops      |
| fused_add_rms_norm                       | splitserve.kernels.rms_norm          |
| rotary_embedding                         | splitserve.kernels.rotary            |
| grouped_gemm                             | splitserve.kernels.moe_gemm          |
| int8_matmul, int4_group_matmul           | splitserve.kernels.dequant_matmul    |
| add_lora_sgmv, make_segments             | splitserve.kernels.lora_sgmv         |

The engine uses the attention, KV, grouped-GEMM (MoE) and dequantizing-matmul (quantized
weights) wrappers on CUDA; `kernels/README.md` says which module serves whom, and why RMSNorm
and rotary are not wired into the model yet.

Module names differ from the wrappers' names on purpose: a submodule imported as
`splitserve.kernels.paged_decode_attention` would shadow the function of that name on the package.
"""

from __future__ import annotations

import importlib

_TRITON_WRAPPERS = {
    "paged_decode_attention": "splitserve.kernels.decode_attention",
    "paged_prefill_attention": "splitserve.kernels.prefill_attention",
    "write_kv": "splitserve.kernels.kv_cache_ops",
    "pack_kv_pages": "splitserve.kernels.kv_cache_ops",
    "unpack_kv_pages": "splitserve.kernels.kv_cache_ops",
    "fused_add_rms_norm": "splitserve.kernels.rms_norm",
    "rotary_embedding": "splitserve.kernels.rotary",
    "grouped_gemm": "splitserve.kernels.moe_gemm",
    "int8_matmul": "splitserve.kernels.dequant_matmul",
    "int4_group_matmul": "splitserve.kernels.dequant_matmul",
    "add_lora_sgmv": "splitserve.kernels.lora_sgmv",
    "make_segments": "splitserve.kernels.lora_sgmv",
}

__all__ = ["has_triton", *_TRITON_WRAPPERS]


def has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def __getattr__(name: str) -> object:
    module_name = _TRITON_WRAPPERS.get(name)
    if module_name is None:
        raise AttributeError(f"module 'splitserve.kernels' has no attribute {name!r}")
    return getattr(importlib.import_module(module_name), name)
