"""The engine core: validate, schedule, run, sample, detokenize, one step at a time.

    sched = scheduler.schedule()          # which requests, how many tokens each
    model_out = runner.execute(sched)     # one batched forward + sampling
    updates = scheduler.update(sched, model_out)

The types of the step are in `splitserve.engine.step`. What else happens around a forward pass
(telemetry, the speculation policy's cost curve, exporting a prefill pod's pages) is a
`StepObserver` of the `StepResult`; the step itself stays these lines. The parts are built by
`splitserve.engine.parts`; this class only drives them.

Not thread-safe: one thread drives it (the offline `LLM` or `AsyncLLM`'s engine thread).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from splitserve.engine.config import EngineConfig
from splitserve.engine.kv.block_hash import BlockHash, cache_salt_keys, quota_tenant
from splitserve.engine.kv.disaggregation import RemotePrefillPlan, RemotePrefillResult
from splitserve.engine.kv.events import KVCacheEvent
from splitserve.engine.kv.eviction import retention_for
from splitserve.engine.kv.offload.stats import KVTierStats, tier_stats
from splitserve.engine.kv.tiers import Tier
from splitserve.engine.lora.request import LoRARequest, lora_hash_keys
from splitserve.engine.model.moe_layer import expert_token_counts
from splitserve.engine.outputs import StreamDelta
from splitserve.engine.overlap import OverlappedSteps
from splitserve.engine.params_check import check_params
from splitserve.engine.parts import build_parts
from splitserve.engine.prompts import check_prompt
from splitserve.engine.request import Request, RequestStatus
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.step import ModelOutput, RequestUpdate, SchedulerOutput, StepResult
from splitserve.engine.structured_output.matcher import StepMasks

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineStats:
    num_running: int
    num_waiting: int
    num_kv_blocks_total: int
    num_kv_blocks_free: int
    num_preemptions: int
    prefix_cache_queried_tokens: int
    prefix_cache_hit_tokens: int
    # Speculative decoding, cumulative (0 without a proposer): draft tokens proposed and
    # accepted, and verifications (one per request per step that verified drafts).
    num_spec_proposed_tokens: int = 0
    num_spec_accepted_tokens: int = 0
    num_spec_verify_steps: int = 0
    # The cache's tiers: blocks, hits, writes, loads, evictions, measured costs.
    kv_tiers: KVTierStats = field(default_factory=KVTierStats)
    # Mixture-of-experts models: token-expert assignments per expert, cumulative, summed over
    # the layers (shared/model/moe_layer.py); () for a dense model.
    moe_expert_tokens: tuple[int, ...] = ()
    # Of num_waiting, the requests queued for blocks or a batch slot (not those whose KV is
    # arriving from a prefill pod or a lower tier): what a decode pod bounds.
    num_waiting_for_admission: int = 0
    # Prompt tokens admitted and not computed yet (Scheduler.num_waiting_prompt_tokens).
    num_waiting_prompt_tokens: int = 0

    @property
    def spec_acceptance_rate(self) -> float:
        if not self.num_spec_proposed_tokens:
            return 0.0
        return self.num_spec_accepted_tokens / self.num_spec_proposed_tokens

    @property
    def spec_mean_accepted_length(self) -> float:
        """Draft tokens accepted per verification (the bonus token not counted)."""
        if not self.num_spec_verify_steps:
            return 0.0
        return self.num_spec_accepted_tokens / self.num_spec_verify_steps

    @property
    def kv_usage(self) -> float:
        return 1.0 - self.num_kv_blocks_free / self.num_kv_blocks_total


@dataclass(frozen=True)
class LoRAInfo:
    """vLLM's lora_requests_info, plus the slots' cumulative loads and evictions."""

    running_adapters: tuple[str, ...] = ()
    waiting_adapters: tuple[str, ...] = ()
    resident_adapters: tuple[str, ...] = ()  # in active slots, least recently used first
    max_loras: int = 0
    num_slot_loads: int = 0
    num_slot_evictions: int = 0


class EngineCore:
    def __init__(self, config: EngineConfig, progress=None) -> None:
        """Loads the model (reporting to `progress`) and builds the parts (shared/parts.py)."""
        self.config = config
        parts = build_parts(config, progress)
        loaded = parts.model
        self.architecture = loaded.architecture
        self.tokenizer = loaded.tokenizer
        self.model_name = loaded.model_name
        self.max_model_len = loaded.max_model_len
        self.eos_token_ids = loaded.eos_token_ids
        self.kv_spec = loaded.kv_spec
        self.parallel = loaded.parallel
        self.kv_manager = parts.kv.manager
        self.offloader = parts.kv.offloader
        self.scheduler = parts.scheduler
        self.runner = parts.runner
        self.speculation = parts.speculation
        self.speculator = parts.speculator
        self.output_processor = parts.output_processor
        self.grammars = parts.grammars
        self.pages = parts.pages
        self.kv_exporter = parts.kv_exporter
        self.step_observers = parts.step_observers
        self.thread_tuner = parts.thread_tuner
        self._num_threads = torch.get_num_threads()
        self._moe_blocks = parts.moe_blocks
        self.lora = parts.lora
        # Async scheduling: one step in flight while the host prepares the next.
        self.overlap = OverlappedSteps(self) if config.scheduler.async_scheduling else None

    # ---- requests ---------------------------------------------------------------------------

    def validate_request(
        self, prompt_token_ids: object, params: object, priority: object = 0
    ) -> None:
        """Raises ValueError for a request this engine can never serve. Read-only: safe to call
        from any thread, so front ends check a whole batch before queueing any of it."""
        self.validate_prompt(prompt_token_ids)
        check_params(params, self.architecture.vocab_size)
        if isinstance(priority, bool) or not isinstance(priority, int):
            raise ValueError(f"priority must be an integer, got {priority!r}")
        assert isinstance(params, SamplingParams), "its check raised otherwise"
        retention_s, max_retention_s = params.cache_retention_s, self.config.cache.max_retention_s
        if retention_s is not None and retention_s > max_retention_s:
            raise ValueError(
                f"cache_retention_s must be at most {max_retention_s:g} (this engine's "
                f"max_retention_s), got {retention_s:g}"
            )

    def validate_prompt(self, prompt_token_ids: object) -> None:
        """Raises ValueError for a prompt this engine can never serve. Read-only: safe to call
        from any thread."""
        check_prompt(
            prompt_token_ids,
            self.architecture.vocab_size,
            self.max_model_len,
            block_size=self.kv_spec.block_size,
            num_kv_blocks=self.kv_spec.num_position_blocks,
        )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        index: int = 0,
        arrival_time: float | None = None,
        export_kv_from_block: int | None = None,
        resumed_output: Sequence[int] = (),
        lora_request: LoRARequest | None = None,
    ) -> None:
        """Validates and queues one sequence (n > 1 is fanned out by the callers).

        `export_kv_from_block` (prefill pods): when the request's first token is sampled, the
        pages of its prompt blocks from that index on are packed for `take_exported_pages`.
        `resumed_output`: tokens the sequence already generated elsewhere (a migration from a
        pod that died): they count as output (max_tokens, penalties, the seeded generator's
        draws, the grammar) but are not streamed again, and generation continues after them.
        `lora_request`: the adapter it runs with (registered, read from disk if new); None =
        the base model."""
        request = self._new_request(
            request_id,
            prompt_token_ids,
            params,
            priority,
            arrival_time,
            resumed_output,
            lora_request,
        )
        request.export_kv_from_block = export_kv_from_block
        self.scheduler.add_request(request)
        self.output_processor.add(request, index, resumed_output)

    def _new_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int,
        arrival_time: float | None = None,
        resumed_output: Sequence[int] = (),
        lora_request: LoRARequest | None = None,
    ) -> Request:
        self.validate_request(prompt_token_ids, params, priority)
        self.add_lora(lora_request)
        if resumed_output:
            self._validate_resumed_output(prompt_token_ids, resumed_output, params)
        if request_id in self.scheduler.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")
        request = Request(request_id, list(prompt_token_ids), params, priority=priority)
        request.lora_name = lora_request.lora_name if lora_request is not None else None
        for token_id in resumed_output:
            request.append_output_token(token_id)
        self._apply_cache_options(request)
        if params.structured_output is not None:
            request.grammar = self.grammars.new_sequence(params.structured_output)
        if arrival_time is not None:
            request.arrival_time = arrival_time
        return request

    def _apply_cache_options(self, request: Request) -> None:
        """The tenant's salt into the block hashes; the eviction policy's retention."""
        params, cache = request.sampling_params, self.config.cache
        request.extra_hash_keys = cache_salt_keys(params.cache_salt) + lora_hash_keys(
            request.lora_name
        )
        request.kv_retention = retention_for(
            cache.eviction_policy,
            request.priority,
            cache.idle_ttl_s,
            params.cache_retention_s,
            tenant=quota_tenant(params.cache_salt),
        )

    def _validate_resumed_output(
        self, prompt_token_ids: list[int], resumed_output: Sequence[int], params: SamplingParams
    ) -> None:
        if len(resumed_output) >= params.max_tokens:
            raise ValueError(
                f"resumed_output has {len(resumed_output)} tokens, which leaves nothing of "
                f"max_tokens={params.max_tokens} to generate"
            )
        # As a prompt, prompt + resumed output must fit and leave room for a token.
        self.validate_prompt(list(prompt_token_ids) + list(resumed_output))

    # ---- disaggregation (see shared/kv/disaggregation.py) -----------------------------------

    def reserve_remote_prefill(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
        lora_request: LoRARequest | None = None,
    ) -> RemotePrefillPlan | None:
        """Allocates the request's blocks for a prefill pod to fill; None when they are not
        free now, or its adapter would need a slot no step has now (the caller then prefills
        locally with `add_request`). The prefill pod must run the same `lora_request`."""
        request = self._new_request(
            request_id, prompt_token_ids, params, priority, lora_request=lora_request
        )
        num_cached = self.scheduler.reserve_remote_kv(request)
        if num_cached is None:
            return None
        self.output_processor.add(request, 0)
        first_block = num_cached // self.kv_spec.block_size
        block_ids = self.kv_manager.page_block_ids(request_id, first_block)
        return RemotePrefillPlan(
            request_id,
            num_cached,
            first_block,
            block_ids,
            self.pages.shape(len(block_ids)),
            self.runner.kv_cache.dtype,
            request.lora_name,
            priority,
        )

    def complete_remote_prefill(
        self, request_id: str, result: RemotePrefillResult
    ) -> list[StreamDelta]:
        """Writes the received pages into the reserved blocks and appends the prefill pod's
        first token; the request then decodes here. A request aborted meanwhile is ignored.
        Pages computed under another LoRA adapter than the request's (or under one when it
        has none) are refused: the request is prefilled here instead."""
        request = self.scheduler.requests.get(request_id)
        if request is None or request.status != RequestStatus.WAITING_FOR_REMOTE_KV:
            return []
        if result.lora_name != request.lora_name:
            logger.warning(
                "request %s: refused KV pages computed with adapter %r, the request runs with "
                "%r; prefilling locally",
                request_id,
                result.lora_name,
                request.lora_name,
            )
            self.scheduler.fall_back_to_local_prefill(request_id)
            return []
        first_block = request.num_cached_tokens // self.kv_spec.block_size
        block_ids = self.kv_manager.page_block_ids(request_id, first_block)
        self.pages.unpack(result.kv_pages, block_ids)
        update = self.scheduler.complete_remote_kv(
            request_id, result.first_token_id, result.prefill_cached_tokens_by_tier
        )
        if update is None:  # its own load from the offload tiers failed: compute it here
            self.scheduler.fall_back_to_local_prefill(request_id)
            return []
        if result.first_logprobs is not None:
            update.logprobs.append(result.first_logprobs)
        return self.output_processor.process([update]).deltas

    def fall_back_to_local_prefill(self, request_id: str) -> None:
        """The remote prefill failed: the reserved blocks are freed and the prompt is queued
        for this engine to prefill. A request aborted meanwhile is ignored."""
        request = self.scheduler.requests.get(request_id)
        if request is not None and request.status == RequestStatus.WAITING_FOR_REMOTE_KV:
            self.scheduler.fall_back_to_local_prefill(request_id)

    def abort_requests(self, request_ids: list[str]) -> list[StreamDelta]:
        finished = self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        self.runner.release([request.request_id for request in finished])
        for request_id in request_ids:  # pages exported before the abort: nobody takes them
            self.kv_exporter.take(request_id)
        deltas = [self.output_processor.abort(request) for request in finished]
        return [delta for delta in deltas if delta is not None]

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def has_schedulable_requests(self) -> bool:
        """False when every unfinished request waits for remote KV (a step would do nothing)."""
        return self.scheduler.has_schedulable_requests()

    # ---- LoRA adapters (shared/lora/) --------------------------------------------------------

    def add_lora(self, lora_request: LoRARequest | None) -> None:
        """Registers the adapter and reads it to the host (a no-op for one registered as it
        is, or None); ValueError when LoRA is off or the adapter cannot run here."""
        if lora_request is None:
            return
        if self.lora is None:
            raise ValueError(
                f"LoRA adapter {lora_request.lora_name!r} requested but this engine was "
                "started without enable_lora"
            )
        self.lora.register(lora_request)

    def remove_lora(self, lora_name: str) -> bool:
        """Forgets the adapter; False if it was not registered. ValueError while a request
        still runs with it."""
        if self.lora is None:
            return False
        users = [r.request_id for r in self.scheduler.requests.values() if r.lora_name == lora_name]
        if users:
            raise ValueError(
                f"LoRA adapter {lora_name!r} is in use by {len(users)} request(s); retry later"
            )
        return self.lora.unregister(lora_name)

    def list_loras(self) -> list[LoRARequest]:
        return [] if self.lora is None else self.lora.registered()

    def lora_info(self) -> LoRAInfo:
        """Which adapters requests run or wait with now, and the slots' counters."""
        if self.lora is None:
            return LoRAInfo()
        running: set[str] = set()
        waiting: set[str] = set()
        for request in self.scheduler.requests.values():
            if request.lora_name is not None:
                is_waiting = request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
                (waiting if is_waiting else running).add(request.lora_name)
        stats = self.lora.stats
        return LoRAInfo(
            running_adapters=tuple(sorted(running)),
            waiting_adapters=tuple(sorted(waiting)),
            resident_adapters=tuple(self.lora.resident()),
            max_loras=self.lora.max_loras,
            num_slot_loads=stats.num_slot_loads,
            num_slot_evictions=stats.num_slot_evictions,
        )

    # ---- the prefix cache's index (what a pod publishes) -----------------------------------

    def take_kv_events(self) -> list[KVCacheEvent]:
        """What the pool and the offload tiers stored and removed since the last call."""
        events = self.kv_manager.take_events()
        if self.offloader is not None:
            events += self.offloader.take_events()
        return events

    def cached_block_hashes(self) -> dict[Tier, list[BlockHash]]:
        """Every hash each tier holds now (for an index rebuilt from scratch)."""
        hashes = {Tier.DEVICE: self.kv_manager.cached_block_hashes()}
        if self.offloader is not None:
            hashes.update(self.offloader.cached_block_hashes())
        return hashes

    # ---- the step ---------------------------------------------------------------------------

    def take_exported_pages(self, request_id: str) -> torch.Tensor | None:
        """The packed prompt pages of a request added with `export_kv_from_block`, once its
        first token was sampled (None before, or if already taken). Any thread."""
        return self.kv_exporter.take(request_id)

    def step(self) -> list[StreamDelta]:
        """One step; with async_scheduling, the next step's launch and the last one's output
        (shared/overlap.py)."""
        if self.overlap is not None:
            return self.overlap.step()
        return self.step_in_order()

    def step_in_order(self) -> list[StreamDelta]:
        """Schedule, run, read the tokens, update: the host waits for the device."""
        sched = self.scheduler.schedule()
        deltas = self.close_dropped_requests()
        if sched.is_empty:
            return deltas
        if self.speculator is not None:
            sched = sched.with_drafts(self.speculator.propose(sched))
        num_threads = self._choose_threads(sched)
        start_time = time.monotonic()
        model_out = self._execute(sched, self.grammars.start_step(sched))
        step = StepResult(sched, model_out, start_time, time.monotonic())
        if self.thread_tuner is not None:
            self.thread_tuner.observe(step, num_threads)
        return deltas + self.finish_step(step, lambda: self.scheduler.update(sched, model_out))

    def finish_step(
        self, step: StepResult, update: Callable[[], list[RequestUpdate]]
    ) -> list[StreamDelta]:
        """The observers see the step, then `update` applies its tokens to the requests (so a
        request that finishes in it still holds its blocks while they look), then the
        output processor streams them and stop strings end requests."""
        for observer in self.step_observers:
            observer.observe(step)
        updates = update()
        processed = self.output_processor.process(updates)
        stopped = self.scheduler.finish_requests(
            processed.stopped_request_ids, RequestStatus.FINISHED_STOPPED
        )
        finished_ids = [u.request.request_id for u in updates if u.finished]
        self.runner.release(finished_ids + [request.request_id for request in stopped])
        return processed.deltas

    def _choose_threads(self, sched: SchedulerOutput) -> int:
        if self.thread_tuner is not None:
            self._num_threads = self.thread_tuner.choose(sched)
        # torch's count is the process's, not this engine's: another engine in the process (a
        # benchmark's, a user's second LLM) may have set its own since this engine's last step.
        # Comparing with a cached count instead once left a 1024-token prefill on the one thread
        # another engine's tuner had last chosen (1.5-2x its time).
        if torch.get_num_threads() != self._num_threads:
            torch.set_num_threads(self._num_threads)
        return self._num_threads

    def _execute(self, sched: SchedulerOutput, masks: StepMasks) -> ModelOutput:
        """The forward pass (while `masks` are computed), and the verification of any drafts
        in it."""
        model_out = self.runner.execute(sched, masks)
        if self.speculator is not None:
            model_out = self.speculator.verify(sched, model_out, masks)
        masks.wait()  # the mask thread reads the requests that the update is about to change
        return model_out

    def close_dropped_requests(self) -> list[StreamDelta]:
        """Requests the scheduler ended on its own (context outgrew the whole cache)."""
        dropped = self.scheduler.take_dropped()
        self.runner.release([request.request_id for request in dropped])
        deltas = [self.output_processor.abort(request) for request in dropped]
        return [delta for delta in deltas if delta is not None]

    def close(self) -> None:
        """Stops the offload tiers' threads (the disk tier's queued writes land first) and the
        other ranks of a parallel engine, if any (also done at exit). Idempotent."""
        if self.offloader is not None:
            if self.offloader.disk is not None:
                self.offloader.disk.flush()
            self.offloader.close()
        if self.parallel is not None:
            self.parallel.close()

    def stats(self) -> EngineStats:
        prefix = self.kv_manager.prefix_cache_stats
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            num_kv_blocks_total=self.kv_manager.num_blocks,
            num_kv_blocks_free=self.kv_manager.num_free_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queried_tokens=prefix.num_queried_tokens,
            prefix_cache_hit_tokens=prefix.num_hit_tokens,
            kv_tiers=tier_stats(self.kv_manager, self.offloader, self.kv_spec.bytes_per_block),
            moe_expert_tokens=expert_token_counts(self._moe_blocks),
            num_waiting_for_admission=self.scheduler.num_waiting_for_admission,
            num_waiting_prompt_tokens=self.scheduler.num_waiting_prompt_tokens,
            **self._spec_stats(),
        )

    def _spec_stats(self) -> dict[str, int]:
        if self.speculation is None:
            return {}
        spec = self.speculation.stats
        return {
            "num_spec_proposed_tokens": spec.num_proposed_tokens,
            "num_spec_accepted_tokens": spec.num_accepted_tokens,
            "num_spec_verify_steps": spec.num_verify_steps,
        }

