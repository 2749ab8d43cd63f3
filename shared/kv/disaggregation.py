"""The engine's side of disaggregated serving: what a decode pod reserves for a remote prefill,
what a prefill pod exports, and moving KV pages between the paged cache and a transport.

    decode pod                                   prefill pod
    reserve_remote_prefill -> RemotePrefillPlan  add_request(export_kv_from_block=k)
        (blocks allocated, cached prefix kept)       ... prefill, sample the first token
                                                     KVPageExporter packs blocks k.. (a step
                                                     observer, before the blocks are freed)
    receive_pages(plan) <--- pages + descriptor ---- send_pages(exported pages)
    complete_remote_prefill(RemotePrefillResult)
        (pages unpacked, joins the running batch)

The cache is `[num_layers, 2, num_blocks, block_size, kv_heads, head_dim]`, so one block's pages
are `num_layers * 2` separate runs in memory; a transfer therefore moves one packed, block-major
buffer `[num_blocks, num_layers, 2, block_size, kv_heads, head_dim]`, and the receiver pays one
scatter copy from it into its cache. `kv_heads` on the wire is always the model's (each head
once, model order), whatever the tensor-parallel layout of either pod: a TP pod gathers and
cuts its ranks' heads (shared/parallel/pages.py), so prefill and decode pods of different
layouts exchange pages. An int8 cache (kv_cache_dtype int8) packs int8 rows of head_dim + 2,
codes then scale (kernels/kv_int8.py): its pages move as they are, and a pod of the other
kv_cache_dtype refuses them (`KVTransferDescriptor.check_destination`). An MLA model's cache
(shared/kv/cache.py) is `[num_layers, 1, num_blocks, block_size, 1, latent]`: its pages move the
same way, one latent row per token and layer, and a pod of another layout refuses them by shape.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from splitserve.engine.kv.transfer.base import (
    KVReceiver,
    KVSender,
    KVTransferDescriptor,
    KVTransferError,
)
from splitserve.kernels import reference

if TYPE_CHECKING:
    from splitserve.engine.outputs import CompletionOutput
    from splitserve.engine.sampler import TokenLogprobs
    from splitserve.engine.step import StepResult


@dataclass(frozen=True)
class RemotePrefillPlan:
    """Where a prefill pod must put a request's prompt KV on this decode pod."""

    request_id: str
    num_cached_tokens: int  # prompt tokens this pod already holds (their blocks get no pages)
    first_block_index: int  # prompt block index of block_ids[0]
    block_ids: list[int]  # this pod's blocks for prompt blocks first_block_index, ...
    # [len(block_ids), num_layers, 2, block_size, num_kv_heads, head_dim]
    page_shape: tuple[int, ...]
    dtype: torch.dtype
    # The LoRA adapter the pages must be computed with (None: the base model).
    lora_name: str | None = None
    priority: int = 0  # the request's: the prefill pod queues the prompt by it


@dataclass
class RemotePrefillResult:
    """What a decode pod takes from a prefill pod: the first token and the prompt's pages."""

    first_token_id: int
    first_logprobs: TokenLogprobs | None
    kv_pages: torch.Tensor  # RemotePrefillPlan.page_shape, on any device
    # What the prefill pod served from its own cache, by tier (Tier.label -> tokens).
    prefill_cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    # The LoRA adapter the prefill pod computed the pages with (None: the base model); the
    # decode pod refuses pages of another adapter than its request's.
    lora_name: str | None = None


@dataclass(frozen=True)
class ExportedPrefill:
    """What a prefill pod's engine produced for one request: its one-token output and the
    packed pages of the prompt blocks the decode pod asked for."""

    output: CompletionOutput  # token_ids[0] is the first token; num_cached_tokens, timings
    kv_pages: torch.Tensor  # [num_blocks, num_layers, 2, block_size, kv_heads, head_dim]
    lora_name: str | None = None  # the adapter they were computed with; None: the base model

    @property
    def first_token_id(self) -> int:
        return self.output.token_ids[0]

    @property
    def first_logprobs(self) -> TokenLogprobs | None:
        """None unless the request asked for logprobs."""
        return self.output.logprobs[0] if self.output.logprobs else None


class PageIO(Protocol):
    """Pages of an engine's cache in and out of the wire layout (module docstring): the local
    cache here; a tensor-parallel engine's ranks in shared/parallel/pages.py."""

    def shape(self, num_blocks: int) -> tuple[int, ...]: ...

    def pack(self, block_ids: list[int]) -> torch.Tensor: ...

    def unpack(self, pages: torch.Tensor, block_ids: list[int]) -> None: ...


class LocalPages:
    """One process holds the whole cache: the wire layout is its own."""

    def __init__(self, kv_cache: torch.Tensor) -> None:
        self.kv_cache = kv_cache

    def shape(self, num_blocks: int) -> tuple[int, ...]:
        return page_shape(self.kv_cache, num_blocks)

    def pack(self, block_ids: list[int]) -> torch.Tensor:
        return pack_pages(self.kv_cache, block_ids)

    def unpack(self, pages: torch.Tensor, block_ids: list[int]) -> None:
        expected = self.shape(len(block_ids))
        if tuple(pages.shape) != expected:
            raise KVTransferError(
                f"pages of shape {tuple(pages.shape)} do not fit this cache's {expected} for "
                f"{len(block_ids)} blocks: prefill and decode pods must run the same model with "
                "the same block_size and group_window_layers"
            )
        unpack_pages(pages, self.kv_cache, block_ids)


class KVPageExporter:
    """A step observer that packs the prompt pages of requests marked `export_kv_from_block`
    in the step that samples their first token: it runs before `Scheduler.update` frees the
    blocks. Pages wait here until `take`n. `observe` runs on the engine thread, `take` on any."""

    def __init__(self, pages: PageIO) -> None:
        self.pages = pages
        self._lock = threading.Lock()
        self._pages: dict[str, torch.Tensor] = {}  # request id -> packed pages

    def observe(self, step: StepResult) -> None:
        for chunk in step.sched.chunks:
            request = chunk.request
            first_block = request.export_kv_from_block
            # The chunk that completes the prompt is the one whose pages are wanted.
            if first_block is None or not chunk.is_sampled or request.num_output_tokens:
                continue
            pages = self.pages.pack(chunk.page_block_ids(first_block))
            with self._lock:
                self._pages[request.request_id] = pages

    def take(self, request_id: str) -> torch.Tensor | None:
        """The request's pages (None if none were exported); forgets them."""
        with self._lock:
            return self._pages.pop(request_id, None)


# ---- pages in and out of the paged cache ---------------------------------------------------


def page_shape(kv_cache: torch.Tensor, num_blocks: int) -> tuple[int, ...]:
    """`[num_blocks, num_layers, 2, block_size, kv_heads, head_dim]` for this cache."""
    if kv_cache.dim() != 6 or kv_cache.shape[1] not in (1, 2):
        raise ValueError(
            "kv_cache must be [num_layers, 2, num_blocks, block_size, kv_heads, head_dim] "
            f"(or MLA's [num_layers, 1, num_blocks, block_size, 1, latent]), got "
            f"{tuple(kv_cache.shape)}"
        )
    num_layers, kv_parts, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    return (num_blocks, num_layers, kv_parts, block_size, num_kv_heads, head_dim)


def pack_pages(kv_cache: torch.Tensor, block_ids: list[int]) -> torch.Tensor:
    """Blocks' pages of every layer as one contiguous block-major buffer (a copy)."""
    if kv_cache.device.type == "cuda":
        # A heavy lazy load: the Triton kernel (and Triton) only where a CUDA cache is.
        from splitserve.kernels.kv_cache_ops import pack_kv_pages

        return pack_kv_pages(kv_cache, block_ids)
    return reference.pack_kv_pages(kv_cache, block_ids)


def unpack_pages(pages: torch.Tensor, kv_cache: torch.Tensor, block_ids: list[int]) -> None:
    """Writes a `pack_pages` buffer into `kv_cache` at `block_ids`; mutates kv_cache."""
    pages = pages.to(kv_cache.device)
    if kv_cache.device.type == "cuda":
        # A heavy lazy load, as in pack_pages.
        from splitserve.kernels.kv_cache_ops import unpack_kv_pages

        unpack_kv_pages(pages, kv_cache, block_ids)
    else:
        reference.unpack_kv_pages(pages, kv_cache, block_ids)


# ---- pages over a KV transport -------------------------------------------------------------


async def send_pages(
    sender: KVSender,
    address: str,
    request_id: str,
    pages: torch.Tensor,
    dst_block_ids: Sequence[int],
    timeout: float,
    checksum_algorithm: str | None = None,
) -> KVTransferDescriptor:
    """Sends packed `pages` to be stored at the receiver's `dst_block_ids` (one id per page
    block, same order). Returns the descriptor that was sent; raises KVTransferError."""
    if pages.shape[0] != len(dst_block_ids):
        raise ValueError(
            f"the pages hold {pages.shape[0]} blocks but dst_block_ids names "
            f"{len(dst_block_ids)} (src_block_ids and dst_block_ids must have the same length)"
        )
    descriptor = KVTransferDescriptor.for_buffer(
        request_id, dst_block_ids, pages, checksum_algorithm
    )
    await sender.send(address, descriptor, pages, timeout)
    return descriptor


async def receive_pages(
    receiver: KVReceiver, plan: RemotePrefillPlan, timeout: float
) -> tuple[torch.Tensor, KVTransferDescriptor]:
    """Receives `plan.request_id`'s pages into a new host buffer of `plan.page_shape` (checked
    against its checksum when it has one, and against the plan's blocks)."""
    staging = torch.empty(plan.page_shape, dtype=plan.dtype)
    descriptor = await receiver.receive(plan.request_id, staging, timeout)
    if list(descriptor.block_ids) != list(plan.block_ids):
        raise KVTransferError(
            f"request {plan.request_id}: pages for blocks {list(descriptor.block_ids)}, "
            f"expected {list(plan.block_ids)}"
        )
    return staging, descriptor
