"""C++ kernels for the CPU path, built on this machine on first use, with torch's cpp_extension.

Each kernel's reference is in splitserve.kernels.reference (`reference.` below) or the model:

| kernel                      | source                     | reference                          |
| --------------------------- | -------------------------- | ---------------------------------- |
| paged_decode_attention      | paged_decode_attention.cpp | reference.paged_decode_attention   |
| write_kv_int8               | write_kv_int8.cpp          | reference.write_kv (int8)          |
| rms_norm, add_rms_norm      | layer_ops.cpp              | reference.fused_add_rms_norm       |
| silu_and_mul                | layer_ops.cpp              | F.silu(gate) * up                  |
| rotary_split_qkv            | layer_ops.cpp              | reference.rotary_embedding         |
| rotary_split_qkv_into_cache | layer_ops.cpp              | the above, then reference.write_kv |
| DecodeLayers                | decode_layers.cpp          | shared/model/llama.py's layers     |
| int4_gemm                   | int4_gemm*.cpp             | Int4Weight.dequantize(), float64   |
| argmax_rows                 | step_lookups.cpp           | logits.max(dim=-1).indices         |
| int8_embedding              | step_lookups.cpp           | QuantizedEmbedding's torch lookup  |
| int8_gemv                   | int8_gemv.cpp              | Int8Weight.dequantize(), float64,  |
|                             |                            | reference.int16_group_activations  |

`module.cpp` binds them. The model reaches the layer ops through shared/model/layer_ops.py,
which calls the module directly (these wrappers' checks cost more than a decode row's work).

The build (g++ with OpenMP, -O3) is for a baseline, never for the build machine's own CPU,
because the wheel and the image carry it to other CPUs: x86-64-v3 (AVX2, FMA, F16C) on x86-64,
the compiler's default elsewhere (ARMv8-A: NEON). What needs more (int4_gemm's AVX-512 VNNI
variant) is compiled for it in its own file and chosen at run time (isa.py decides; `load()`
tells the module). On an x86-64 CPU below the baseline the module is not loaded at all.

The build takes about a minute once (2 cores); torch caches it under TORCH_EXTENSIONS_DIR (default
~/.cache/torch_extensions), named after a hash of its sources and flags, and later processes
import it directly, with no compiler and no write (prebuilt.py): a wheel builds it on first use,
the image's builder stage ahead of time. `scripts/install_deps.sh` builds it, so `make test` and
`make run` pay for it at install time. Where it cannot build (no compiler, no Python headers) or
SPLITSERVE_CPU_KERNELS=0, `load()` returns None, says why once (`unavailable_reason()`, naming
what is missing), and the engine keeps its PyTorch path.
"""

from __future__ import annotations

import functools
import logging
import os
from pathlib import Path
from types import ModuleType

import torch

from splitserve.kernels.cpu import isa, prebuilt

logger = logging.getLogger(__name__)

_SOURCES = [
    Path(__file__).with_name("paged_decode_attention.cpp"),
    Path(__file__).with_name("write_kv_int8.cpp"),
    Path(__file__).with_name("layer_ops.cpp"),
    Path(__file__).with_name("decode_layers.cpp"),
    Path(__file__).with_name("int4_gemm.cpp"),
    Path(__file__).with_name("int4_gemm_avx2.cpp"),
    Path(__file__).with_name("int4_gemm_avx512.cpp"),
    Path(__file__).with_name("int8_gemv.cpp"),
    Path(__file__).with_name("step_lookups.cpp"),
    Path(__file__).with_name("module.cpp"),
]  # kernels.h and int4_gemm.h declare what one file calls from another (hashed into the name).
_ENV = "SPLITSERVE_CPU_KERNELS"
# The built module's name adds a hash of its sources, headers and flags (prebuilt.py), so
# checkouts and installs sharing torch's extension cache never rebuild over each other; the
# version says which layout generation the kernels are.
# v2: int8 KV rows with their scales (attention reads them, write_kv_int8 writes).
# v3: the layer ops (layer_ops.cpp).
# v4: int4_gemm (int4_gemm.cpp), the int8 x int4 VNNI product for many rows.
# v5: a baseline build (no -march=native), int4_gemm in our own layout with AVX-512 VNNI /
#     AVX2 / generic variants chosen at run time.
_NAME = "splitserve_cpu_kernels_v5"


def load() -> ModuleType | None:
    """The compiled module, built first if needed; None where it cannot be had
    (`unavailable_reason()` says why)."""
    return _load_once()[0]


def unavailable_reason() -> str | None:
    """None when `load()` gives the module; otherwise why it does not."""
    return _load_once()[1]


@functools.cache
def _load_once() -> tuple[ModuleType | None, str | None]:
    if os.environ.get(_ENV, "1") == "0":
        return None, f"{_ENV}=0"
    below_baseline = isa.baseline_problem()
    if below_baseline is not None:
        return _unavailable(below_baseline)
    variant = isa.kernel_isa()  # a bad SPLITSERVE_CPU_ISA raises here, before any build
    flags = ["-O3", *_baseline_flags(), "-ffast-math", "-fopenmp"]
    # Named after what it is built from; built before (the image's builder stage, an earlier
    # process), it is imported as it is, with no compiler and no write (prebuilt.py says why).
    name = prebuilt.module_name(_NAME, _SOURCES, flags)
    try:
        module = prebuilt.load_prebuilt(name)
        if module is None:
            problem = prebuilt.build_problem()
            if problem is not None:
                return _unavailable(problem)
            prebuilt.clear_stale_lock(name)
            module = _build(name, flags)
            prebuilt.mark_built(name)
    except (OSError, RuntimeError, ImportError) as error:  # a failed build, a missing library
        return _unavailable(f"{type(error).__name__}: {error}")
    module.select_int4_isa(variant.name)
    logger.info("CPU kernels: int4_gemm runs its %s variant (%s)", variant.name, variant.reason)
    return module, None


def _unavailable(reason: str) -> tuple[None, str]:
    logger.warning("CPU kernels unavailable (%s); using the PyTorch path", reason)
    return None, reason


def _build(name: str, flags: list[str]) -> ModuleType:
    from torch.utils.cpp_extension import load as build_and_load

    with prebuilt.ninja_on_path():
        return build_and_load(
            name=name,
            sources=[str(path) for path in _SOURCES],
            extra_cflags=flags,
            extra_ldflags=["-fopenmp"],
            verbose=False,
        )


def _baseline_flags() -> list[str]:
    """What the whole module is compiled for (isa.X86_BASELINE on x86-64)."""
    if isa.cpu_features().is_x86:
        return ["-march=x86-64-v3", "-mtune=generic"]
    return []


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """`splitserve.kernels.reference.paged_decode_attention`, reading the cache in place (CPU);
    `window` and `softcap` as there (a window's earlier blocks are never read).

    query [num_seqs, num_heads, head_dim] float32; key_cache, value_cache [num_blocks,
    block_size, num_kv_heads, head_dim] float32, or int8 rows of head_dim + 2 (codes and their
    bfloat16 scale, splitserve.kernels.kv_int8); block_tables [num_seqs, max_blocks] int32; seq_lens
    [num_seqs] int32 (0: a padding row, zeros out)."""
    module = load()
    if module is None:
        raise RuntimeError("the CPU kernels are not available on this machine")
    _check(query, key_cache, value_cache, block_tables, seq_lens)
    if window < 0 or softcap < 0:
        raise ValueError(f"window and softcap must be >= 0, got {window} and {softcap}")
    return module.paged_decode_attention(
        query, key_cache, value_cache, block_tables, seq_lens, float(scale), int(window),
        float(softcap),
    )


def write_kv_int8(
    key: torch.Tensor, value: torch.Tensor, layer_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """`splitserve.kernels.reference.write_kv` into an int8 cache, quantizing in place of fourteen
    ops.

    key, value [num_tokens, num_kv_heads, head_dim] float32 (rows contiguous); layer_cache [2,
    num_blocks, block_size, num_kv_heads, head_dim + 2] int8, contiguous
    (splitserve.kernels.kv_int8);
    slot_mapping [num_tokens] int64, -1 skipped. Mutates layer_cache."""
    module = load()
    if module is None:
        raise RuntimeError("the CPU kernels are not available on this machine")
    for name, tensor in {"key": key, "value": value}.items():
        if tensor.dtype != torch.float32 or tensor.dim() != 3 or tensor.stride(-1) != 1:
            raise ValueError(
                f"{name} must be float32 [tokens, heads, head_dim] with rows "
                f"contiguous, got {tensor.dtype} {tuple(tensor.shape)}"
            )
    num_tokens, num_kv_heads, head_dim = key.shape
    if value.shape != key.shape:
        raise ValueError(f"value {tuple(value.shape)} differs from key {tuple(key.shape)}")
    if (
        layer_cache.dtype != torch.int8
        or not layer_cache.is_contiguous()
        or layer_cache.dim() != 5
        or layer_cache.shape[0] != 2
        or tuple(layer_cache.shape[3:]) != (num_kv_heads, head_dim + 2)
    ):
        raise ValueError(
            f"layer_cache must be a contiguous int8 [2, blocks, block_size, {num_kv_heads}, "
            f"{head_dim + 2}], got {layer_cache.dtype} {tuple(layer_cache.shape)}"
        )
    if slot_mapping.dtype != torch.int64 or slot_mapping.shape != (num_tokens,):
        raise ValueError(f"slot_mapping must be int64 [{num_tokens}]")
    module.write_kv_int8(key, value, layer_cache, slot_mapping.contiguous())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of float32 rows `x` [rows, hidden] by `weight` [hidden] (shared/model/llama.py's
    RMSNorm in float32)."""
    return _require().rms_norm(x, weight, float(eps))


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) for float32 rows [rows, hidden]."""
    normed, summed = _require().add_rms_norm(x, residual, weight, float(eps))
    return normed, summed


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up from float32 `gate_up` [rows, 2 * inner] (gate columns first)."""
    return _require().silu_and_mul(gate_up)


def rotary_split_qkv(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, num_heads: int, num_kv_heads: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q [rows, num_heads, head_dim] and k [rows, num_kv_heads, head_dim], rotated, and v,
    split from float32 `qkv` [rows, (num_heads + 2 * num_kv_heads) * head_dim]; cos and sin are
    the rows' angles [rows, head_dim] (both halves repeated, shared/model/rotary.py)."""
    q, k, v = _require().rotary_split_qkv(qkv, cos, sin, num_heads, num_kv_heads)
    return q, k, v


def rotary_split_qkv_into_cache(
    qkv: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    layer_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> torch.Tensor:
    """`rotary_split_qkv` with k and v written straight into their slots of a float32
    `layer_cache` [2, num_blocks, block_size, num_kv_heads, head_dim] (contiguous;
    `slot_mapping` [rows] int64, -1 skipped) -> q. Mutates layer_cache."""
    return _require().rotary_split_qkv_into_cache(
        qkv, cos, sin, num_heads, num_kv_heads, layer_cache, slot_mapping
    )


def _require() -> ModuleType:
    module = load()
    if module is None:
        raise RuntimeError("the CPU kernels are not available on this machine")
    return module


def _check(query, key_cache, value_cache, block_tables, seq_lens) -> None:
    tensors = {"query": query, "key_cache": key_cache, "value_cache": value_cache}
    for name, tensor in tensors.items():
        allowed = (torch.float32,) if name == "query" else (torch.float32, torch.int8)
        if tensor.dtype not in allowed or tensor.device.type != "cpu":
            raise ValueError(
                f"{name} must be a {' or '.join(map(str, allowed))} CPU tensor, got "
                f"{tensor.dtype} on {tensor.device}"
            )
        if not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    for name, tensor in {"block_tables": block_tables, "seq_lens": seq_lens}.items():
        if tensor.dtype != torch.int32 or not tensor.is_contiguous():
            raise ValueError(f"{name} must be a contiguous int32 tensor, got {tensor.dtype}")
    num_seqs, num_heads, head_dim = query.shape
    _, _, num_kv_heads, cache_dim = key_cache.shape
    row = head_dim + 2 if key_cache.dtype == torch.int8 else head_dim  # int8: codes, scale
    if value_cache.dtype != key_cache.dtype:
        raise ValueError(f"caches of {key_cache.dtype} and {value_cache.dtype}")
    if value_cache.shape != key_cache.shape or cache_dim != row:
        shapes = f"{tuple(key_cache.shape)} / {tuple(value_cache.shape)}"
        raise ValueError(f"caches {shapes} do not fit query {tuple(query.shape)}")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} kv heads")
    if block_tables.shape[0] != num_seqs or seq_lens.shape != (num_seqs,):
        raise ValueError("block_tables and seq_lens need one row per query")
    # Lengths and block ids are checked by the kernel itself (a RuntimeError): reading them
    # here would cost more than the attention of a short batch.
