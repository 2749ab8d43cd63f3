"""The gateway's request path, shared by the HTTP and gRPC front ends: validate, pick pods, fan
n > 1 (and several prompts) out into one DecodeRequest per sequence, merge the streams back.

The child ids and seeds come from `splitserve.engine.prompts.child_sequences`, the very function
the engine
uses in-process, so a request served through the gateway samples what `LLM.generate` would.

A sequence whose decode pod cannot be reached (UNAVAILABLE: connection refused or reset, the pod
gone or draining) before that pod streamed anything for it is routed again without that pod and
resent, with the same request id and seed, at most MAX_DECODE_RETRIES times. A stream that
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

from splitserve.common.convert import options_from_params
from splitserve.common.grpc_server import StatusError
from splitserve.common.tracing import grpc_metadata
from splitserve.engine.prompts import check_prompt, child_sequences
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.tokenizer import Tokenizer
from splitserve.gateway.constraints import check_params
from splitserve.gateway.metrics import GatewayMetrics
from splitserve.gateway.migration import MigrationPolicy, PodDown, Stalled, broken_cause
from splitserve.gateway.routing.pods import Pod, PodPool
from splitserve.gateway.routing.router import PickedPods, Router
from splitserve.gateway.routing.scoring import RoutingDecision
from splitserve.v1 import generate_pb2, worker_pb2

logger = logging.getLogger(__name__)

# Resends of one sequence to other decode pods after its pod was unreachable (3 calls at most):
# enough to step over a pod or two that went away before the gateway's view caught up.
MAX_DECODE_RETRIES = 2


class NoPodError(StatusError):
    """No decode pod is reachable: HTTP 503 / gRPC UNAVAILABLE."""

    def __init__(self, message: str = "no decode pod is available") -> None:
        super().__init__(grpc.StatusCode.UNAVAILABLE, message)


class PodError(StatusError):
    """A decode pod failed the request (not the client's fault)."""


@dataclass(frozen=True)
class GenerationRequest:
    request_id: str
    prompts: list[list[int]]  # token ids; each prompt gets params.n sequences
    params: SamplingParams
    priority: int = 0
    # OpenAI's prompt_cache_key: requests sharing it are routed to the same decode pod.
    prompt_cache_key: str | None = None


@dataclass
class SequenceChunk:
    """What one decode message added to one output sequence (a choice)."""

    index: int  # choice index: prompt_index * n + sequence index
    text: str
    token_ids: list[int]
    logprobs: list[generate_pb2.TokenLogprob]
    finish_reason: str | None = None  # on the sequence's last chunk only
    stop_reason: str | None = None


@dataclass
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    # cached_tokens by the cache tier that served them (Tier.label -> tokens).
    cached_tokens_by_tier: dict[str, int] = field(default_factory=dict)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


@dataclass
class _Child:
    """One sequence's decode call."""

    index: int
    prompt_index: int
    request: worker_pb2.DecodeRequest
    pod: Pod  # the decode pod
    decision: RoutingDecision  # which pods and why (for logs, spans and metrics)
    call: grpc.aio.UnaryStreamCall | None = None
    task: asyncio.Task | None = None
    finished: bool = False
    client_region: str = ""  # for routing a retry as the first call was routed
    cache_salt: str | None = None  # likewise: the tenant's salt is in its cached blocks' hashes
    # A response of this sequence was queued for the client: from then on it is never resent
    # as it was, only migrated with the tokens below.
    has_output: bool = False
    delivered_token_ids: list[int] = field(default_factory=list)  # queued for the client
    saw_finish: bool = False  # the pod streamed the sequence's last response
    num_retries: int = 0
    num_migrations: int = 0
    broke_at: float | None = None  # time.monotonic() of the break a migration is mending
    failed_addresses: set[str] = field(default_factory=set)  # decode pods that were unreachable
    # Prefill pods named in those failed attempts: one may still hold the sequence under its
    # request id (until it sees the dead decode pod's connection go) and refuse the resend's
    # remote prefill as a duplicate, so a retry prefers another (services/prefill/core.py).
    earlier_prefill_addresses: set[str] = field(default_factory=set)


_END = object()  # a child's stream ended

# Routes a sequence again after its decode pod was unreachable (None: no other pod is left).
Reroute = Callable[[_Child], Awaitable[PickedPods | None]]
# Takes a decode pod a call could not reach out of routing for a while, for every request.
MarkUnreachable = Callable[[Pod], None]


class GatewayCore:
    def __init__(
        self,
        tokenizer: Tokenizer,
        model_name: str,
        decode_pool: PodPool,
        prefill_pool: PodPool | None = None,
        metrics: GatewayMetrics | None = None,
        router: Router | None = None,
        migration: MigrationPolicy | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.migration = migration or MigrationPolicy()
        self.model_name = model_name
        self.decode_pool = decode_pool
        self.prefill_pool = prefill_pool
        self.metrics = metrics or GatewayMetrics()
        # Picks the pods of every sequence (services/gateway/routing/router.py); without one given,
        # static pods by load and proximity.
        self.router = router or Router(decode_pool, prefill_pool)

    # ---- prompts ----------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """As `LLM.generate` tokenizes a text prompt (with the model's BOS/EOS rules)."""
        return self.tokenizer.encode(text, add_special_tokens=add_special_tokens)

    def encode_chat(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> list[int]:
        """As `LLM.chat` does: the chat template, then tokens without extra specials."""
        text = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt
        )
        return self.tokenizer.encode(text, add_special_tokens=False)

    @property
    def max_model_len(self) -> int:
        max_model_len = self.decode_pool.max_model_len
        if max_model_len is None:
            raise NoPodError()
        return max_model_len

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raises PromptError / ValueError (naming the parameter) for a request no pod can
        serve, NoPodError when there is no pod to ask."""
        max_model_len = self.max_model_len
        # The engine's own check, less the KV cache's size, which only the pod knows.
        check_prompt(prompt_token_ids, self.tokenizer.vocab_size, max_model_len)
        num_tokens = len(prompt_token_ids)
        if num_tokens + params.max_tokens > max_model_len:
            raise ValueError(
                f"max_tokens is too large: {num_tokens} prompt tokens + {params.max_tokens} "
                f"max_tokens exceed this model's context length of {max_model_len}"
            )

    # ---- requests ---------------------------------------------------------------------------

    async def start(self, request: GenerationRequest, client_region: str = "") -> Generation:
        """Validates every prompt, then sends every sequence to the pods the router picks
        (`client_region`: the client's region, from `x-splitserve-region`, "" if unknown)."""
        # Before anything is scheduled: a grammar that cannot compile, a bias for no token.
        check_params(request.params, self.tokenizer.vocab_size)
        for prompt in request.prompts:
            self.validate(prompt, request.params)
        children = [
            await self._child(
                request, prompt_index, sequence_index, child_id, child_params, client_region
            )
            for prompt_index, prompt_id in enumerate(_prompt_ids(request))
            for sequence_index, (child_id, child_params) in enumerate(
                child_sequences(prompt_id, request.params)
            )
        ]
        num_prompt_tokens = sum(len(prompt) for prompt in request.prompts)
        return Generation(
            children,
            num_prompt_tokens,
            self.metrics,
            self._reroute,
            self.decode_pool.mark_unreachable,
            self.migration,
        )

    async def _child(
        self,
        request: GenerationRequest,
        prompt_index: int,
        sequence_index: int,
        child_id: str,
        child_params: SamplingParams,
        client_region: str,
    ) -> _Child:
        picked = await self.router.pick(
            request.prompts[prompt_index],
            client_region,
            cache_salt=child_params.cache_salt,
            cache_key=request.prompt_cache_key,
        )
        if picked is None:
            raise NoPodError()
        decode_request = worker_pb2.DecodeRequest(
            request_id=child_id,
            prompt_token_ids=request.prompts[prompt_index],
            sampling=options_from_params(child_params),
            priority=request.priority,
            prefill_address=picked.prefill.address if picked.prefill is not None else "",
        )
        index = prompt_index * request.params.n + sequence_index
        return _Child(
            index,
            prompt_index,
            decode_request,
            picked.decode,
            picked.decision,
            client_region=client_region,
            cache_salt=child_params.cache_salt,
        )

    async def _reroute(self, child: _Child) -> PickedPods | None:
        """The pods for a sequence whose decode pod was unreachable: the decode pods it failed
        on are left out, and so are its failed attempts' prefill pods while others remain."""
        prompt = list(child.request.prompt_token_ids)
        return await self.router.pick(
            prompt,
            child.client_region,
            exclude=child.failed_addresses,
            avoid_prefill=child.earlier_prefill_addresses,
            cache_salt=child.cache_salt,
        )


def _prompt_ids(request: GenerationRequest) -> list[str]:
    if len(request.prompts) == 1:
        return [request.request_id]
    return [f"{request.request_id}-{i}" for i in range(len(request.prompts))]


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
        children: list[_Child],
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

    async def __anext__(self) -> SequenceChunk:
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
        raise StopAsyncIteration

    def cancel(self) -> None:
        for child in self._children:
            if child.call is not None:
                child.call.cancel()
            if child.task is not None:
                child.task.cancel()

    async def _pump(self, child: _Child) -> None:
        """Streams one sequence into the queue: resent to another pod while its pod is
        unreachable before any output, migrated when its stream breaks after output; ends by
        queueing _END or the error it failed with."""
        outcome = await self._stream(child)
        while True:
            if _is_unreachable_before_output(child, outcome):
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

    async def _stream(self, child: _Child) -> object:
        """One decode call on `child.pod`, its responses queued as they come; returns _END
        once the stream ended, Stalled when it went silent after output, or the exception the
        call failed with."""
        # The trace context is the one current when the Generation was made (the request's).
        call = child.call = child.pod.stub.Decode(child.request, metadata=grpc_metadata())
        loop = asyncio.get_running_loop()
        stall_timeout = self._migration.stall_timeout_s
        pod_went_down = []

        def break_off() -> None:  # the pod stopped answering its stats polls (routing/pods.py)
            pod_went_down.append(True)
            call.cancel()

        pod = child.pod
        pod.call_breakers.add(break_off)
        try:
            # One deadline for the whole call, pushed back by every response once output began:
            # cheaper per token than a timeout around each read.
            async with asyncio.timeout(None) as deadline:
                async for response in child.call:
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
        return _END

    def _take(self, child: _Child, response: worker_pb2.DecodeResponse) -> None:
        if child.broke_at is not None:
            self._metrics.migration_latency.observe(time.monotonic() - child.broke_at)
            child.broke_at = None
        child.has_output = True
        child.delivered_token_ids.extend(response.token_ids)
        if response.finish_reason:
            child.saw_finish = True
        self._queue.put_nowait((child, response))

    async def _migrate(self, child: _Child, cause: str) -> bool:
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
        child.request.prefill_address = ""  # the new pod re-prefills prompt + tokens itself
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

    def _leave_out(self, child: _Child) -> None:
        """The one place an unreachable decode pod is noted, whether a retry follows or not:
        it cools down for every request, and this sequence never goes back to it."""
        if self._mark_unreachable is not None:
            self._mark_unreachable(child.pod)
        child.failed_addresses.add(child.pod.address)
        if child.request.prefill_address:
            child.earlier_prefill_addresses.add(child.request.prefill_address)

    def _can_retry(self, child: _Child) -> bool:
        return self._reroute is not None and child.num_retries < MAX_DECODE_RETRIES

    async def _move_elsewhere(self, child: _Child, error: Exception) -> bool:
        """Points `child` at another pod (same request id and seed); False if none is left."""
        assert self._reroute is not None, "only called when retries are on"
        request_id, failed = child.request.request_id, child.pod.address
        picked = await self._reroute(child)
        if picked is None:
            logger.warning(
                "%s: decode pod %s is unreachable (%s) and no other decode pod is left",
                request_id,
                failed,
                _details(error),
            )
            return False
        child.num_retries += 1
        child.pod, child.decision = picked.decode, picked.decision
        child.request.prefill_address = picked.prefill.address if picked.prefill else ""
        self._metrics.routing_retries.inc()
        logger.warning(
            "%s: decode pod %s is unreachable (%s); retry %d of %d on %s",
            request_id,
            failed,
            _details(error),
            child.num_retries,
            MAX_DECODE_RETRIES,
            picked.decode.address,
        )
        return True

    def _chunk(self, child: _Child, response: worker_pb2.DecodeResponse) -> SequenceChunk:
        if self._first_token_time is None and response.token_ids:
            self._first_token_time = time.monotonic()
            self._metrics.time_to_first_token.observe(self._first_token_time - self._start_time)
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

    def _count_usage(self, child: _Child, usage: generate_pb2.Usage) -> None:
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


def _is_unreachable_before_output(child: _Child, outcome: object) -> bool:
    """The call could not reach the pod (or the pod stopped answering) and nothing of the
    sequence was streamed: safe to resend (a pod that comes back frees the cancelled call)."""
    unreachable = isinstance(outcome, PodDown) or (
        isinstance(outcome, grpc.aio.AioRpcError)
        and outcome.code() == grpc.StatusCode.UNAVAILABLE
    )
    return unreachable and not child.has_output


def _details(error: Exception) -> str:
    if isinstance(error, grpc.aio.AioRpcError):
        return error.details() or error.code().name
    return str(error) or type(error).__name__


def _translate(error: Exception, child: _Child) -> Exception:
    if not isinstance(error, grpc.aio.AioRpcError):
        return error
    if error.code() == grpc.StatusCode.INVALID_ARGUMENT:
        return ValueError(error.details())
    return PodError(
        error.code(), f"decode pod {child.pod.address}: {error.code().name}: {error.details()}"
    )


@dataclass
class CollectedSequence:
    """A whole sequence, gathered from its chunks (for non-streaming responses)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[generate_pb2.TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | None = None

    def add(self, chunk: SequenceChunk) -> None:
        self.text += chunk.text
        self.token_ids.extend(chunk.token_ids)
        self.logprobs.extend(chunk.logprobs)
        if chunk.finish_reason is not None:
            self.finish_reason, self.stop_reason = chunk.finish_reason, chunk.stop_reason


async def collect(generation: Generation) -> list[CollectedSequence]:
    """Every sequence of a generation, in choice order."""
    sequences = [CollectedSequence(index) for index in range(generation.num_choices)]
    try:
        async for chunk in generation:
            sequences[chunk.index].add(chunk)
    finally:
        generation.cancel()  # a no-op once every call has ended
    return sequences
