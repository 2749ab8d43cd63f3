"""What every attention implementation reads each step: the metadata the runner builds once per
step and the `AttentionBackend` interface. Its own module so the PyTorch path
(`splitserve.engine.model.attention`), the Triton path (`splitserve.engine.model.triton_attention`)
and the runner
share these types without importing one another."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch

from splitserve.engine.kv.groups import KVGroups
from splitserve.engine.model.decode_groups import DecodeGroup


@dataclass
class PrefillChunk:
    query_start: int  # first row of this chunk in the flattened batch
    query_len: int
    seq_len: int  # keys this chunk attends to: | cached prefix | this chunk |
    block_ids: torch.Tensor  # [ceil(seq_len / block_size)] int64, the blocks holding them


@dataclass
class AttentionMetadata:
    """Built once per step by the runner and shared by every layer."""

    slot_mapping: torch.Tensor  # [num_tokens] int64: where each new token's K/V is written
    num_decodes: int
    prefills: list[PrefillChunk]
    # The decode rows split by context length, together covering every decode row once; built
    # only for backends that gather blocks themselves (uses_block_tables False).
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    # The decode rows as block tables, for a CPU kernel that reads the cache in place (backends
    # whose reads_decodes_in_place is True); built instead of decode_groups then.
    decode_block_tables: torch.Tensor | None = None  # [num_decodes, max_blocks] int32
    decode_seq_lens: torch.Tensor | None = None  # [num_decodes] int32
    # Block-table form of every chunk's positions, for kernels that walk blocks themselves.
    block_tables: torch.Tensor | None = None  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor | None = None  # [num_seqs] int32
    query_start_loc: torch.Tensor | None = None  # [num_seqs + 1] int32
    # A mixed-window model's layer groups (shared/kv/groups.py): where each layer's pages are,
    # and the same fields for each group after the first (this metadata is group 0's).
    kv_groups: KVGroups | None = None
    group_metas: list[AttentionMetadata] = field(default_factory=list)

    def for_layer(self, layer: int) -> tuple[int, AttentionMetadata]:
        """The cache slot layer `layer`'s pages are in, and the metadata of its group."""
        if self.kv_groups is None:
            return layer, self
        group, slot = self.kv_groups.place(layer)
        return slot, self.group_metas[group - 1] if group else self


class AttentionBackend(Protocol):
    # True when `attend` reads meta.block_tables / seq_lens / query_start_loc (the runner only
    # builds them then).
    uses_block_tables: bool
    # True when decodes are attended through meta.decode_block_tables / decode_seq_lens
    # (otherwise, with uses_block_tables False, through meta.decode_groups).
    reads_decodes_in_place: bool
    # True when `attend` takes a sliding window and a soft-cap (keywords window, softcap);
    # otherwise such layers attend in shared/model/masked_attention.py.
    takes_window_and_softcap: bool

    def write_kv(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        layer_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None: ...

    def attend(
        self,
        query: torch.Tensor,
        layer_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int = 0,
        softcap: float = 0.0,
    ) -> torch.Tensor: ...
