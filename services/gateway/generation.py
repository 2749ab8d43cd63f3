"""One client request in flight: its sequences' decode calls, merged into one stream
(`Generation`). `core.py` makes the calls; this module follows them.

A sequence whose decode pod cannot be reached (UNAVAILABLE: connection refused or reset, the pod
gone or draining) before that pod streamed anything for it is routed again without that pod and
resent, with the same request id and seed, at most MAX_DECODE_RETRIES times. A pod that
refused the sequence before streaming anything (RESOURCE_EXHAUSTED: it is overloaded,
services/decode/overload.py) is left out the same way, but it does not cool down: it answers,
and takes other work as soon as it has room; with no other pod left the client gets the
refusal (HTTP 429). A pod a broken stream migrated to that refuses it is passed over the same
way, the migration going on to the next pod. A stream that
breaks after output migrates instead (services/gateway/migration.py): the sequence goes to
another pod with the tokens the client already has, and continues after them. Every pod a
sequence left cools down in the pool, whether a move follows or not (the last one's too).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import grpc

from splitserve.common.grpc_server import StatusError
from splitserve.common.tracing import grpc_metadata
from splitserve.gateway.metrics import GatewayMetrics
from splitserve.gateway.migration import MigrationPolicy, PodDown, Stalled, broken_cause
from splitserve.gateway.outputs import CollectedSequence, SequenceChunk, Usage
from splitserve.gateway.routing.pods import Pod
from splitserve.gateway.routing.router import PickedPods
from splitserve.gateway.routing.scoring import RoutingDecision
from splitserve.gateway.server_timing import current_clock
from splitserve.v1 import generate_pb2, worker_pb2

logger = logging.getLogger(__name__)

# Resends of one sequence to other decode pods after its pod was unreachable or refused it (3
# calls at most): enough to step over a pod or two that went away before the gateway's view
# caught up, or that are full.
MAX_DECODE_RETRIES = 2


class PodError(StatusError):
    """A decode pod failed the request (not the client's fault)."""


class PodRefused(PodError):
    """Every decode pod tried refused the sequence as overloaded (RESOURCE_EXHAUSTED): the
    client should come back shortly (HTTP 429 with Retry-After, gRPC a retry-after trailer)."""

    RETRY_AFTER_S = 1  # a pod's queue moves in steps of milliseconds: soon is soon enough

    @property
    def retry_after(self) -> dict[str, str]:
        return {"Retry-After": str(self.RETRY_AFTER_S)}

    @property
    def trailers(self) -> tuple[tuple[str, str], ...]:
        return (("retry-after", str(self.RETRY_AFTER_S)),)


@dataclass
class SequenceCall:
    """One sequence's decode call, and where it has been: what a resend or a migration needs."""

    index: int
    prompt_index: int
    request: worker_pb2.DecodeRequest
    pod: Pod  # the decode pod
    decision: RoutingDecision  # which pods and why (for logs, spans and metrics)
    # Admission control sent it ahead of other tenants' work (a tenant under its fair share);
    # then its prompt counts in the favoured backlog of its pods (and of this prefill pod).
    favoured: bool = False
    prefill_pod: Pod | None = None
    call: grpc.aio.UnaryStreamCall | None = None
    task: asyncio.Task | None = None
    finished: bool = False
    client_region: str = ""  # for routing a retry as the first call was routed
    cache_salt: str | None = None  # likewise: the tenant's salt is in its cached blocks' hashes
    # A response of this sequence was queued for the client: from then on it is never resent
    # as it was, only migrated with the tokens below.
    has_output: bool = False
    delivered_token_ids: list[int] = field(default_factory=list)  # queued for the client
    last_token_at: float | None = None  # time.monotonic() of its pod's latest tokens
    saw_finish: bool = False  # the pod streamed the sequence's last response
    num_retries: int = 0
    num_migrations: int = 0
    broke_at: float | None = None  # time.monotonic() of the break a migration is mending
    # Decode pods that were unreachable or refused it: a resend goes elsewhere.
    failed_addresses: set[str] = field(default_factory=set)
    # Prefill pods named in those failed attempts: one may still hold the sequence under its
    # request id (until it sees the dead decode pod's connection go) and refuse the resend's
    # remote prefill as a duplicate, so a retry prefers another (services/prefill/core.py).
    earlier_prefill_addresses: set[str] = field(default_factory=set)


_END = object()  # a child's stream ended


def _prefilling_pods(child: SequenceCall) -> tuple[Pod, ...]:
    """Where a call's prompt waits to be computed: its decode pod, and the prefill pod it names
    (a migrated one names none: its new decode pod re-prefills). Counted on both: the decode
    pod may compute it itself instead (conditional disaggregation), and a prefill pod's own
    stats lag its backlog by a poll and by the step it is in (a second or two per step on a
    2-core EPYC, where a fresh 1P+1D stack's TTFT predictions missed 2-4x under a burst)."""
    if child.prefill_pod is None or child.prefill_pod is child.pod:
        return (child.pod,)
    return (child.pod, child.prefill_pod)


def _count_awaiting(pods: tuple[Pod, ...], favoured: bool, num_tokens: int) -> None:
    """Adds `num_tokens` (negative: takes them back) to the prompt tokens awaiting a first
    response on `pods`, and for a favoured call to their favoured part."""
    for pod in pods:
        pod.awaiting_prompt_tokens += num_tokens
        if favoured:
            pod.awaiting_favoured_prompt_tokens += num_tokens


# Routes a sequence again after its decode pod was unreachable (None: no other pod is left).
Reroute = Callable[[SequenceCall], Awaitable[PickedPods | None]]
# Takes a decode pod a call could not reach out of routing for a while, for every request.
MarkUnreachable = Callable[[Pod], None]


class Generation:
    """One client request in flight: its sequences' decode calls, merged into one stream.

    `async for chunk in generation` yields chunks as they arrive (sequences interleaved);
    `usage` is complete once the iteration ends. Raises ValueError (the pod rejected the
    input) or PodError. `cancel()` is synchronous, so it works from inside a task that is
    being cancelled (a client that went away); it cancels every call, and so every pod aborts
    its sequence and frees its blocks, and it stops a retry that is still choosing its pod.
    `reroute` (None: no retries) picks another pod for a sequence whose pod was unreachable;
    `mark_unreachable` (None: nobody to tell) takes such a pod out of routing for a while.
    """

    def __init__(
        self,
        children: list[SequenceCall],
        num_prompt_tokens: int,
        metrics: GatewayMetrics,
        reroute: Reroute | None = None,
        mark_unreachable: MarkUnreachable | None = None,
        migration: MigrationPolicy | None = None,
    ):
        self.usage = Usage(prompt_tokens=num_prompt_tokens)
        # Without a reroute there is nowhere to move a sequence to.
        self._migration = migration or MigrationPolicy(max_migrations=0)
        self.num_choices = len(children)
        self._children = children
        self._metrics = metrics
        self._reroute = reroute
        self._mark_unreachable = mark_unreachable
        self._queue: asyncio.Queue = asyncio.Queue()
        self._num_open = len(children)
        self._start_time = time.monotonic()
        self._first_token_time: float | None = None
        # prompt index -> (cached tokens, by tier)
        self._cached_tokens: dict[int, tuple[int, dict[str, int]]] = {}
        # Called once when the generation ends, however it ends (its last chunk read, an
        # error, cancel()): admission control (services/gateway/admission/) frees its place.
        self.on_end: Callable[[Generation], None] | None = None
        self.on_first_token: Callable[[float], None] | None = None  # given the TTFT in s
        # A check the first output waits for (the tenant's limits, auth/gate.py): it raises
        # in that output's place, and the pods' calls are cancelled.
        self._before_first_output: Callable[[], Awaitable[None]] | None = None
        self._end_time: float | None = None
        # The request's clock (server_timing.py; None outside an HTTP request): the pods' time
        # runs from the first call sent (`_stream`) to their outputs.
        self._clock = current_clock()
        for child in children:
            child.task = asyncio.create_task(self._pump(child), name=child.request.request_id)

    @property
    def decisions(self) -> list[RoutingDecision]:
        """Each sequence's routing decision, in choice order (for metrics and spans)."""
        return [child.decision for child in self._children]

    @property
    def is_done(self) -> bool:
        """Every sequence has finished."""
        return self._num_open == 0

    def __aiter__(self) -> Generation:
        return self

    def wait_before_first_output(self, check: Callable[[], Awaitable[None]]) -> None:
        """Nothing comes out of this generation before `check()` returned; what it raises,
        the reader gets instead (the sequences cancelled)."""
        self._before_first_output = check

    async def __anext__(self) -> SequenceChunk:
        if self._before_first_output is not None:
            check, self._before_first_output = self._before_first_output, None
            try:
                await check()
            except BaseException:
                self.cancel()
                raise
        while self._num_open:
            child, item = await self._queue.get()
            if isinstance(item, Exception):
                self.cancel()
                raise _translate(item, child)
            if item is _END:
                if not child.finished:
                    self.cancel()
                    raise PodError(
                        grpc.StatusCode.UNAVAILABLE,
                        f"decode pod {child.pod.address} ended the stream early",
                    )
                continue
            return self._chunk(child, item)
        self._end()
        raise StopAsyncIteration

    def cancel(self) -> None:
        for child in self._children:
            if child.call is not None:
                child.call.cancel()
            if child.task is not None:
                child.task.cancel()
        self._end()

    def _end(self) -> None:
        if self._end_time is not None:
            return
        self._end_time = time.monotonic()
        if self.on_end is not None:
            self.on_end(self)

    @property
    def ttft_s(self) -> float | None:
        """Seconds from the start to the first token read (None: none was)."""
        if self._first_token_time is None:
            return None
        return self._first_token_time - self._start_time

    @property
    def tpot_s(self) -> float | None:
        """Once ended: seconds per output token after the first, over the sequences (None
        with fewer than two tokens per sequence, or before the end)."""
        first, end = self._first_token_time, self._end_time
        num_gaps = self.usage.completion_tokens / max(self.num_choices, 1) - 1
        if first is None or end is None or num_gaps < 1:
            return None
        return (end - first) / num_gaps

    async def _pump(self, child: SequenceCall) -> None:
        """Streams one sequence into the queue: resent to another pod while its pod is
        unreachable before any output, migrated when its stream breaks after output; ends by
        queueing _END or the error it failed with. A bug in here fails the request instead of
        leaving its reader waiting for ever."""
        try:
            await self._follow(child)
        except Exception as error:
            logger.exception("%s: the sequence's stream failed", child.request.request_id)
            self._queue.put_nowait((child, error))

    async def _follow(self, child: SequenceCall) -> None:
        outcome = await self._stream(child)
        while True:
            if _is_refusal(outcome):
                if not await self._go_past_refusal(child, outcome):
                    break
            elif _is_unreachable_before_output(child, outcome):
                self._leave_out(child)
                if not (self._can_retry(child) and await self._move_elsewhere(child, outcome)):
                    break
            else:
                cause = broken_cause(outcome, child.saw_finish) if child.has_output else None
                if cause is None:
                    break
                self._leave_out(child)
                if not await self._migrate(child, cause):
                    break
            outcome = await self._stream(child)
        if isinstance(outcome, Stalled):
            outcome = PodError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"decode pod {child.pod.address} sent nothing for "
                f"{self._migration.stall_timeout_s:g} s",
            )
        elif isinstance(outcome, PodDown):
            outcome = PodError(
                grpc.StatusCode.UNAVAILABLE,
                f"decode pod {child.pod.address} stopped answering and no other pod is left",
            )
        self._queue.put_nowait((child, outcome))

    async def _stream(self, child: SequenceCall) -> object:
        """One decode call on `child.pod`, its responses queued as they come; returns _END
        once the stream ended, Stalled when it went silent after output, or the exception the
        call failed with."""
        if self._clock is not None:  # the wait for this task's first turn was the gateway's
            self._clock.note_pods_called()
        # The trace context is the one current when the Generation was made (the request's).
        call = child.call = child.pod.decode_stub.Decode(child.request, metadata=grpc_metadata())
        loop = asyncio.get_running_loop()
        stall_timeout = self._migration.stall_timeout_s
        pod_went_down = []

        def break_off() -> None:  # the pod stopped answering its stats polls (routing/pods.py)
            pod_went_down.append(True)
            call.cancel()

        pod = child.pod
        pod.call_breakers.add(break_off)
        # Its prompt is prefill work ahead of others on its pods until its first response
        # (admission control's predictions, services/gateway/admission/predict.py).
        awaiting = 0 if child.has_output else len(child.request.prompt_token_ids)
        # Taken back from the same pods, whatever a migration names later.
        awaiting_on, favoured = _prefilling_pods(child), child.favoured
        _count_awaiting(awaiting_on, favoured, awaiting)
        try:
            # One deadline for the whole call, pushed back by every response once output began:
            # cheaper per token than a timeout around each read.
            async with asyncio.timeout(None) as deadline:
                async for response in child.call:
                    if awaiting:
                        _count_awaiting(awaiting_on, favoured, -awaiting)
                        awaiting = 0
                    self._take(child, response)
                    deadline.reschedule(loop.time() + stall_timeout)
        except TimeoutError:
            child.call.cancel()
            return Stalled()
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise  # this Generation was cancelled: nobody reads the queue any more
            if pod_went_down:
                return PodDown()
            # The call was cut from outside (its channel closed): the reader must hear of it,
            # or it waits for chunks that never come. Ends like a stream that stopped early.
            return _END
        except Exception as error:  # handed to the reader, which raises it
            return error
        finally:
            pod.call_breakers.discard(break_off)
            _count_awaiting(awaiting_on, favoured, -awaiting)
            if self._clock is not None:  # a refusal, an error or a stall: the pods' time too
                self._clock.note_heard(time.monotonic())
        return _END

    def _take(self, child: SequenceCall, response: worker_pb2.DecodeResponse) -> None:
        if child.broke_at is not None:
            self._metrics.migration_latency.observe(time.monotonic() - child.broke_at)
            child.broke_at = None
        child.has_output = True
        child.delivered_token_ids.extend(response.token_ids)
        if response.token_ids:  # the gap since its previous tokens, for admission control
            now = time.monotonic()
            # The gap after the first token counts too (on a disaggregated stack it spans the
            # pages' hand-over): a request's TPOT, as clients measure it, includes it.
            if child.last_token_at is not None:
                child.pod.token_gaps.add(now - child.last_token_at, len(response.token_ids))
            child.last_token_at = now
        if response.finish_reason:
            child.saw_finish = True
        # Only the first output: the last heard is the call's end (`_stream`), so nothing more
        # is done per token.
        if self._clock is not None and self._clock.first_output is None:
            self._clock.note_output(time.monotonic())
        self._queue.put_nowait((child, response))

    async def _go_past_refusal(self, child: SequenceCall, refusal: object) -> bool:
        """Points `child` at another pod after its pod refused it as overloaded (which it does
        only before streaming anything): resent as it was, or, if an earlier pod streamed part
        of it, migrated on with those tokens. The refusing pod is left out for this sequence
        but does not cool down: it answered. False when no pod is left or the limits say no."""
        child.failed_addresses.add(child.pod.address)
        if child.has_output:
            moved = await self._migrate(child, "refused")
        else:
            moved = self._can_retry(child) and await self._move_elsewhere(child, refusal)
        self._metrics.pod_refusals.labels("rerouted" if moved else "returned").inc()
        return moved

    async def _migrate(self, child: SequenceCall, cause: str) -> bool:
        """Points `child` at another pod with the tokens delivered so far; False when the
        policy's limits say no or no pod is left."""
        request_id, failed = child.request.request_id, child.pod.address
        num_tokens = len(child.delivered_token_ids)
        policy = self._migration
        if (
            self._reroute is None
            or child.num_migrations >= policy.max_migrations
            or num_tokens > policy.max_replay_tokens
        ):
            logger.warning("%s: stream from %s broke (%s); not migrated", request_id, failed, cause)
            return False
        child.broke_at = time.monotonic()
        picked = await self._reroute(child)
        if picked is None:
            logger.warning(
                "%s: stream from %s broke (%s); no other decode pod", request_id, failed, cause
            )
            return False
        child.num_migrations += 1
        child.pod, child.decision = picked.decode, picked.decision
        child.last_token_at = None  # the new pod's first gap is the move, not its pace
        child.request.prefill_address = ""  # the new pod re-prefills prompt + tokens itself
        child.prefill_pod = None
        del child.request.resumed_output_token_ids[:]
        child.request.resumed_output_token_ids.extend(child.delivered_token_ids)
        self._metrics.migrations.labels(cause).inc()
        logger.warning(
            "%s: stream from %s broke (%s) after %d tokens; migrated to %s (%d of %d)",
            request_id,
            failed,
            cause,
            num_tokens,
            picked.decode.address,
            child.num_migrations,
            policy.max_migrations,
        )
        return True

    def _leave_out(self, child: SequenceCall) -> None:
        """The one place an unreachable decode pod is noted, whether a retry follows or not:
        it cools down for every request, and this sequence never goes back to it."""
        if self._mark_unreachable is not None:
            self._mark_unreachable(child.pod)
        child.failed_addresses.add(child.pod.address)
        if child.request.prefill_address:
            child.earlier_prefill_addresses.add(child.request.prefill_address)

    def _can_retry(self, child: SequenceCall) -> bool:
        return self._reroute is not None and child.num_retries < MAX_DECODE_RETRIES

    async def _move_elsewhere(self, child: SequenceCall, error: object) -> bool:
        """Points `child` at another pod (same request id and seed); False if none is left."""
        assert self._reroute is not None, "only called when retries are on"
        request_id, failed = child.request.request_id, child.pod.address
        why = "refused it" if _is_refusal(error) else "is unreachable"
        picked = await self._reroute(child)
        if picked is None:
            logger.warning(
                "%s: decode pod %s %s (%s) and no other decode pod is left",
                request_id,
                failed,
                why,
                _details(error),
            )
            return False
        child.num_retries += 1
        child.pod, child.decision = picked.decode, picked.decision
        child.request.prefill_address = picked.prefill.address if picked.prefill else ""
        child.prefill_pod = picked.prefill
        if not _is_refusal(error):  # refusals have their own series (pod_refusals)
            self._metrics.routing_retries.inc()
        logger.warning(
            "%s: decode pod %s %s (%s); retry %d of %d on %s",
            request_id,
            failed,
            why,
            _details(error),
            child.num_retries,
            MAX_DECODE_RETRIES,
            picked.decode.address,
        )
        return True

    def _chunk(self, child: SequenceCall, response: worker_pb2.DecodeResponse) -> SequenceChunk:
        if self._first_token_time is None and response.token_ids:
            self._first_token_time = time.monotonic()
            ttft_s = self._first_token_time - self._start_time
            self._metrics.time_to_first_token.observe(ttft_s)
            if self.on_first_token is not None:
                self.on_first_token(ttft_s)
        chunk = SequenceChunk(
            child.index, response.text, list(response.token_ids), list(response.logprobs)
        )
        if response.finish_reason:
            child.finished = True
            self._num_open -= 1
            chunk.finish_reason = response.finish_reason
            chunk.stop_reason = response.stop_reason or None
            self._count_usage(child, response.usage)
        return chunk

    def _count_usage(self, child: SequenceCall, usage: generate_pb2.Usage) -> None:
        self.usage.completion_tokens += usage.completion_tokens
        # A prompt is counted once, whatever its n; its sequences may find different amounts
        # cached (a later one reuses an earlier one's blocks), so report the most.
        previous, _ = self._cached_tokens.get(child.prompt_index, (0, {}))
        if usage.cached_tokens > previous:
            tiers = {tier: n for tier, n in usage.cached_tokens_by_tier.items() if n}
            self._cached_tokens[child.prompt_index] = (usage.cached_tokens, tiers)
        self.usage.cached_tokens = sum(n for n, _ in self._cached_tokens.values())
        by_tier: Counter[str] = Counter()
        for _, counts in self._cached_tokens.values():
            by_tier.update(counts)
        self.usage.cached_tokens_by_tier = dict(by_tier)
        if self._num_open == 0:
            self._metrics.observe_finished(time.monotonic() - self._start_time, self.usage)


def _is_unreachable_before_output(child: SequenceCall, outcome: object) -> bool:
    """The call could not reach the pod (or the pod stopped answering) and nothing of the
    sequence was streamed: safe to resend (a pod that comes back frees the cancelled call)."""
    unreachable = isinstance(outcome, PodDown) or (
        isinstance(outcome, grpc.aio.AioRpcError) and outcome.code() == grpc.StatusCode.UNAVAILABLE
    )
    return unreachable and not child.has_output


def _is_refusal(outcome: object) -> bool:
    """The pod refused the sequence for want of room (before streaming any of it, having
    reserved nothing for it): another pod may take it."""
    return (
        isinstance(outcome, grpc.aio.AioRpcError)
        and outcome.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    )


def _details(error: object) -> str:
    if isinstance(error, grpc.aio.AioRpcError):
        return error.details() or error.code().name
    return str(error) or type(error).__name__


def _translate(error: Exception, child: SequenceCall) -> Exception:
    if not isinstance(error, grpc.aio.AioRpcError):
        return error
    if error.code() == grpc.StatusCode.INVALID_ARGUMENT:
        return ValueError(error.details())
    error_class = PodRefused if _is_refusal(error) else PodError
    return error_class(
        error.code(), f"decode pod {child.pod.address}: {error.code().name}: {error.details()}"
    )


async def collect(generation: Generation) -> list[CollectedSequence]:
    """Every sequence of a generation, in choice order."""
    sequences = [CollectedSequence(index) for index in range(generation.num_choices)]
    try:
        async for chunk in generation:
            sequences[chunk.index].add(chunk)
    finally:
        generation.cancel()  # a no-op once every call has ended
    return sequences
