"""DeepSeek's multi-head latent attention (MLA) over the latent page layout (shared/kv/cache.py).

    hidden -> q_proj, or q_a_proj -> q_a_layernorm -> q_b_proj    q [T, H, nope + rope]
    hidden -> kv_a_proj_with_mqa -> | latent [T, R] | k_rope [T, P] |
              latent -> kv_a_layernorm; q's and k's rope parts rotated (interleaved pairs)
    cache row per token and layer: | normalized latent (R) | rotated k_rope (P) |
    int8 cache (kv_cache_dtype "int8"): | latent codes | scale | k_rope codes | scale |

Keys and values per head are never cached: `kv_b_proj` [H * (nope + v), R] makes them from the
latent. A prefill chunk decompresses its sequence's latents (k_nope and v per head, then plain
attention, the cheaper way for many queries); the step's decode rows attend together (blocks
padded to the longest, masked by length) in latent space with the absorbed projections
(q_nope @ W_uk gives a query over the latent, the latent itself is the value, and W_uv takes
the result out to v per head), reading R + P values per cached token:

    scores = (q_nope W_uk) . latent + q_rope . k_rope     out = (probs @ latent) W_uv^T

DeepSeek rotates the rope parts as complex numbers over consecutive pairs (x[2i], x[2i+1]),
not rotate-half: queries and keys both, so the cached keys keep that layout.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch
from torch import nn

from splitserve.engine.model.architecture import MLAConfig, ModelArchitecture
from splitserve.engine.model.attention_metadata import AttentionBackend, AttentionMetadata
from splitserve.engine.model.linear import Linear
from splitserve.engine.model.masked_attention import Segment, segments
from splitserve.engine.model.rotary import RotaryAngles
from splitserve.kernels import kv_int8

# DeepSeek's q_a_layernorm and kv_a_layernorm keep their default eps, not rms_norm_eps.
LATENT_NORM_EPS = 1e-6


class AllReduce(Protocol):
    def all_reduce(self, tensor: torch.Tensor) -> None: ...


class MLAAttention(nn.Module):
    # Tensor parallel (shared/parallel/layout.py): this rank's heads of q, kv_b_proj and
    # o_proj, the latent projection and its cache whole on every rank; o_proj is row-parallel,
    # summed over the ranks.
    tensor_parallel: AllReduce | None = None

    def __init__(self, arch: ModelArchitecture, norm: Callable[[int], nn.Module]) -> None:
        super().__init__()
        mla = arch.mla
        assert mla is not None, "MLAAttention needs an architecture with mla set"
        self.mla: MLAConfig = mla
        self.num_heads = heads = arch.num_heads
        self.scale = mla.softmax_scale
        self.window = 0  # LlamaForCausalLM sets every layer's; MLA models have none
        hidden = arch.hidden_size
        self.q_proj: Linear | None = None
        self.q_a_proj: Linear | None = None
        self.q_a_layernorm: nn.Module | None = None
        self.q_b_proj: Linear | None = None
        if mla.q_lora_rank is None:
            self.q_proj = Linear(hidden, heads * mla.qk_head_dim)
        else:
            self.q_a_proj = Linear(hidden, mla.q_lora_rank)
            self.q_a_layernorm = norm(mla.q_lora_rank)
            self.q_b_proj = Linear(mla.q_lora_rank, heads * mla.qk_head_dim)
        self.kv_a_proj_with_mqa = Linear(hidden, mla.latent_width)
        self.kv_a_layernorm = norm(mla.kv_lora_rank)
        # A plain nn.Linear: its weight stays readable (no oneDNN copy replaces it), since
        # decode reads it as the absorbed W_uk and W_uv.
        self.kv_b_proj = nn.Linear(
            mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim), bias=False
        )
        self.o_proj = Linear(heads * mla.v_head_dim, hidden)

    def forward(
        self,
        hidden: torch.Tensor,  # [num_tokens, hidden]
        rotary: RotaryAngles,
        layer_cache: torch.Tensor,  # [1, num_blocks, block_size, 1, R + P]
        meta: AttentionMetadata,
        backend: AttentionBackend,  # unused: MLA reads its own page layout
    ) -> torch.Tensor:
        mla, num_tokens = self.mla, hidden.shape[0]
        q = self._query(hidden).view(num_tokens, self.num_heads, mla.qk_head_dim)
        q_nope, q_rope = q.split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        latent, k_rope = self.kv_a_proj_with_mqa(hidden).split(
            [mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1
        )
        q_rope = rotate_pairs(q_rope, rotary)
        k_rope = rotate_pairs(k_rope.unsqueeze(1), rotary).squeeze(1)
        normed = self.kv_a_layernorm(latent)
        cache_rows = encode_rows(normed, k_rope, kv_int8.is_int8_cache(layer_cache))
        write_latent(layer_cache, meta.slot_mapping, cache_rows)
        out = hidden.new_empty(num_tokens, self.num_heads, mla.v_head_dim)
        decodes: list[Segment] = []
        for segment in segments(meta, layer_cache.shape[2]):
            if segment.rows.start < meta.num_decodes:  # one row each, attended together below
                decodes.append(segment)
                continue
            cached = decode_rows(read_latent(layer_cache, segment), self.mla, hidden.dtype)
            rows = segment.rows
            out[rows] = self._attend_decompressed(q_nope[rows], q_rope[rows], cached)
        if decodes:
            rows = slice(0, len(decodes))  # decode rows come first, in order
            assert [d.rows.start for d in decodes] == list(range(len(decodes))), "decode rows"
            out[rows] = self._attend_absorbed(q_nope[rows], q_rope[rows], layer_cache, decodes)
        out = self.o_proj(out.view(num_tokens, -1))
        if self.tensor_parallel is not None:
            self.tensor_parallel.all_reduce(out)
        return out

    def _query(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.q_proj is not None:
            return self.q_proj(hidden)
        assert self.q_a_proj is not None and self.q_a_layernorm is not None, "q_lora_rank set"
        assert self.q_b_proj is not None, "q_lora_rank set"
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))

    def _split_kv_b(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_uk [H, nope, R], W_uv [H, v, R]): kv_b_proj's rows per head."""
        mla = self.mla
        weight = self.kv_b_proj.weight.view(self.num_heads, -1, mla.kv_lora_rank)
        return weight.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=1)

    def _attend_absorbed(
        self,
        q_nope: torch.Tensor,  # [num_decodes, H, nope]
        q_rope: torch.Tensor,  # [num_decodes, H, P]
        layer_cache: torch.Tensor,
        decodes: list[Segment],
    ) -> torch.Tensor:
        """Every decode row at once, in latent space: no per-head key or value is formed.
        Rows read their blocks padded to the longest; keys past a row's length are masked."""
        w_uk, w_uv = self._split_kv_b()
        cached, lengths = read_latent_batch(layer_cache, decodes)
        cached = decode_rows(cached, self.mla, q_nope.dtype)  # [B, keys, R + P]
        latent, k_rope = cached.split([self.mla.kv_lora_rank, self.mla.qk_rope_head_dim], -1)
        q_latent = torch.einsum("bhn,hnr->bhr", q_nope, w_uk)
        scores = torch.einsum("bhr,bkr->bhk", q_latent, latent) + torch.einsum(
            "bhp,bkp->bhk", q_rope, k_rope
        )  # [B, H, keys]
        keys = torch.arange(cached.shape[1], device=cached.device)
        beyond = (keys.unsqueeze(0) >= lengths.unsqueeze(1)).unsqueeze(1)  # [B, 1, keys]
        scores = (scores * self.scale).masked_fill(beyond, float("-inf"))
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(scores.dtype)
        out_latent = torch.einsum("bhk,bkr->bhr", probs, latent)
        return torch.einsum("bhr,hvr->bhv", out_latent, w_uv)  # [B, H, v]

    def _attend_decompressed(
        self, q_nope: torch.Tensor, q_rope: torch.Tensor, cached: torch.Tensor
    ) -> torch.Tensor:
        """Per-head keys and values made from the latents, then plain attention."""
        mla, seq_len = self.mla, cached.shape[0]
        latent, k_rope = cached.split([mla.kv_lora_rank, mla.qk_rope_head_dim], -1)
        kv = self.kv_b_proj(latent).view(seq_len, self.num_heads, -1)
        k_nope, value = kv.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=-1)
        scores = torch.matmul(q_nope.transpose(0, 1), k_nope.permute(1, 2, 0)) + torch.matmul(
            q_rope.transpose(0, 1), k_rope.t()
        )  # [H, query_len, seq_len]
        probs = _causal_softmax(scores * self.scale, seq_len)
        return torch.matmul(probs, value.transpose(0, 1)).transpose(0, 1)  # [q, H, v]


def encode_rows(latent: torch.Tensor, k_rope: torch.Tensor, int8: bool) -> torch.Tensor:
    """Cache rows [T, width] of the normalized latent [T, R] and the rotated rope key [T, P]:
    the two side by side, or for an int8 cache (`int8`) each quantized with its own scale."""
    if not int8:
        return torch.cat((latent, k_rope), dim=-1)
    return torch.cat((kv_int8.quantize_rows(latent), kv_int8.quantize_rows(k_rope)), dim=-1)


def decode_rows(cached: torch.Tensor, mla: MLAConfig, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows [..., width] -> [..., R + P] values (an int8 cache's dequantized to
    `dtype`; a float cache's as they are)."""
    if not kv_int8.is_int8_cache(cached):
        return cached
    split = kv_int8.row_width(mla.kv_lora_rank)
    latent = kv_int8.dequantize_rows(cached[..., :split], dtype)
    return torch.cat((latent, kv_int8.dequantize_rows(cached[..., split:], dtype)), dim=-1)


def read_latent_batch(
    layer_cache: torch.Tensor, decodes: list[Segment]
) -> tuple[torch.Tensor, torch.Tensor]:
    """([B, keys, width] each row's cache rows (encode_rows'), padded to the longest; [B]
    lengths)."""
    block_size = layer_cache.shape[2]
    lengths = [segment.seq_len for segment in decodes]
    num_blocks = -(-max(lengths) // block_size)
    tables = torch.zeros(len(decodes), num_blocks, dtype=torch.int64, device=layer_cache.device)
    for row, segment in enumerate(decodes):  # padding reads block 0, masked by the length
        needed = -(-segment.seq_len // block_size)
        tables[row, :needed] = segment.block_ids[:needed]
    cached = layer_cache[0, tables].flatten(1, 2)[:, :, 0]  # [B, num_blocks * block_size, R+P]
    return cached, torch.tensor(lengths, device=layer_cache.device)


def _causal_softmax(scores: torch.Tensor, seq_len: int) -> torch.Tensor:
    """Softmax over keys (float32) of scores [H, query_len, seq_len] whose queries are the
    last query_len positions of the sequence."""
    query_len = scores.shape[1]
    if query_len > 1:
        query_pos = torch.arange(seq_len - query_len, seq_len, device=scores.device)
        key_pos = torch.arange(seq_len, device=scores.device)
        hidden = key_pos.unsqueeze(0) > query_pos.unsqueeze(1)
        scores = scores.masked_fill(hidden, float("-inf"))
    return torch.softmax(scores, dim=-1, dtype=torch.float32).to(scores.dtype)


def rotate_pairs(x: torch.Tensor, rotary: RotaryAngles) -> torch.Tensor:
    """DeepSeek's rotary: each consecutive pair (x[2i], x[2i+1]) turned by position * inv_freq[i]
    (as complex numbers, in float32). x: [num_tokens, heads, P]; rotary's cos/sin are
    [num_tokens, 1, P] in rotate-half order, whose first half holds each pair's angle."""
    half = x.shape[-1] // 2
    cos, sin = rotary.cos[..., :half].float(), rotary.sin[..., :half].float()
    pairs = x.float().unflatten(-1, (half, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    turned = torch.stack((even * cos - odd * sin, even * sin + odd * cos), dim=-1)
    return turned.flatten(-2).to(x.dtype)


def write_latent(layer_cache: torch.Tensor, slot_mapping: torch.Tensor, rows: torch.Tensor) -> None:
    """Writes token t's cache row [width] (encode_rows') into slot slot_mapping[t] (-1:
    padding, skipped); mutates layer_cache [1, num_blocks, block_size, 1, width]."""
    flat = layer_cache.view(-1, layer_cache.shape[-1])  # slot = block * block_size + offset
    keep = slot_mapping >= 0
    flat[slot_mapping[keep]] = rows[keep].to(flat.dtype)


def read_latent(layer_cache: torch.Tensor, segment: Segment) -> torch.Tensor:
    """The segment's cache rows [seq_len, width], in position order."""
    block_size = layer_cache.shape[2]
    num_blocks = -(-segment.seq_len // block_size)
    block_ids = segment.block_ids[:num_blocks].long()
    return layer_cache[0, block_ids].flatten(0, 1)[: segment.seq_len, 0]
