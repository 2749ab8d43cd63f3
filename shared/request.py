"""A request's state as the engine tracks it, and its ordered status.

Token accounting is token-centric (one loop serves prefill, chunked prefill and decode):

    | computed (KV in cache) | scheduled this step | still to compute |
    0            num_computed_tokens            num_tokens

`num_tokens` counts prompt plus output tokens; a request is in decode when only its newest token
is left to compute.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from splitserve.engine.kv.block_hash import BlockHash
from splitserve.engine.kv.eviction import KEEP_LRU, Retention
from splitserve.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from splitserve.engine.structured_output.matcher import SequenceGrammar

# Async scheduling (shared/overlap.py): the output token of a step still running on the device,
# appended so the scheduler can schedule the next step; the runner feeds the next step that
# row's token from the device, and the step's resolution writes the real id over it.
PENDING_TOKEN = -1


class RequestStatus(enum.IntEnum):
    """Ordered so `status > PREEMPTED` is the whole `is_finished` test."""

    WAITING = 0
    WAITING_FOR_REMOTE_KV = 1  # disaggregation: blocks allocated, pages arriving from prefill
    WAITING_FOR_KV_LOAD = 2  # offload tiers: blocks allocated, cached KV loading into them
    RUNNING = 3
    PREEMPTED = 4
    FINISHED_STOPPED = 5  # EOS, a stop token id or a stop string
    FINISHED_LENGTH = 6  # max_tokens or the context length
    FINISHED_ABORTED = 7

    @property
    def is_finished(self) -> bool:
        return self > RequestStatus.PREEMPTED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
}


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    # Lower value = more important (vLLM's convention); preemption picks the highest value.
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    # Mixed into the first block's hash, e.g. a LoRA or multimodal identity, or a tenant's
    # cache salt; () for plain text.
    extra_hash_keys: tuple[str, ...] = ()
    # The LoRA adapter it runs with (shared/lora/); None = the base model.
    lora_name: str | None = None
    # What its cached blocks keep once it frees them (shared/kv/eviction.py).
    kv_retention: Retention = KEEP_LRU

    # Owned by the scheduler.
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    # Tokens whose KV came from the prefix cache at the last admission (for stats), and how
    # many of them were loaded from each lower tier (Tier.label -> tokens; the rest were in
    # the engine's pool).
    num_cached_tokens: int = 0
    loaded_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    # Prefill pods: pack the pages of prompt blocks from this index on once the first token
    # is sampled (set by the engine at admission, never changed).
    export_kv_from_block: int | None = None
    # Speculative decoding with a separate draft model: leading tokens whose draft-model KV
    # is in the cache. The proposer advances it; the scheduler cuts it back to
    # num_computed_tokens after a verification and to 0 on preemption.
    num_draft_computed_tokens: int = 0
    # Speculative decoding: the request's acceptance statistics
    # (splitserve.engine.spec_decode.adaptive
    # owns it; None until the request first speculates).
    spec_state: object | None = None
    # Structured outputs: where the output stands in its grammar (set at admission when the
    # params carry a structured_output; the step's mask computation advances it).
    grammar: SequenceGrammar | None = None

    # Owned by the KV cache manager: chained hashes of the full blocks of all_token_ids,
    # extended as tokens arrive and never recomputed.
    block_hashes: list[BlockHash] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.all_token_ids: list[int] = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def cached_tokens_by_tier(self) -> dict[str, int]:
        """Tier.label -> prompt tokens served from that tier's cache at the last admission
        (the pool's hits under "device"); {} when nothing was cached."""
        if not self.num_cached_tokens:
            return {}
        loaded = sum(self.loaded_tokens_by_tier.values())
        return {"device": self.num_cached_tokens - loaded, **self.loaded_tokens_by_tier}

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    # ---- async scheduling: at most one pending token, always the newest ----------------------

    @property
    def has_pending_token(self) -> bool:
        return bool(self.output_token_ids) and self.output_token_ids[-1] == PENDING_TOKEN

    @property
    def num_known_tokens(self) -> int:
        """num_tokens without a pending one: what block hashes may cover."""
        return self.num_tokens - self.has_pending_token

    def append_pending_token(self) -> None:
        assert not self.has_pending_token, "one step in flight at a time"
        self.append_output_token(PENDING_TOKEN)

    def resolve_pending_token(self, token_id: int) -> None:
        assert self.has_pending_token, f"request {self.request_id} has no pending token"
        self.output_token_ids[-1] = token_id
        self.all_token_ids[-1] = token_id

    def drop_pending_token(self) -> None:
        """Forgets a token that will never be resolved (the request ended meanwhile)."""
        if self.has_pending_token:
            self.output_token_ids.pop()
            self.all_token_ids.pop()
