"""Continuous batching with chunked prefill, prefix caching, priorities and preemption.

Speculative decoding rides the same loop: a decoding request that speculates is scheduled as
1 + k tokens (its newest token and k draft slots, all counted against the budget), the engine's
proposer fills the drafts in, and `update` keeps what verification accepted:

    | computed | newest token | d1 .. dk (drafts) |      before the step
    | computed ...... | accepted drafts | next token |  after: the rejected slots are rolled back

One loop hands out a per-step token budget: running requests first (decodes, then unfinished
prefill chunks), then waiting requests by (priority, arrival). With a background cap
(SchedulerConfig.max_background_prefill_tokens, shared/step_importance.py), prompts less
important than the best priority sent lately wait out any step that computes an important
prompt (waiting important ones are admitted before a running background prompt's next chunk,
and may take the blocks it needed: it is then preempted and recomputed, from the prefix cache
where its blocks survive), and otherwise go in short steps. A request whose blocks cannot be
allocated preempts the least important running request (highest priority value, then newest) by
recomputation: its blocks are freed and it waits again with its tokens so far.

With offload tiers, an admission whose prefix continues in host memory or on disk takes its
blocks, starts loading them (`shared/kv/loads.py`) and waits aside (WAITING_FOR_KV_LOAD) while other
requests keep running; a later step takes the loaded blocks as computed and schedules the rest
of its prompt. A load that fails or outlives its deadline ends where it stands: what it did not
load is computed instead.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from splitserve.engine.config import SchedulerConfig
from splitserve.engine.kv.grouped_manager import GroupedKVManager
from splitserve.engine.kv.manager import KVCacheManager
from splitserve.engine.request import Request, RequestStatus
from splitserve.engine.step import ModelOutput, RequestUpdate, ScheduledChunk, SchedulerOutput
from splitserve.engine.step_importance import RecentBestPriority

if TYPE_CHECKING:
    from splitserve.engine.kv.loads import KVLoads
    from splitserve.engine.spec_decode.adaptive import SpeculationPolicy, StepPlan


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_manager: KVCacheManager | GroupedKVManager,
        max_model_len: int,
        eos_token_ids: tuple[int, ...],
        speculation: SpeculationPolicy | None = None,
        loads: KVLoads | None = None,
        max_loras: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`loads`: the offload tiers' loads (None without tiers): admissions whose cached
        prefix continues in a lower tier wait there for it. `max_loras`: multi-LoRA's slots;
        no more distinct adapters than that are ever admitted at once. `clock`: what "lately"
        is measured by for the config's importance window."""
        self.config = config
        self.speculation = speculation
        self.eos_token_ids = eos_token_ids
        self.kv = kv_manager
        self.max_model_len = max_model_len
        self.running: list[Request] = []
        # Heap of (priority, arrival_time, tie-break, request).
        self._waiting: list[tuple[int, float, int, Request]] = []
        self._tie_break = itertools.count()
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        # Requests ended inside schedule() (their context outgrew the cache), until taken.
        self._dropped: list[Request] = []
        self.loads = loads
        self.max_loras = max_loras
        # What is left this step of the prompt tokens a step may take (see _prefill_cap).
        self._prefill_budget = config.max_num_batched_tokens
        # The priorities sent lately, kept only where the background cap reads them.
        self._important = (
            None
            if config.max_background_prefill_tokens is None
            else RecentBestPriority(config.importance_window_s, clock)
        )

    # ---- admission and removal ------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        """Queues a validated request; the caller checked that its prompt fits the cache."""
        assert request.request_id not in self.requests, f"duplicate id {request.request_id}"
        self.requests[request.request_id] = request
        if self._important is not None:
            self._important.note(request.priority)
        self._push_waiting(request)

    def finish_requests(self, request_ids: list[str], status: RequestStatus) -> list[Request]:
        """Ends requests wherever they are (waiting or running) and frees their blocks."""
        assert status.is_finished, f"{status} is not a finished status"
        finished = []
        for request_id in request_ids:
            request = self.requests.pop(request_id, None)
            if request is None:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif request.status in _LOADING_OR_REMOTE:
                if self.loads is not None:
                    self.loads.stop(request_id)  # nothing writes its blocks after this
            else:
                self._remove_waiting(request)
            self.kv.free(request)
            request.drop_pending_token()  # ended while a step ran: that token never comes
            request.status = status
            finished.append(request)
        return finished

    @property
    def num_waiting(self) -> int:
        """Queued requests, and those whose KV a prefill pod is computing."""
        return len(self.requests) - len(self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting_for_admission(self) -> int:
        """Requests queued for blocks or a batch slot (preempted ones too); not those whose
        KV a prefill pod or a lower tier is filling: they hold their blocks already."""
        return len(self._waiting)

    @property
    def num_waiting_prompt_tokens(self) -> int:
        """Tokens this pod has taken on to prefill and not computed yet: the queued requests'
        (a preempted one recomputes its output too) and the running prompts' unfinished
        chunks. What a prefill pod computes for a request here is not counted."""
        queued = sum(entry[3].num_tokens - entry[3].num_computed_tokens for entry in self._waiting)
        return queued + sum(_num_prefill_tokens_left(r) for r in self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def has_schedulable_requests(self) -> bool:
        return bool(self.running or self._waiting or self._num_loading)

    @property
    def _num_loading(self) -> int:
        return len(self.loads) if self.loads is not None else 0

    # ---- one step ---------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(chunks=[])
        if self._num_loading:
            assert self.loads is not None, "loading needs the tiers"
            loaded = self.loads.take_due(nothing_else_to_run=not self.running and not self._waiting)
            self.running.extend(loaded)
        budget = self.config.max_num_batched_tokens
        self._prefill_budget = self._prefill_cap(budget)
        important = self._important_priority()
        # Decodes and the important prompts first; the others only in a step without one.
        budget = self._schedule_running(out, budget, important)
        budget = self._admit_unless_preempting(out, budget, important)
        if important is not None and not _computes_a_prompt(out):
            cap = self.config.max_background_prefill_tokens
            assert cap is not None, "an important priority needs the background cap"
            self._prefill_budget = min(self._prefill_budget, cap)
            budget = self._schedule_running(out, budget, important, background=True)
            self._admit_unless_preempting(out, budget, important, background=True)
        # Single-token chunks first: the runner attends to them in one batched call.
        out.chunks.sort(key=lambda chunk: chunk.num_tokens != 1)
        return out

    def _important_priority(self) -> int | None:
        """The priority at or better than which prompts are important this step; None when
        every prompt is alike (no background cap configured, or nothing sent lately)."""
        return None if self._important is None else self._important.current()

    def _admit_unless_preempting(
        self, out: SchedulerOutput, budget: int, important: int | None, background: bool = False
    ) -> int:
        """Admits waiting prompts into what is left of the budget (with an `important`
        priority: those at it or better, or for a `background` call those past it); the
        budget left after them."""
        if out.preempted_request_ids:
            return budget  # admitting now would only thrash: freed blocks go to running work
        return self._admit_waiting(out, budget, important, background)

    def _prefill_cap(self, budget: int) -> int:
        """Prompt tokens this step may take: the whole budget unless a running request decodes
        and the config caps prefill beside decodes."""
        cap = self.config.max_prefill_tokens_while_decoding
        if cap is None or not any(_is_decoding(r) for r in self.running):
            return budget
        return min(cap, budget)

    def _chunk_size(self, request: Request, budget: int) -> int:
        remaining = request.num_tokens - request.num_computed_tokens
        cap = self.config.long_prefill_token_threshold or budget
        return min(remaining, budget, cap)

    def _schedule_running(
        self,
        out: SchedulerOutput,
        budget: int,
        important: int | None = None,
        background: bool = False,
    ) -> int:
        """Schedules running requests into `budget`, returning what is left. With an
        `important` priority, the first call takes the decodes and the prompts at it or better,
        a `background` call the other prompts."""
        # Decodes first: they are one token each and every step they wait adds to their ITL.
        order = sorted(self.running, key=lambda r: not _is_decoding(r))
        if important is not None:
            order = [r for r in order if _is_background(r, important) == background]
        plan = self._speculation_plan(order)
        for request in order:
            if budget == 0:
                break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            if request.has_pending_token and self._reaches_length(request):
                continue  # async scheduling: its last token is on the device; nothing follows
            is_prefill = not _is_decoding(request)
            num_new = self._chunk_size(
                request, min(budget, self._prefill_budget) if is_prefill else budget
            )
            if num_new == 0:
                continue  # a prompt chunk, and this step's prefill share is spent
            num_drafts = self._num_draft_slots(request, budget, plan) if plan else 0
            if self._allocate_or_preempt(request, num_new + num_drafts, out):
                chunk = self._chunk(request, num_new)
                chunk.num_draft_slots = num_drafts
                out.chunks.append(chunk)
                budget -= num_new + num_drafts
                if is_prefill:
                    self._prefill_budget -= num_new
        return budget

    def _speculation_plan(self, running: list[Request]) -> StepPlan | None:
        """The step's verification plan, or None when this step does not speculate."""
        if self.speculation is None:
            return None
        num_decoding = sum(1 for r in running if _is_decoding(r))
        if not num_decoding or not self.speculation.is_active(num_decoding):
            return None
        return self.speculation.plan_step(num_decoding)

    def _num_draft_slots(self, request: Request, budget: int, plan: StepPlan) -> int:
        """k for a decoding request: what its acceptance rate earns, capped so the drafts fit
        the budget, max_tokens (the bonus token needs room too) and the context; 0 when its
        slots are not free, since drafts never preempt anybody."""
        assert self.speculation is not None, "only called while speculating"
        if not _is_decoding(request):
            return 0
        num_left = request.sampling_params.max_tokens - request.num_output_tokens - 1
        room = min(budget - 1, num_left, self.max_model_len - request.num_tokens)
        if room <= 0:
            return 0
        limit = min(room, self.speculation.max_draft_tokens)
        if not self.kv.can_allocate(request, 1 + limit) or self._drafts_would_crowd(limit):
            return 0
        return self.speculation.num_draft_tokens(request, plan, limit)

    def _drafts_would_crowd(self, num_drafts: int) -> bool:
        """Whether draft slots could take blocks a running request needs for its own next
        token this step: drafts must never cause a preemption. Keeps one block per running
        request in reserve (a decode needs at most one new block per step)."""
        draft_blocks = -(-num_drafts // self.kv.block_size) + 1  # a boundary can add one
        # With layer groups every position's block is one block in each group.
        groups = self.kv.num_groups
        return self.kv.num_free_blocks - draft_blocks * groups < len(self.running) * groups

    def _allocate_or_preempt(self, request: Request, num_new: int, out: SchedulerOutput) -> bool:
        """Allocates slots for `request`, preempting others until they fit. False if it was
        preempted itself (or finished because even an empty cache cannot hold it)."""
        while not self.kv.allocate_slots(request, num_new):
            victim = max(self.running, key=lambda r: (r.priority, r.arrival_time))
            if victim is request and len(self.running) == 1:
                # Alone and still out of blocks: its context has outgrown the whole cache.
                self._finish_for_capacity(request)
                return False
            self._preempt(victim, out)
            if victim is request:
                return False
        return True

    def _preempt(self, victim: Request, out: SchedulerOutput) -> None:
        scheduled = [c for c in out.chunks if c.request is victim]
        for chunk in scheduled:
            out.chunks.remove(chunk)  # its budget is not reclaimed: a rare, one-step loss
        self.running.remove(victim)
        self.kv.free(victim)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_tokens = 0
        victim.num_draft_computed_tokens = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        out.preempted_request_ids.append(victim.request_id)
        self._push_waiting(victim)

    def _finish_for_capacity(self, request: Request) -> None:
        self.finish_requests([request.request_id], RequestStatus.FINISHED_LENGTH)
        self._dropped.append(request)

    def take_dropped(self) -> list[Request]:
        dropped, self._dropped = self._dropped, []
        return dropped

    def _admit_waiting(
        self, out: SchedulerOutput, budget: int, important: int | None, background: bool = False
    ) -> int:
        room = min(budget, self._prefill_budget)
        while self._waiting and room > 0 and self._has_seq_room():
            request = self._waiting[0][3]
            if important is not None and (request.priority <= important) == background:
                # The queue is in priority order: past `important`, the rest are background
                # prompts; a background call finding an important one first (it got no
                # blocks this step) leaves it at the head, as the queue keeps its order.
                break
            if not self._has_lora_room(request):
                break  # its adapter waits for a slot; the queue keeps its order
            computed = self.kv.get_computed_blocks(request)
            if computed.load_hashes and self.loads is not None:
                if not self.loads.start_admission(request, computed):
                    break
                heapq.heappop(self._waiting)
                continue
            computed = computed.without_loads()
            remaining = request.num_tokens - computed.num_tokens
            num_new = min(remaining, room, self.config.long_prefill_token_threshold or room)
            if not self.kv.allocate_slots(request, num_new, computed):
                break  # admission only when blocks are free; the queue keeps its order
            heapq.heappop(self._waiting)
            request.num_computed_tokens = computed.num_tokens
            request.num_cached_tokens = computed.num_tokens
            request.loaded_tokens_by_tier = {}
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            out.chunks.append(self._chunk(request, num_new))
            room -= num_new
            budget -= num_new
            self._prefill_budget -= num_new
        return budget

    def _has_lora_room(self, request: Request) -> bool:
        """Whether admitting `request` keeps the admitted requests' distinct adapters within
        max_loras (admitted: running, or waiting for KV from a prefill pod or a lower tier)."""
        if request.lora_name is None or self.max_loras is None:
            return True
        admitted = {
            other.lora_name
            for other in self.requests.values()
            if RequestStatus.WAITING < other.status < RequestStatus.PREEMPTED
        }
        return request.lora_name in admitted or len(admitted - {None}) < self.max_loras

    def _has_seq_room(self) -> bool:
        return len(self.running) + self._num_loading < self.config.max_num_seqs

    def _chunk(self, request: Request, num_new: int) -> ScheduledChunk:
        start = request.num_computed_tokens
        return ScheduledChunk(
            request=request,
            start_position=start,
            num_tokens=num_new,
            block_ids=self.kv.get_block_ids(request.request_id),
            is_sampled=start + num_new == request.num_tokens,
            group_block_ids=self.kv.get_group_block_ids(request.request_id),
        )

    # ---- after the forward ------------------------------------------------------------------

    def update(self, sched: SchedulerOutput, model_out: ModelOutput) -> list[RequestUpdate]:
        """Advances computed-token counts, appends sampled tokens and finishes requests that
        hit EOS, a stop token, max_tokens or the context length. Stop strings are the output
        processor's to detect (they need text); it calls `finish_requests`."""
        updates = []
        for chunk in sched.chunks:
            request = chunk.request
            if request.is_finished:
                continue  # aborted while the step ran
            if chunk.is_verification:
                updates.append(self._update_verified(chunk, model_out))
                continue
            request.num_computed_tokens += chunk.num_tokens
            self.kv.cache_blocks(request, request.num_computed_tokens)
            self._release_out_of_window(request, request.num_computed_tokens)
            if not chunk.is_sampled:
                continue
            token_id = model_out.sampled_token_ids[request.request_id]
            request.append_output_token(token_id)
            updates.append(self._after_sampled_token(request, token_id, model_out))
        return updates

    def _after_sampled_token(
        self, request: Request, token_id: int, model_out: ModelOutput
    ) -> RequestUpdate:
        """The stop rules on the token just appended, and the update the output processor gets."""
        status = self._stop_status(request, token_id)
        if status is not None:
            self.finish_requests([request.request_id], status)
        logprobs = model_out.logprobs.get(request.request_id)
        finished = status is not None
        return RequestUpdate(request, [token_id], [logprobs] if logprobs else [], finished)

    # ---- async scheduling (shared/overlap.py): the update in two halves ----------------------

    def advance_launched(self, sched: SchedulerOutput) -> None:
        """What `update` does before the step's tokens are known: computed-token counts and the
        prefix cache advance, and each sampled chunk gets a pending token the next step can be
        scheduled with. Called once the step is on the device and the step before it resolved,
        so every token below the new counts is known."""
        for chunk in sched.chunks:
            request = chunk.request
            if request.is_finished:
                continue  # stopped by the step before, or aborted: its row here is wasted
            assert not chunk.is_verification, "speculation runs in order"
            request.num_computed_tokens += chunk.num_tokens
            self.kv.cache_blocks(request, request.num_computed_tokens)
            if chunk.is_sampled:
                request.append_pending_token()

    def resolve_launched(
        self, sched: SchedulerOutput, model_out: ModelOutput
    ) -> list[RequestUpdate]:
        """The other half, once the step's tokens reached the host: each pending token gets
        its id and the stop rules run, as in `update`. A request preempted meanwhile keeps the
        token (its recompute includes it)."""
        updates = []
        for chunk in sched.chunks:
            request = chunk.request
            if request.status == RequestStatus.RUNNING:
                # Not request.num_computed_tokens: the step after this one may be in flight
                # already, and its queries start where this chunk ended.
                self._release_out_of_window(request, chunk.start_position + chunk.num_tokens)
            if not chunk.is_sampled or request.is_finished:
                continue
            token_id = model_out.sampled_token_ids[request.request_id]
            request.resolve_pending_token(token_id)
            updates.append(self._after_sampled_token(request, token_id, model_out))
        return updates

    def _reaches_length(self, request: Request) -> bool:
        """max_tokens or the context length reached: no token may follow its newest one."""
        return (
            request.num_output_tokens >= request.sampling_params.max_tokens
            or request.num_tokens >= self.max_model_len
        )

    def _update_verified(self, chunk: ScheduledChunk, model_out: ModelOutput) -> RequestUpdate:
        """Appends the accepted drafts and the target's next token, stopping at the first that
        ends the request; the KV of everything after the accepted run is rolled back (those
        slots are simply written again next step, and never reach the prefix cache)."""
        request = chunk.request
        token_ids = model_out.verified_token_ids[request.request_id]
        num_accepted = len(token_ids) - 1
        assert self.speculation is not None, "verification needs a speculation policy"
        self.speculation.record(request, len(chunk.draft_token_ids), num_accepted)
        status = None
        num_appended = 0
        for token_id in token_ids:
            request.append_output_token(token_id)
            num_appended += 1
            status = self._stop_status(request, token_id)
            if status is not None:
                break
        # KV is valid for every token but the newest one (which the next step computes).
        request.num_computed_tokens = request.num_tokens - 1
        request.num_draft_computed_tokens = min(
            request.num_draft_computed_tokens, request.num_computed_tokens
        )
        self.kv.cache_blocks(request, request.num_computed_tokens)
        self._release_out_of_window(request, request.num_computed_tokens)
        if status is not None:
            self.finish_requests([request.request_id], status)
        logprobs = model_out.verified_logprobs.get(request.request_id, [])
        new_token_ids = token_ids[:num_appended]
        return RequestUpdate(request, new_token_ids, logprobs[:num_appended], status is not None)

    def _release_out_of_window(self, request: Request, num_settled_tokens: int) -> None:
        """Gives back the blocks that fell out of a windowed model's every window, once the
        step that moved the window has finished. A prefill pod's request keeps them: its
        pages go to a decode pod, which caches every one of them."""
        if request.export_kv_from_block is None:
            self.kv.release_out_of_window(request, num_settled_tokens)

    def _stop_status(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if token_id in params.stop_token_ids:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
            if not params.ignore_eos and token_id in self.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
        if self._reaches_length(request):
            return RequestStatus.FINISHED_LENGTH
        return None

    # ---- disaggregation: prompt KV computed by a prefill pod ---------------------------------

    def reserve_remote_kv(self, request: Request) -> int | None:
        """Allocates blocks for the whole prompt, reusing cached prefix blocks, without
        scheduling it: a prefill pod fills them. Returns the number of prompt tokens already
        cached here (their blocks need no pages), or None when the blocks are not free now.

        With offload tiers, the prefix found there is loaded meanwhile, and counts as cached:
        the prefill pod sends only the pages after it."""
        assert request.request_id not in self.requests, f"duplicate id {request.request_id}"
        if not self._has_lora_room(request):
            return None
        computed = self.kv.get_computed_blocks(request)
        if self.loads is None:
            computed = computed.without_loads()
        num_cached = computed.num_tokens + len(computed.load_hashes) * self.kv.block_size
        if not self.kv.allocate_slots(request, request.num_tokens - num_cached, computed):
            return None
        request.num_computed_tokens = computed.num_tokens
        request.num_cached_tokens = num_cached
        if computed.load_hashes:
            assert self.loads is not None, "loads found only with the tiers"
            self.loads.start_reserved(request, computed)
        request.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self.requests[request.request_id] = request
        return num_cached

    def complete_remote_kv(
        self,
        request_id: str,
        first_token_id: int,
        prefill_cached_tokens_by_tier: dict[str, int] | None = None,
    ) -> RequestUpdate | None:
        """The pages have landed: the prompt counts as computed and the prefill pod's first
        token is appended; the request joins the running batch unless that token ends it.
        When the prefill pod served more of the prompt from its cache than this pod holds,
        that is what the request reports as cached (nothing of it was computed). None when
        the request's own load from the offload tiers ended short: the caller falls back to
        a local prefill."""
        request = self.requests[request_id]
        assert request.status == RequestStatus.WAITING_FOR_REMOTE_KV, f"{request_id} not remote"
        if self.loads is not None and not self.loads.finish_reserved(request):
            return None
        remote = prefill_cached_tokens_by_tier or {}
        if sum(remote.values()) > request.num_cached_tokens:
            request.num_cached_tokens = sum(remote.values())
            request.loaded_tokens_by_tier = {k: v for k, v in remote.items() if k != "device"}
        request.num_computed_tokens = request.num_prompt_tokens
        self.kv.cache_blocks(request, request.num_computed_tokens)
        request.append_output_token(first_token_id)
        status = self._stop_status(request, first_token_id)
        if status is not None:
            self.finish_requests([request_id], status)
        else:
            request.status = RequestStatus.RUNNING
            self.running.append(request)
        return RequestUpdate(request, [first_token_id], [], status is not None)

    def fall_back_to_local_prefill(self, request_id: str) -> None:
        """The remote prefill failed: free the reserved blocks and queue a normal prefill."""
        request = self.requests[request_id]
        assert request.status == RequestStatus.WAITING_FOR_REMOTE_KV, f"{request_id} not remote"
        if self.loads is not None:
            self.loads.stop(request_id)
        self.kv.free(request)
        request.num_computed_tokens = 0
        request.status = RequestStatus.WAITING
        self._push_waiting(request)

    # ---- the waiting heap -------------------------------------------------------------------

    def _push_waiting(self, request: Request) -> None:
        entry = (request.priority, request.arrival_time, next(self._tie_break), request)
        heapq.heappush(self._waiting, entry)

    def _remove_waiting(self, request: Request) -> None:
        self._waiting = [entry for entry in self._waiting if entry[3] is not request]
        heapq.heapify(self._waiting)


_LOADING_OR_REMOTE = (RequestStatus.WAITING_FOR_KV_LOAD, RequestStatus.WAITING_FOR_REMOTE_KV)


def _num_prefill_tokens_left(request: Request) -> int:
    """A running request's prompt tokens still to compute (0 once it decodes)."""
    return 0 if _is_decoding(request) else request.num_tokens - request.num_computed_tokens


def _is_background(request: Request, important: int) -> bool:
    """A prompt less important than `important` (a decode never is: its row is running)."""
    return request.priority > important and not _is_decoding(request)


def _computes_a_prompt(out: SchedulerOutput) -> bool:
    return any(not chunk.is_decode for chunk in out.chunks)


def _is_decoding(request: Request) -> bool:
    """Only the newest token is left to compute."""
    return request.num_tokens - request.num_computed_tokens == 1
