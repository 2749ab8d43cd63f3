"""The gateway's view of the prefill and decode pods: a `PodPool` per role, a `Pod` each (gRPC
channel, latest stats and load, round trip) and what scoring sees of it (`Pod.view`).

Where each piece comes from, one source each:
- which pods exist: the --decode/--prefill addresses, plus with --redis-url the Redis registry
  (`PodPool.apply_records`), which also gives a pod's node and its prefix index keys;
- load, liveness, served model, context length and round trip: this gateway's own GetStats
  polls (every POLL_INTERVAL_SECONDS), with or without Redis. The registry record carries the
  pod's load too, but only for the autoscaler: polls are needed anyway (static pods, liveness,
  round trips), answer fresher than a heartbeat read through a registry refresh, and keep
  routing by load while Redis is down.
services/gateway/routing/router.py chooses among the available pods.

A pod a call found unreachable (`PodPool.mark_unreachable`) is left out of routing for a
short cooldown: the registry and the stats polls notice a pod that went away only within a
poll, and requests routed to it meanwhile would fail too."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import grpc

from splitserve.common.channels import aio_channel
from splitserve.common.pod_load import PodLoad
from splitserve.common.registry_schema import PodRecord
from splitserve.gateway.admission.feedback import TokenGaps
from splitserve.gateway.routing.load_ranking import RANKED_FIELDS, LoadRanking
from splitserve.gateway.routing.scoring import (
    Location,
    LoRAResidency,
    PodView,
    RoutingWeights,
    load_term,
)
from splitserve.v1 import worker_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)

POLL_INTERVAL_SECONDS = 0.5
# Stats polls one pool sends per second at most: past POLL_INTERVAL_SECONDS x this many pods
# (100), each tick polls the next slice of pods in turn, so a pod's load is as old as
# pods / MAX_POLLS_PER_SECOND seconds and a gateway's polling stays flat with cluster size
# (every poll of 1,000 pods each tick was most of a gateway core: benchmarks/scale). Between
# polls the gateway counts what it dispatched (Pod.num_dispatched).
MAX_POLLS_PER_SECOND = 200
# How long the streams of a pod that left the registry (it is draining) may go on through this
# gateway: longer than any pod's --drain-timeout.
LEAVING_POD_GRACE_SECONDS = 600.0
STATS_TIMEOUT_SECONDS = 2.0
# A pod whose stats polls have failed for this long is down: the calls on it are broken off
# (the gateway resends or migrates them), since a stopped pod's connection can look open for
# ever. Two failed polls at the least, so one slow answer under load is not a death.
POD_DOWN_SECONDS = 5.0
RTT_SMOOTHING = 0.2  # weight of the newest round trip in the moving average
# How long routing skips a pod a call found unreachable, unless a stats poll begun after the
# failure succeeds sooner: longer than a poll interval plus a poll's timeout, by which time a
# pod that is gone has failed its polls (or left the registry) and is unavailable anyway.
UNREACHABLE_COOLDOWN_SECONDS = 5.0


@dataclass
class Pod:
    address: str  # "host:port" of the pod's gRPC server
    stub: worker_pb2_grpc.DecodeWorkerStub | worker_pb2_grpc.PrefillWorkerStub
    # The latest answer to GetStats; None before the first one and after a failed poll.
    stats: worker_pb2.WorkerStats | None = None
    # Requests this gateway sent since `stats` was taken: the stats do not count them yet, and
    # without them every request between two polls would land on the same pod.
    num_dispatched: int = 0
    dispatched_prompt_tokens: int = 0  # their prompts' tokens, for admission's predictions
    is_serving_model: bool = False  # stats name the gateway's model
    # The pod's registry entry; None for a pod given by address (no prefix index for it).
    record: PodRecord | None = None
    rtt_ms: float | None = None  # moving average of GetStats round trips
    # When a call last found the pod unreachable (time.monotonic()), and until when routing
    # skips it for that; set by PodPool.mark_unreachable, cleared by a later good poll.
    unreachable_since: float | None = None
    unreachable_until: float = 0.0
    # Since when its stats polls have failed (None while it answers), and what to call to break
    # off each call in flight on it (registered by services/gateway/generation.py).
    failing_since: float | None = None
    call_breakers: set = field(default_factory=set)
    # Gaps between the tokens its streams delivered here lately (admission control's measure
    # of its time per output token; services/gateway/admission/feedback.py).
    token_gaps: TokenGaps = field(default_factory=TokenGaps)
    # Prompt tokens of this gateway's calls on it that have had no response yet: its prefill
    # backlog as this gateway knows it, fresher than its stats (taken after each engine step).
    awaiting_prompt_tokens: int = 0
    # The part of it from tenants under their fair share (admission control's favoured
    # requests, which the pods prefill first: services/gateway/admission/controller.py), also
    # counted on the prefill pod a call names.
    awaiting_favoured_prompt_tokens: int = 0
    # The latest stats parsed once per poll, not on every look at the pod (the router ranks a
    # thousand pods by load on every pick).
    _parsed_load: _ParsedLoad | None = field(default=None, repr=False, compare=False)
    # The last `load_term` asked: (stats, num_dispatched, weights, term).
    _load_term: tuple[worker_pb2.WorkerStats | None, int, RoutingWeights, float] | None = field(
        default=None, repr=False, compare=False
    )
    # Its pool's ranking, told of every change to what it reads (load_ranking.py).
    _ranking: LoadRanking | None = field(default=None, repr=False, compare=False)

    def __setattr__(self, name: str, value: Any) -> None:
        ranking = self.__dict__.get("_ranking")
        if ranking is not None and name in RANKED_FIELDS:
            ranking.note_change(self, name, value)
        object.__setattr__(self, name, value)

    def break_calls(self) -> None:
        for breaker in list(self.call_breakers):
            breaker()

    @property
    def decode_stub(self) -> worker_pb2_grpc.DecodeWorkerStub:
        """The stub of a decode pod (the decode pool's pods have no other)."""
        stub = self.stub
        assert isinstance(stub, worker_pb2_grpc.DecodeWorkerStub), f"{self.address}: not decode"
        return stub

    @property
    def pod_id(self) -> str:
        if self.record is not None:
            return self.record.pod_id
        return self.stats.worker_id if self.stats is not None else self.address

    @property
    def location(self) -> Location:
        stats, record = self.stats, self.record
        region = (stats.region if stats else "") or (record.region if record else "")
        zone = (stats.zone if stats else "") or (record.zone if record else "")
        node = (record.node if record else "") or self.address.rsplit(":", 1)[0]
        return Location(region, zone, node)

    def view(self, cached_tokens: int = 0, lora_name: str | None = None) -> PodView:
        return PodView(
            self.pod_id,
            self.address,
            self.location,
            self.load,
            self.num_dispatched,
            cached_tokens,
            self.rtt_ms,
            None if lora_name is None else self.lora_residency(lora_name),
        )

    @property
    def lora_adapters(self) -> tuple[str, ...]:
        """The LoRA adapters the pod holds, as its latest stats answered."""
        return tuple(self.stats.lora_adapters) if self.stats is not None else ()

    def lora_residency(self, lora_name: str) -> LoRAResidency:
        """Where `lora_name` stands on this pod: in an active slot, a slot free for it, or
        another adapter to push out first."""
        assert self.stats is not None, "only a pod that answered a poll is scored"
        resident = self.stats.resident_lora_adapters
        if lora_name in resident:
            return LoRAResidency.RESIDENT
        if len(resident) < self.stats.max_loras:
            return LoRAResidency.FREE_SLOT
        return LoRAResidency.MUST_EVICT

    @property
    def is_available(self) -> bool:
        return self.is_available_at(time.monotonic())

    def is_available_at(self, now: float) -> bool:
        """`is_available` at time.monotonic() `now` (a pool's scan reads the clock once)."""
        return self.stats is not None and self.is_serving_model and now >= self.unreachable_until

    @property
    def is_cooling_down(self) -> bool:
        """A call found the pod unreachable a moment ago: do not route to it yet."""
        return time.monotonic() < self.unreachable_until

    @property
    def num_queued(self) -> int:
        """Requests it runs or has queued, with those this gateway sent since its stats."""
        parsed = self._parsed_load
        if parsed is None or parsed.stats is not self.stats:  # inline: read pod by pod
            parsed = self._parsed()
        return parsed.num_queued + self.num_dispatched

    @property
    def kv_usage(self) -> float:
        """The share of its KV blocks in use, as the latest poll answered."""
        parsed = self._parsed_load
        if parsed is None or parsed.stats is not self.stats:
            parsed = self._parsed()
        return parsed.kv_usage

    def load_term(self, weights: RoutingWeights) -> float:
        """`scoring.load_term` of the pod's view, kept until a poll or a dispatch changes it:
        a pick at a thousand pods ranks every one by it, and most did not change since the
        last pick (benchmarks/scale)."""
        kept = self._load_term
        if (
            kept is not None
            and kept[0] is self.stats
            and kept[1] == self.num_dispatched
            and kept[2] is weights
        ):
            return kept[3]
        term = load_term(self.num_queued, self.kv_usage, weights)
        self._load_term = (self.stats, self.num_dispatched, weights, term)
        return term

    @property
    def load(self) -> PodLoad:
        """As the latest poll answered it (`num_dispatched` is what it does not count yet)."""
        return self._parsed().load

    def _parsed(self) -> _ParsedLoad:
        stats = self.stats
        assert stats is not None, "only a pod that answered a poll has a load"
        parsed = self._parsed_load
        if parsed is None or parsed.stats is not stats:
            load = PodLoad.from_proto(stats)
            parsed = self._parsed_load = _ParsedLoad(stats, load, load.num_queued, load.kv_usage)
        return parsed


@dataclass(frozen=True, slots=True)
class _ParsedLoad:
    stats: worker_pb2.WorkerStats  # the answer parsed (a new poll's is another object)
    load: PodLoad
    num_queued: int  # the load's, kept: the router's ranking reads them pod by pod
    kv_usage: float


class PodPool:
    """One role's pods. Owned by one event loop: `start` there; the router reads `available()`."""

    def __init__(
        self,
        role: str,
        addresses: list[str],
        model_name: str,
        poll_interval_s: float = POLL_INTERVAL_SECONDS,
        unreachable_cooldown_s: float = UNREACHABLE_COOLDOWN_SECONDS,
    ) -> None:
        self.role = role
        self.model_name = model_name
        self.addresses = list(addresses)
        self.poll_interval_s = poll_interval_s  # between the background stats polls
        self.unreachable_cooldown_s = unreachable_cooldown_s
        self.pods: list[Pod] = []
        # Which of them are available and how loaded, kept as they change (a pick at a
        # thousand pods would otherwise read every pod).
        self.ranking = LoadRanking()
        self._channels: dict[str, grpc.aio.Channel] = {}  # address -> its channel
        # Channels of pods that left the registry, closing once their calls end.
        self._leaving: dict[asyncio.Task, grpc.aio.Channel] = {}
        self._poller: asyncio.Task | None = None
        # Called (as a task of its own) when a pod answers a poll after none or a failed one:
        # a new pod, or one back from a restart (services/gateway/api/lora_adapters.py gives
        # it the adapters loaded at run time).
        self.on_pod_up: Callable[[Pod], Coroutine[Any, Any, None]] | None = None
        self._pod_up_tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        for address in self.addresses:
            self._add(address)
        await self.poll()
        self._poller = asyncio.create_task(self._poll_forever(), name=f"poll-{self.role}")

    def _add(self, address: str, record: PodRecord | None = None) -> Pod:
        stub_class = (
            worker_pb2_grpc.DecodeWorkerStub
            if self.role == "decode"
            else worker_pb2_grpc.PrefillWorkerStub
        )
        channel = aio_channel(address)
        self._channels[address] = channel
        pod = Pod(address, stub_class(channel), record=record)
        self.pods.append(pod)
        self.ranking.forget()
        return pod

    async def apply_records(self, records: list[PodRecord]) -> None:
        """Follows the registry: adds this role's new pods (polled at once), drops the ones
        that left it; pods given by address stay whatever the registry says."""
        mine = {record.address: record for record in records if record.role == self.role}
        new = []
        for pod in list(self.pods):
            if pod.address in mine:
                pod.record = mine.pop(pod.address)
            elif pod.address in self.addresses:
                pod.record = None  # given by address: stays, without its index entries
            elif pod.record is not None:
                logger.info("%s pod %s left the registry", self.role, pod.address)
                self.pods.remove(pod)
                self.ranking.forget()
                self._close_when_idle(self._channels.pop(pod.address))
        for address, record in mine.items():
            logger.info("%s pod %s joined (%s)", self.role, address, record.pod_id)
            new.append(self._add(address, record))
        await asyncio.gather(*(self._poll_one(pod) for pod in new))

    def _close_when_idle(self, channel: grpc.aio.Channel) -> None:
        """A pod that left the registry is draining: its streams in flight must finish, so
        its channel closes once they have (or after the grace), never at once: closing a
        grpc.aio channel cancels every call on it."""
        task = asyncio.create_task(channel.close(grace=LEAVING_POD_GRACE_SECONDS))
        self._leaving[task] = channel
        task.add_done_callback(self._leaving.pop)

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
        for task, channel in list(self._leaving.items()):
            task.cancel()
            await channel.close()  # the gateway is stopping: no grace for its streams
        for channel in self._channels.values():
            await channel.close()

    def available(self) -> list[Pod]:
        """The pods routing may choose, in the pool's order."""
        self.ranking.catch_up(self.pods)
        return self.ranking.available()

    def ranked(self, weights: RoutingWeights) -> LoadRanking:
        """The ranking, up to date and ranking by `weights` (the shortlist's lists)."""
        self.ranking.catch_up(self.pods, weights)
        return self.ranking

    def lora_adapters(self) -> set[str]:
        """Every LoRA adapter some available pod holds."""
        return {name for pod in self.available() for name in pod.lora_adapters}

    def mark_unreachable(self, pod: Pod) -> None:
        """A call could not reach `pod` (connection refused or reset, the pod gone): routing
        skips it for the cooldown, or until a stats poll begun after now succeeds."""
        if not pod.is_cooling_down:  # once per episode, not once per failed call
            logger.warning(
                "%s pod %s is unreachable: not routing to it for up to %g s",
                self.role,
                pod.address,
                self.unreachable_cooldown_s,
            )
        now = time.monotonic()
        pod.unreachable_since = now
        pod.unreachable_until = now + self.unreachable_cooldown_s

    @property
    def max_model_len(self) -> int | None:
        """The context every available pod can serve: the smallest of theirs."""
        # An available pod has stats (is_available); the test says so to the type checker.
        lengths = [pod.stats.max_model_len for pod in self.available() if pod.stats is not None]
        return min(lengths) if lengths else None

    async def poll(self) -> None:
        await asyncio.gather(*(self._poll_one(pod) for pod in list(self.pods)))

    async def _poll_forever(self) -> None:
        next_pod = 0  # where the next slice starts, in a large pool
        while True:
            await asyncio.sleep(self.poll_interval_s)
            pods = list(self.pods)
            per_tick = max(1, int(MAX_POLLS_PER_SECOND * self.poll_interval_s))
            if len(pods) <= per_tick:
                await self.poll()
                continue
            start = next_pod % len(pods)
            due = (pods + pods)[start : start + per_tick]
            next_pod = start + per_tick
            await asyncio.gather(*(self._poll_one(pod) for pod in due))

    async def _poll_one(self, pod: Pod) -> None:
        started = time.monotonic()  # a good answer to a poll begun later than a failure ends it
        start = time.perf_counter()
        try:
            stats = await pod.stub.GetStats(
                worker_pb2.StatsRequest(), timeout=STATS_TIMEOUT_SECONDS
            )
        except grpc.aio.AioRpcError as error:
            if pod.stats is not None:
                logger.warning("%s pod %s is unreachable: %s", self.role, pod.address, error.code())
            pod.stats = None
            pod.failing_since = pod.failing_since or started
            if started - pod.failing_since >= POD_DOWN_SECONDS and pod.call_breakers:
                logger.warning(
                    "%s pod %s has not answered for %.0f s: breaking off its %d call(s)",
                    self.role,
                    pod.address,
                    started - pod.failing_since,
                    len(pod.call_breakers),
                )
                pod.break_calls()
            return
        pod.failing_since = None
        is_up_now = pod.stats is None
        if is_up_now:
            logger.info("%s pod %s is up (%s)", self.role, pod.address, stats.worker_id)
        serving = stats.model == self.model_name
        if not serving and (pod.stats is None or pod.is_serving_model):
            logger.warning(
                "%s pod %s serves %r, not %r: not routing to it",
                self.role,
                pod.address,
                stats.model,
                self.model_name,
            )
        pod.stats, pod.num_dispatched, pod.is_serving_model = stats, 0, serving
        pod.dispatched_prompt_tokens = 0
        _end_cooldown_if_answered_since(pod, started)
        if is_up_now and self.on_pod_up is not None:
            task = asyncio.create_task(self.on_pod_up(pod), name=f"up-{pod.address}")
            self._pod_up_tasks.add(task)
            task.add_done_callback(self._pod_up_tasks.discard)
        rtt_ms = (time.perf_counter() - start) * 1000
        previous = pod.rtt_ms
        pod.rtt_ms = rtt_ms if previous is None else previous + RTT_SMOOTHING * (rtt_ms - previous)


def _end_cooldown_if_answered_since(pod: Pod, poll_started: float) -> None:
    """The pod answered a poll sent after a call failed to reach it: it is reachable again
    (a blip, or a pod back at the same address), so routing need not wait out the cooldown."""
    since = pod.unreachable_since
    if since is None or poll_started <= since:
        return
    if pod.is_cooling_down:
        logger.info("pod %s is reachable again", pod.address)
    pod.unreachable_since, pod.unreachable_until = None, 0.0
