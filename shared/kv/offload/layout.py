"""The shape of one KV block outside the engine's pool, shared by the host and disk stores.

The pool is [layers, 2, blocks, block_size, kv_heads, head_dim]; a block taken out of it is
[layers, 2, block_size, kv_heads, head_dim], contiguous, so a store keeps it as one run of
bytes: one memcpy to load it back, one file on disk. With kv_cache_dtype "int8" the pool's rows
are head_dim codes plus a 2-byte scale (kernels/kv_int8.py), so a block's bytes carry its codes
and scales together and the stores keep them as they are; `layout.json` names the format, and
a disk tier written in another one (or before the field existed) is emptied at start-up. An MLA
model's pool (shared/kv/cache.py) is [layers, 1, blocks, block_size, 1, latent]: `kv_parts` 1.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from splitserve.kernels import kv_int8


@dataclass(frozen=True)
class BlockLayout:
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str  # torch dtype name, e.g. "float32"
    # The prefix-cache hash namespace: blocks hashed under another one are not ours.
    hash_namespace: str
    # "auto" (values of `dtype`) or "int8" (rows of head_dim codes and a scale, dtype int8).
    kv_cache_dtype: str = "auto"
    # 2 (K and V per head), or 1 for MLA's latent pages.
    kv_parts: int = 2

    @classmethod
    def of_pool(cls, kv_cache: torch.Tensor, hash_namespace: str) -> BlockLayout:
        num_layers, kv_parts, _blocks, block_size, num_kv_heads, row = kv_cache.shape
        dtype = str(kv_cache.dtype).removeprefix("torch.")
        if kv_int8.is_int8_cache(kv_cache):
            head_dim = kv_int8.head_dim_of(kv_cache)
            return cls(
                num_layers,
                block_size,
                num_kv_heads,
                head_dim,
                dtype,
                hash_namespace,
                "int8",
                kv_parts,  # MLA's int8 latent pages too: one part
            )
        return cls(
            num_layers, block_size, num_kv_heads, row, dtype, hash_namespace, "auto", kv_parts
        )

    @property
    def row_width(self) -> int:
        """Elements of one (token, head) row in the pool: head_dim, plus int8's scale bytes."""
        if self.kv_cache_dtype == "int8":
            return kv_int8.row_width(self.head_dim)
        return self.head_dim

    @property
    def block_shape(self) -> tuple[int, ...]:
        return (self.num_layers, self.kv_parts, self.block_size, self.num_kv_heads, self.row_width)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def block_bytes(self) -> int:
        element_size = torch.empty((), dtype=self.torch_dtype).element_size()
        return element_size * self.num_layers * self.kv_parts * self.block_size * (
            self.num_kv_heads * self.row_width
        )

    def to_dict(self) -> dict[str, object]:
        fields = asdict(self)
        if self.kv_parts == 2:  # as before the field existed: K/V disk tiers stay valid
            del fields["kv_parts"]
        return fields


def pool_block(kv_cache: torch.Tensor, block_id: int) -> torch.Tensor:
    """A view of one block of the pool in the stores' layout (strided: a copy gathers it)."""
    return kv_cache[:, :, block_id]
