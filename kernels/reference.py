"""Plain PyTorch versions of every kernel: the specification the Triton kernels are tested
against, and what the engine runs on the CPU.

They follow the same contracts as the Triton wrappers (same arguments, same layouts) but favour
obviousness over speed: one sequence at a time, math in float32, results cast once at the end.

KV layout: per layer a key cache and a value cache `[num_blocks, block_size, num_kv_heads,
head_dim]` (views `kv[l, 0]`, `kv[l, 1]` of `[num_layers, 2, num_blocks, block_size,
num_kv_heads, head_dim]`); token `t` of a sequence lives in slot
`block_tables[s, t // block_size] * block_size + t % block_size`. An int8 cache
(`splitserve.kernels.kv_int8`) has rows of `head_dim + 2` int8 elements, codes then their scale:
the write
quantizes and the attention dequantizes on read, to the query's dtype.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

from splitserve.kernels import kv_int8


class AddRMSNormOutput(NamedTuple):
    normed: torch.Tensor  # [num_tokens, hidden_size], rmsnorm(residual) * weight
    residual: torch.Tensor  # [num_tokens, hidden_size], x + residual (or x)


def gather_kv(
    cache: torch.Tensor, block_table: torch.Tensor, seq_len: int
) -> torch.Tensor:
    """The first `seq_len` tokens of one sequence, in order: `[seq_len, num_kv_heads, head_dim]`
    (float32 values when the cache is int8)."""
    block_size = cache.shape[1]
    num_blocks = -(-seq_len // block_size)
    pages = cache[block_table[:num_blocks].long()]  # [num_blocks, block_size, kv_heads, dim]
    rows = pages.reshape(-1, *cache.shape[2:])[:seq_len]
    if kv_int8.is_int8_cache(cache):  # int8 rows -> float32 values
        return kv_int8.dequantize_rows(rows, torch.float32)
    return rows


def _attend(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scale: float,
    context_len: int,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Causal attention of `query` rows at positions `context_len + i` over `keys`, in float32.

    query: [q_len, num_heads, head_dim]; keys, values: [seq_len, num_kv_heads, head_dim].
    window: a query sees only the `window` positions up to its own (0: all, Mistral's and
    Gemma's sliding windows); softcap: scores become softcap * tanh(scores / softcap) (0: not
    capped, Gemma 2's attention soft-capping).
    """
    q_len, num_heads, head_dim = query.shape
    seq_len, num_kv_heads, _ = keys.shape
    group = num_heads // num_kv_heads
    # Query head h reads kv head h // group, as Hugging Face's repeat_kv arranges them.
    q = query.float().reshape(q_len, num_kv_heads, group, head_dim)
    scores = torch.einsum("qhgd,khd->hgqk", q, keys.float()) * scale
    if softcap:
        scores = torch.tanh(scores / softcap) * softcap
    positions = context_len + torch.arange(q_len, device=query.device)
    key_positions = torch.arange(seq_len, device=query.device)[None, :]
    visible = key_positions <= positions[:, None]
    if window:
        visible &= key_positions > positions[:, None] - window
    scores = scores.masked_fill(~visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("hgqk,khd->qhgd", probs, values.float())
    return out.reshape(q_len, num_heads, head_dim)


def paged_decode_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """One query token per sequence, at position `seq_lens[s] - 1`, over all its keys (the
    last `window` of them with a window; `softcap` as `_attend`).

    query: [num_seqs, num_heads, head_dim]; returns the same shape. A sequence of length 0
    gets zeros (padding rows of a fixed-size batch).
    """
    result = torch.zeros_like(query)
    for s, seq_len in enumerate(seq_lens.tolist()):
        if seq_len == 0:
            continue
        keys = gather_kv(key_cache, block_tables[s], seq_len)
        values = gather_kv(value_cache, block_tables[s], seq_len)
        result[s] = _attend(query[s : s + 1], keys, values, scale, seq_len - 1, window,
                            softcap)[0]  # fmt: skip
    return _into(out, result)


def paged_prefill_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Causal attention of each sequence's new tokens over its cached prefix and themselves
    (`window`, `softcap` as `_attend`).

    Sequence s owns query rows `query_start_loc[s]:query_start_loc[s + 1]`:

        | cached prefix (seq_len - q_len) | new tokens (q_len), rows of query |

    and all seq_len keys and values are already in the cache.
    """
    result = torch.zeros_like(query)
    starts = query_start_loc.tolist()
    for s, seq_len in enumerate(seq_lens.tolist()):
        begin, end = starts[s], starts[s + 1]
        if end == begin:
            continue
        keys = gather_kv(key_cache, block_tables[s], seq_len)
        values = gather_kv(value_cache, block_tables[s], seq_len)
        context_len = seq_len - (end - begin)
        result[begin:end] = _attend(query[begin:end], keys, values, scale, context_len, window,
                                    softcap)  # fmt: skip
    return _into(out, result)


def write_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Writes token t's key/value `[num_kv_heads, head_dim]` into slot `slot_mapping[t]`.

    Mutates key_cache and value_cache; slot -1 marks a padding token and is skipped.
    """
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    block_size = key_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    if kv_int8.is_int8_cache(key_cache):
        key_cache[blocks, offsets] = kv_int8.quantize_rows(key[keep])
        value_cache[blocks, offsets] = kv_int8.quantize_rows(value[keep])
        return
    key_cache[blocks, offsets] = key[keep].to(key_cache.dtype)
    value_cache[blocks, offsets] = value[keep].to(value_cache.dtype)


def pack_kv_pages(
    kv_cache: torch.Tensor, block_ids: torch.Tensor | Sequence[int]
) -> torch.Tensor:
    """Copies blocks out of `[num_layers, 2, num_blocks, ...]` into a contiguous buffer
    `[n, num_layers, 2, block_size, num_kv_heads, head_dim]` (block-major)."""
    ids = torch.as_tensor(block_ids).tolist()
    # kv_parts: 2 (K, V), or 1 for MLA's latent pages (shared/kv/cache.py).
    num_layers, kv_parts, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    out = kv_cache.new_empty((len(ids), num_layers, kv_parts, block_size, num_kv_heads, head_dim))
    # One strided copy per block into its final place: gathering with an index tensor and then
    # permuting copied everything twice and ran about 10x slower on the CPU.
    for i, block_id in enumerate(ids):
        out[i].copy_(kv_cache[:, :, block_id])
    return out


def unpack_kv_pages(
    buffer: torch.Tensor, kv_cache: torch.Tensor, block_ids: torch.Tensor | Sequence[int]
) -> None:
    """The inverse of `pack_kv_pages`: mutates `kv_cache` at `block_ids`."""
    index = torch.as_tensor(block_ids, device=kv_cache.device).long()
    kv_cache[:, :, index] = buffer.permute(1, 2, 0, 3, 4, 5).to(kv_cache.dtype)


def fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> AddRMSNormOutput:
    """`residual' = x + residual` (rounded to x's dtype, as an unfused add would be), then
    `rmsnorm(residual') * weight` in float32, cast once. With residual None, residual' is x."""
    new_residual = x if residual is None else x + residual
    hidden = new_residual.float()
    rstd = torch.rsqrt(hidden.pow(2).mean(dim=-1, keepdim=True) + eps)
    normed = (hidden * rstd * weight.float()).to(x.dtype)
    return AddRMSNormOutput(normed, new_residual)


def rotary_cos_sin_cache(inv_freq: torch.Tensor, max_position: int) -> torch.Tensor:
    """`[max_position, head_dim]` float32: `[:, :head_dim/2]` = cos, `[:, head_dim/2:]` = sin
    of `position * inv_freq`, the table `rotary_embedding` reads."""
    positions = torch.arange(max_position, dtype=torch.float32, device=inv_freq.device)
    freqs = torch.outer(positions, inv_freq.float())  # [max_position, head_dim / 2]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1)


def rotary_embedding(
    query: torch.Tensor, key: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> None:
    """Hugging Face Llama's rotate-half RoPE, in place on query `[T, num_heads, D]` and key
    `[T, num_kv_heads, D]`: `x * cos + rotate_half(x) * sin` with `rotate_half(x) =
    cat(-x2, x1)` and cos, sin = the table's halves repeated twice."""
    half = cos_sin_cache.shape[1] // 2
    table = cos_sin_cache[positions.long()].float()  # [T, D]
    cos = torch.cat([table[:, :half], table[:, :half]], dim=-1)[:, None, :]
    sin = torch.cat([table[:, half:], table[:, half:]], dim=-1)[:, None, :]
    for x in (query, key):
        xf = x.float()
        rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
        x.copy_(xf * cos + rotated * sin)


def _into(out: torch.Tensor | None, result: torch.Tensor) -> torch.Tensor:
    if out is None:
        return result
    out.copy_(result)
    return out


def grouped_gemm(
    x: torch.Tensor,
    weights: torch.Tensor,
    expert_offsets: torch.Tensor,
    row_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rows `expert_offsets[e]:expert_offsets[e + 1]` of x [M, K] times weights[e] [N, K].T,
    each output row times `row_scale` [M] when given; [M, N] in x's dtype."""
    out = torch.empty(x.shape[0], weights.shape[1], dtype=x.dtype, device=x.device)
    bounds = expert_offsets.tolist()
    for expert in range(weights.shape[0]):
        start, end = bounds[expert], bounds[expert + 1]
        product = x[start:end].float() @ weights[expert].float().T
        if row_scale is not None:
            product = product * row_scale[start:end, None].float()
        out[start:end] = product.to(x.dtype)
    return out


# ---- weight-only quantized products (kernels/dequant_matmul.py) -----------------------------

INT4_GROUP_SIZE = 32  # columns per scale and minimum: one GGUF Q4 block


def pack_int4_groups(codes: torch.Tensor) -> torch.Tensor:
    """codes [N, K_pad] (values 0..15, K_pad a multiple of 32) -> [N, K_pad / 2] uint8: byte
    16g + j holds column 32g + j (low nibble) and 32g + j + 16 (high nibble), ggml's Q4 order."""
    rows, cols = codes.shape
    groups = codes.to(torch.uint8).view(rows, cols // INT4_GROUP_SIZE, 2, INT4_GROUP_SIZE // 2)
    return (groups[:, :, 0] | (groups[:, :, 1] << 4)).reshape(rows, cols // 2)


def unpack_int4_groups(packed: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_int4_groups: [N, K_pad / 2] uint8 -> codes [N, K_pad] uint8."""
    rows, num_bytes = packed.shape
    groups = packed.view(rows, num_bytes // (INT4_GROUP_SIZE // 2), 1, INT4_GROUP_SIZE // 2)
    return torch.cat([groups & 15, groups >> 4], dim=2).reshape(rows, num_bytes * 2)


def dequantize_int4_groups(
    packed: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor
) -> torch.Tensor:
    """float32 [N, K_pad]: `scales[n, g] * code + minimums[n, g]`, g = k // 32."""
    codes = unpack_int4_groups(packed).float()
    rows, cols = codes.shape
    grouped = codes.view(rows, cols // INT4_GROUP_SIZE, INT4_GROUP_SIZE)
    weight = grouped * scales.float()[..., None] + minimums.float()[..., None]
    return weight.view(rows, cols)


INT16_ACTIVATION_GROUP = 32  # columns per step of int16_group_activations


def int16_group_activations(x: torch.Tensor) -> torch.Tensor:
    """float32 [M, K] -> the values int8_gemv multiplies: each row's groups of 32 columns
    rounded to int16 steps of (the group's largest magnitude / 32767), nearest even, computed
    in float32 as the kernel does; returned dequantized, float64."""
    rows, cols = x.shape
    padded = -cols % INT16_ACTIVATION_GROUP
    groups = torch.nn.functional.pad(x.float(), (0, padded)).view(rows, -1, INT16_ACTIVATION_GROUP)
    largest = groups.abs().amax(dim=-1, keepdim=True)
    # A true float32 division (a Python number over a tensor is reciprocal-then-multiply in
    # torch, which moves exact halves of a step to the other side).
    inverse = torch.full_like(largest, 32767.0) / largest.clamp_min(torch.finfo(torch.float32).tiny)
    inverse = torch.where(largest > 0, inverse, torch.zeros_like(largest))
    codes = torch.round(groups * inverse)
    steps = largest / 32767.0
    return (codes.double() * steps.double()).view(rows, -1)[:, :cols]


def int8_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x [M, K] @ (codes [N, K_pad] * scales [N, 1])[:, :K].T -> [M, N] in x's dtype."""
    weight = codes[:, : x.shape[1]].float() * scales.float()[:, None]
    return (x.float() @ weight.T).to(x.dtype)


def int4_group_matmul(
    x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor
) -> torch.Tensor:
    """x [M, K] @ dequantize_int4_groups(...)[:, :K].T -> [M, N] in x's dtype."""
    weight = dequantize_int4_groups(packed, scales, minimums)[:, : x.shape[1]]
    return (x.float() @ weight.T).to(x.dtype)
