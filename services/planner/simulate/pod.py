"""One simulated engine pod: the scheduler of `shared/scheduler.py` replayed on token counts.

Each step hands out a token budget the way the real scheduler does: running requests first
(decodes, then unfinished prefill chunks), then waiting requests in arrival order while their
blocks fit; a request that cannot get blocks preempts the newest running request, which is
recomputed later from scratch. The step's duration comes from the profile's cost model.

    | computed (KV in cache) | scheduled this step | still to compute |
    0                  num_computed                          num_tokens

Simplifications, on purpose: a request's blocks are counted as its own even when a prefix is
shared (over-counts KV use under prefix hits); a pod's prefix cache keeps every group it has
computed (no eviction); a preempted request finds none of its own blocks cached again.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from splitserve.common.pod_load import PodLoad
from splitserve.loadgen.workload import SimRequest
from splitserve.planner.profile import Profile
from splitserve.planner.simulate.prefix_cache import SimPrefixCache, TierSizes


@dataclass(eq=False)
class SimSeq:
    """A request's state on the pod that computes it (a disaggregated request has one on its
    prefill pod and one on its decode pod)."""

    request: SimRequest
    num_tokens: int  # prompt + tokens generated so far
    num_computed: int = 0
    num_blocks: int = 0  # blocks it holds on this pod
    # Prefill pods: the sequence ends when its first token is sampled (its KV then travels).
    is_prefill_only: bool = False
    # Decode pods: blocks reserved, KV arriving from a prefill pod; not schedulable yet.
    is_waiting_for_kv: bool = False
    num_drafts: int = 0  # draft tokens its decode row verifies in the step in flight

    @property
    def is_decode(self) -> bool:
        return self.num_tokens - self.num_computed == 1 and self.num_computed > 0


@dataclass(frozen=True)
class ScheduledStep:
    chunks: list[tuple[SimSeq, int]]  # (sequence, tokens computed this step)
    duration_s: float

    @property
    def kind(self) -> str:
        """ "prefill" if the step computes any prompt chunk, else "decode": the kinds
        `NeighborSlowdown` tells apart."""
        return "decode" if all(seq.is_decode for seq, _ in self.chunks) else "prefill"


@dataclass
class PodLimits:
    max_num_batched_tokens: int
    max_num_seqs: int
    num_kv_blocks: int
    block_size: int
    long_prefill_token_threshold: int | None = None
    max_prefill_tokens_while_decoding: int | None = None  # the engine's stall-free cap
    num_speculative_tokens: int = 0  # drafts each decode row verifies (0 = no speculation)
    tier_sizes: TierSizes = field(default_factory=TierSizes)  # KV offload tiers per pod


@dataclass(eq=False)
class SimPod:
    name: str
    limits: PodLimits
    profile: Profile
    running: list[SimSeq] = field(default_factory=list)
    num_free_blocks: int = 0
    is_busy: bool = False  # a step is in flight
    busy_s: float = 0.0  # total step time, for utilization
    num_preemptions: int = 0
    _prefill_budget: int = field(default=0, repr=False)  # this step's prompt tokens left
    cache: SimPrefixCache = field(init=False)
    # Heap of (arrival, tie-break, seq): waiting requests in arrival order.
    _waiting: list[tuple[float, int, SimSeq]] = field(default_factory=list)
    _tie_break: itertools.count = field(default_factory=itertools.count)
    num_reserved: int = 0  # sequences waiting for remote KV (hold blocks, not scheduled)
    min_free_blocks: int = 0  # the fewest free blocks seen, for the peak KV use
    dropped: list[SimSeq] = field(default_factory=list)  # ended for capacity, until taken

    def __post_init__(self) -> None:
        self.num_free_blocks = self.min_free_blocks = self.limits.num_kv_blocks
        self.cache = SimPrefixCache(self.limits.tier_sizes)

    @property
    def peak_kv_usage(self) -> float:
        return 1.0 - self.min_free_blocks / self.limits.num_kv_blocks

    # ---- load, as the gateway sees it ----------------------------------------------------

    @property
    def num_waiting(self) -> int:
        return len(self._waiting) + self.num_reserved

    @property
    def load(self) -> PodLoad:
        """What the pod's GetStats would answer now."""
        return PodLoad(
            num_running=len(self.running),
            num_waiting=self.num_waiting,
            kv_blocks_total=self.limits.num_kv_blocks,
            kv_blocks_free=self.num_free_blocks,
        )

    @property
    def num_queued_prompt_tokens(self) -> int:
        """Prompt tokens still to compute here, of waiting requests and of running ones mid-
        prefill (what a pod reports to the gateway's admission); cached prefixes of requests
        not yet scheduled are counted too, as the gateway cannot know them."""
        waiting = sum(seq.num_tokens - seq.num_computed for _, _, seq in self._waiting)
        running = sum(
            seq.num_tokens - seq.num_computed for seq in self.running if not seq.is_decode
        )
        return waiting + running

    def has_work(self) -> bool:
        return bool(self.running or self._waiting)

    def has_waiting(self) -> bool:
        return bool(self._waiting)

    def num_cached_tokens(self, request: SimRequest) -> int:
        """Prompt tokens this pod's prefix cache holds: whole blocks, and never the last
        prompt token (the engine always computes one, to sample from)."""
        if request.prefix_group is None or request.prefix_group not in self.cache:
            return 0
        return self._cacheable_tokens(request)

    def _cacheable_tokens(self, request: SimRequest) -> int:
        usable = min(request.prefix_len, request.input_len - 1)
        return usable // self.limits.block_size * self.limits.block_size

    def remember_prefix(self, request: SimRequest) -> None:
        """The request's prefix blocks were computed here: cached on the device, most recent."""
        if request.prefix_group is not None:
            num_blocks = self._cacheable_tokens(request) // self.limits.block_size
            self.cache.add(request.prefix_group, num_blocks)
            self.cache.fit(self.num_free_blocks)

    # ---- queueing ------------------------------------------------------------------------

    def add(self, seq: SimSeq) -> None:
        heapq.heappush(self._waiting, (seq.request.arrival_s, next(self._tie_break), seq))

    def try_reserve(self, seq: SimSeq) -> bool:
        """Blocks for the whole prompt, for a prefill pod to fill; False if not free now."""
        cached = self.num_cached_tokens(seq.request)
        needed = self._blocks_for(seq.num_tokens)
        if needed > self.num_free_blocks:
            return False
        self._take_blocks(needed)
        seq.num_blocks, seq.num_computed, seq.is_waiting_for_kv = needed, cached, True
        self.num_reserved += 1
        return True

    def complete_reserved(self, seq: SimSeq) -> None:
        """The KV landed: the prompt counts as computed and the request joins the batch."""
        self.num_reserved -= 1
        seq.is_waiting_for_kv = False
        seq.num_computed = seq.request.input_len
        self.running.append(seq)

    def finish(self, seq: SimSeq) -> None:
        if seq in self.running:
            self.running.remove(seq)
        self.num_free_blocks += seq.num_blocks
        seq.num_blocks = 0

    # ---- one step ------------------------------------------------------------------------

    def schedule(self) -> ScheduledStep:
        chunks: list[tuple[SimSeq, int]] = []
        self._prefill_budget = self._prefill_cap()
        budget, preempted = self._schedule_running(chunks, self.limits.max_num_batched_tokens)
        if not preempted:
            self._admit_waiting(chunks, min(budget, self._prefill_budget))
        return ScheduledStep(chunks, self._step_s(chunks))

    def _prefill_cap(self) -> int:
        """Prompt tokens this step may take, as the engine's scheduler decides it."""
        budget = self.limits.max_num_batched_tokens
        cap = self.limits.max_prefill_tokens_while_decoding
        if cap is None or not any(seq.is_decode for seq in self.running):
            return budget
        return min(cap, budget)

    def _chunk_size(self, seq: SimSeq, budget: int) -> int:
        cap = self.limits.long_prefill_token_threshold or budget
        return min(seq.num_tokens - seq.num_computed, budget, cap)

    def _schedule_running(self, chunks: list[tuple[SimSeq, int]], budget: int) -> tuple[int, bool]:
        preempted = False
        for seq in sorted(self.running, key=lambda s: not s.is_decode):
            if budget == 0:
                break
            if seq not in self.running:
                continue  # preempted earlier in this loop
            if seq.is_decode:
                num_new = self._chunk_size(seq, budget)
            else:
                num_new = self._chunk_size(seq, min(budget, self._prefill_budget))
                if num_new == 0:
                    continue  # this step's prompt share is spent
            if seq.is_decode and self.limits.num_speculative_tokens:
                num_new = min(1 + self.limits.num_speculative_tokens, budget)
            seq.num_drafts = num_new - 1 if seq.is_decode else 0
            while not self._allocate(seq, num_new):
                preempted = True
                victim = max(self.running, key=lambda s: s.request.arrival_s)
                if victim is seq and len(self.running) == 1:
                    # Alone and still out of blocks: it outgrew the cache (the engine ends it).
                    self.finish(seq)
                    self.dropped.append(seq)
                    break
                self._preempt(victim, chunks)
                if victim is seq:
                    break
            else:
                chunks.append((seq, num_new))
                budget -= num_new
                if not seq.is_decode:
                    self._prefill_budget -= num_new
        return budget, preempted

    def _admit_waiting(self, chunks: list[tuple[SimSeq, int]], budget: int) -> None:
        while self._waiting and budget > 0 and len(self.running) < self.limits.max_num_seqs:
            seq = self._waiting[0][2]
            if seq.num_blocks == 0:
                seq.num_computed = self.num_cached_tokens(seq.request)
            num_new = self._chunk_size(seq, budget)
            if not self._allocate(seq, num_new):
                break
            heapq.heappop(self._waiting)
            self.running.append(seq)
            chunks.append((seq, num_new))
            budget -= num_new

    def allocate_decode_block(self, seq: SimSeq) -> None:
        """Blocks for the next decode token of a row in a decode run, which planned them."""
        if not self._allocate(seq, 1):
            raise AssertionError(f"a decode run ran out of blocks on {self.name}")

    def _allocate(self, seq: SimSeq, num_new: int) -> bool:
        needed = self._blocks_for(seq.num_computed + num_new) - seq.num_blocks
        if needed <= 0:
            # Most steps of a row fit in its last block. Free blocks never go below zero and
            # the cache already fits them, so taking none would change nothing.
            return True
        if needed > self.num_free_blocks:
            return False
        self._take_blocks(needed)
        seq.num_blocks += needed
        return True

    def _take_blocks(self, num_blocks: int) -> None:
        self.num_free_blocks -= num_blocks
        self.min_free_blocks = min(self.min_free_blocks, self.num_free_blocks)
        self.cache.fit(self.num_free_blocks)  # cached prefixes live in the free blocks

    def _preempt(self, victim: SimSeq, chunks: list[tuple[SimSeq, int]]) -> None:
        chunks[:] = [(seq, n) for seq, n in chunks if seq is not victim]
        self.finish(victim)
        victim.num_computed = 0
        self.num_preemptions += 1
        self.add(victim)

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.limits.block_size)

    def _step_s(self, chunks: list[tuple[SimSeq, int]]) -> float:
        prefill_chunks = []
        num_decodes = context_sum = 0
        for seq, num_new in chunks:
            if seq.is_decode:  # one row, or 1 + drafts rows being verified
                num_decodes += num_new
                context_sum += seq.num_tokens * num_new
            else:
                prefill_chunks.append((num_new, seq.num_computed))
        return self.profile.step_s(prefill_chunks, num_decodes, context_sum)

    def apply(self, step: ScheduledStep) -> list[SimSeq]:
        """Advances the computed counts after the step; returns the sequences that sampled
        a token (their chunk reached the newest token; a verified row counts its drafts'
        KV once the simulation knows how many were accepted)."""
        sampled = []
        for seq, num_new in step.chunks:
            if seq not in self.running:
                continue  # finished or preempted meanwhile
            seq.num_computed = min(seq.num_computed + num_new, seq.num_tokens)
            if seq.num_computed == seq.num_tokens:
                sampled.append(seq)
        return sampled
