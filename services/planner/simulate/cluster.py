"""The discrete-event simulation of gateway + P prefill pods + D decode pods.

A request goes the way `docs/structure.md` walks it through the services:

1. at its arrival the gateway picks the decode pod holding its prefix (else the least loaded)
   and the least loaded prefill pod, from the pods' stats at its last poll plus what it sent
   since (`gateway.py`), as the real gateway does;
2. the decode pod prefills locally when fewer than `local_prefill_threshold` prompt tokens are
   uncached there, when there are no prefill pods (colocated, P = 0), when the prompt's
   blocks are not free, or when `max_remote_prefill_tokens` of its prompt tokens are already
   in flight at the chosen prefill pod (conditional disaggregation); otherwise it reserves the
   blocks and the prefill pod computes the prompt in its own batches (chunked prefill);
3. when the prefill pod samples the first token, the KV pages travel (the profile's transfer
   time) and the first token reaches the client as they land;
4. the decode pod joins the request to its running batch; each step emits one token per
   running request, until `output_len` tokens.

Events are (time, phase, order, kind, payload) in a heap; a pod runs one step at a time, and
work that arrives mid-step waits for the next one, as on the real engine thread. An idle pod
starts its step after every other event of the same instant (phase 1), so requests that
arrive together are scheduled together.
"""

from __future__ import annotations

import bisect
import collections
import heapq
import itertools
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from splitserve.common.conditional_prefill import prefill_pod_is_full
from splitserve.engine.gc_heap import collector_paused
from splitserve.gateway.routing.pods import POLL_INTERVAL_SECONDS
from splitserve.loadgen.stats import Slo
from splitserve.loadgen.workload import SimRequest
from splitserve.planner.profile import Profile
from splitserve.planner.simulate.admission import predicted_ttft_s
from splitserve.planner.simulate.decode_runs import (
    DecodeRun,
    DecodeStepCosts,
    is_plain_decode,
    plan_run,
)
from splitserve.planner.simulate.failures import PodFailure
from splitserve.planner.simulate.gap_spread import GapSpread
from splitserve.planner.simulate.gateway import SimGateway
from splitserve.planner.simulate.pod import PodLimits, ScheduledStep, SimPod, SimSeq
from splitserve.planner.simulate.prefix_cache import TierSizes
from splitserve.planner.simulate.results import RequestRecord, SimResult, summarize
from splitserve.planner.simulate.speculation import SpeculationModel

ARRIVAL, STEP_DONE, KV_LANDED, KICK, POLL, POD_DIES, STREAMS_BROKEN, LOADED, RUN_DONE = range(9)


@dataclass(frozen=True)
class ClusterConfig:
    num_prefill: int  # 0 = colocated: decode pods prefill everything themselves
    num_decode: int
    local_prefill_threshold: int = 32  # as `splitserve up --local-prefill-threshold`
    max_remote_prefill_tokens: int = 0  # as `splitserve up --max-remote-prefill-tokens`
    # Engine limits; None = the profile's.
    max_num_batched_tokens: int | None = None
    long_prefill_token_threshold: int | None = None
    # As `--max-prefill-tokens-while-decoding` (a step that also decodes takes at most this
    # many prompt tokens); None = no cap.
    max_prefill_tokens_while_decoding: int | None = None
    num_kv_blocks: int | None = None
    # How often the gateway refreshes its pod stats (the real gateway's constant); 0 = it sees
    # every pod's exact load at each arrival.
    gateway_poll_interval_s: float = POLL_INTERVAL_SECONDS
    # Speculative decoding on the decode pods (drafts per row and their acceptance rate).
    speculation: SpeculationModel | None = None
    # Decode pods that die during the run (`failures.py`).
    failures: tuple[PodFailure, ...] = ()
    # KV offload tiers below each pod's cache (`prefix_cache.py`); loads cost the profile's
    # measured tier bandwidth.
    tier_sizes: TierSizes = field(default_factory=TierSizes)
    # Pods that share one machine (prefill pods first, then decode pods, in groups of this
    # many): with the profile's `neighbor` slowdowns, a step takes longer while other pods of
    # its machine run steps. 1: every pod on its own (GPU pods on their own devices).
    pods_per_host: int = 1
    # The gateway's SLO-aware admission (`--admission --slo-ttft-ms`, admission.py): a request
    # predicted to miss this TTFT is refused on arrival. None: every request is let through.
    admission_ttft_s: float | None = None
    # Repeated decode steps as one event where that changes nothing (decode_runs.py); False
    # simulates every step as its own event (the tests compare the two).
    decode_runs: bool = True

    def __post_init__(self) -> None:
        if self.admission_ttft_s is not None and not self.admission_ttft_s > 0:
            raise ValueError(f"admission_ttft_s must be > 0 seconds, got {self.admission_ttft_s}")
        if self.pods_per_host < 1:
            raise ValueError(f"pods_per_host must be >= 1, got {self.pods_per_host}")
        if any(f.decode_pod >= self.num_decode for f in self.failures):
            raise ValueError(
                f"a pod failure names a decode pod past the {self.num_decode} there are"
            )
        if self.num_prefill < 0 or self.num_decode < 1:
            raise ValueError(
                f"need prefill pods >= 0 and decode pods >= 1, got {self.num_prefill}, "
                f"{self.num_decode}"
            )
        if self.local_prefill_threshold < 0:
            raise ValueError("local_prefill_threshold must be >= 0")
        if self.max_remote_prefill_tokens < 0:
            raise ValueError("max_remote_prefill_tokens must be >= 0")
        bounded = (
            "max_num_batched_tokens",
            "long_prefill_token_threshold",
            "max_prefill_tokens_while_decoding",
            "num_kv_blocks",
        )
        for name in bounded:
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        interval = self.gateway_poll_interval_s
        if not (math.isfinite(interval) and interval >= 0):
            raise ValueError(f"gateway_poll_interval_s must be >= 0 seconds, got {interval}")

    @property
    def label(self) -> str:
        if self.num_prefill == 0:
            return f"{self.num_decode} colocated"
        return f"{self.num_prefill}P+{self.num_decode}D"

    def limits(self, profile: Profile) -> PodLimits:
        return PodLimits(
            max_num_batched_tokens=self.max_num_batched_tokens or profile.max_num_batched_tokens,
            max_num_seqs=profile.max_num_seqs,
            num_kv_blocks=self.num_kv_blocks or profile.num_kv_blocks,
            block_size=profile.block_size,
            long_prefill_token_threshold=self.long_prefill_token_threshold,
            max_prefill_tokens_while_decoding=self.max_prefill_tokens_while_decoding,
            num_speculative_tokens=(
                self.speculation.num_speculative_tokens if self.speculation else 0
            ),
            tier_sizes=self.tier_sizes,
        )


# (time, phase, id, kind, payload): the heap orders by the first three; ids are unique.
_Event = tuple[float, int, int, int, object]


@dataclass(eq=False)
class _Flight:
    """One request across the cluster: its decode-side sequence and client-side timings."""

    record: RequestRecord
    decode_pod: SimPod
    decode_seq: SimSeq
    last_token_s: float = 0.0
    num_emitted: int = 0
    # (prefill pod name, uncached tokens) while a prefill pod computes this prompt.
    remote: tuple[str, int] | None = None


@dataclass
class Simulation:
    profile: Profile
    cluster: ClusterConfig
    # The prefill pods' own profile, when they run another setup than the decode pods (other
    # weights or parallel layout); None = `profile`. The KV format must be the same.
    prefill_profile: Profile | None = None
    prefill_pods: list[SimPod] = field(default_factory=list)
    decode_pods: list[SimPod] = field(default_factory=list)
    _events: list[_Event] = field(default_factory=list)
    _kick_pending: set[str] = field(default_factory=set)  # pod names with a KICK queued
    _order: itertools.count = field(default_factory=itertools.count)
    _flights: dict[int, _Flight] = field(default_factory=dict)  # request_id -> flight
    _in_flight_step: dict[str, ScheduledStep] = field(default_factory=dict)  # pod name -> step
    gateway: SimGateway = field(init=False)
    _num_pending_arrivals: int = 0  # polls go on while requests are still to come
    _rng: random.Random = field(default_factory=lambda: random.Random(0))  # draft acceptance
    _dead: set[str] = field(default_factory=set)  # names of pods that died
    # Pod name -> flights whose pages landed while a step ran there (joined at its end).
    _landed_mid_step: dict[str, list[_Flight]] = field(default_factory=dict)
    # Pod name -> (flight, prefill pod) whose reservation waits for the step in flight there.
    _reserve_mid_step: dict[str, list[tuple[_Flight, SimPod]]] = field(default_factory=dict)
    # (decode pod name, prefill pod name) -> the decode pod's prompt tokens in flight there.
    _remote_tokens: dict[tuple[str, str], int] = field(default_factory=dict)
    # Pod name -> the other pods of its machine (`ClusterConfig.pods_per_host`).
    _host_mates: dict[str, tuple[str, ...]] = field(default_factory=dict)
    # Pod name -> the decode run it is in (decode_runs.py).
    _runs: dict[str, DecodeRun] = field(default_factory=dict)
    _run_step_costs: DecodeStepCosts = field(default_factory=DecodeStepCosts)
    _event_id: int = -1  # the id of the event being handled
    _gap_spread: GapSpread | None = field(init=False, default=None)  # None: a bare profile
    num_events: int = 0  # handled by `run`, stale ones included

    def __post_init__(self) -> None:
        # The serving path's measured costs of this topology (none in a bare profile).
        self.profile = self.profile.for_topology(self.cluster.num_prefill)
        if self.profile.itl_spread_s:
            self._gap_spread = GapSpread(self.profile.itl_spread_s)
        prefill_profile = (self.prefill_profile or self.profile).for_topology(
            self.cluster.num_prefill
        )
        if prefill_profile.kv_bytes_per_token != self.profile.kv_bytes_per_token:
            raise ValueError(
                "the prefill and decode profiles hold KV in different formats "
                f"({prefill_profile.kv_bytes_per_token} and {self.profile.kv_bytes_per_token} "
                "bytes per token): pods exchange pages in one format"
            )
        tiers = self.cluster.tier_sizes
        if (tiers.host_blocks or tiers.disk_blocks) and self.profile.tier_loads is None:
            raise ValueError("KV offload tiers need a profile with tier loads (`plan profile`)")
        limits = self.cluster.limits(self.profile)
        self.prefill_pods = [
            SimPod(f"prefill-{i}", self.cluster.limits(prefill_profile), prefill_profile)
            for i in range(self.cluster.num_prefill)
        ]
        self.decode_pods = [
            SimPod(f"decode-{i}", limits, self.profile) for i in range(self.cluster.num_decode)
        ]
        pods = self.prefill_pods + self.decode_pods
        per_host = self.cluster.pods_per_host
        for i, pod in enumerate(pods):
            first = i - i % per_host
            machine = pods[first : first + per_host]
            self._host_mates[pod.name] = tuple(p.name for p in machine if p is not pod)
        # The gateway's own lists: a dead pod leaves its view, not the simulation's pods.
        self.gateway = SimGateway(
            list(self.prefill_pods), list(self.decode_pods), self.cluster.gateway_poll_interval_s
        )

    def run(self, requests: list[SimRequest], slo: Slo) -> SimResult:
        self._check_fits(requests)
        if requests and self.cluster.gateway_poll_interval_s > 0:
            # Polls start with the first arrival: the pods are idle before it.
            self._push(min(request.arrival_s for request in requests), POLL, None)
        # Arrivals wait in their own sorted queue rather than in the heap: a 10-minute trace
        # holds 300,000 of them, and every push and pop of the other events would climb
        # through a heap that deep. Their ids are taken here, in the order the heap would
        # have given them, so ties break exactly as before.
        arrivals = sorted(  # by (time, phase, id), as the heap orders; ids are unique
            (request.arrival_s, 0, next(self._order), ARRIVAL, request) for request in requests
        )
        for failure in self.cluster.failures:
            self._push(failure.at_s, POD_DIES, failure)
        self._num_pending_arrivals = len(requests)
        # A payload's type is its kind's handler's (each _push pairs them): Any here.
        handlers: dict[int, Callable[[float, Any], None]] = {
            ARRIVAL: self._on_arrival,
            STEP_DONE: self._on_step_done,
            KV_LANDED: self._on_kv_landed,
            KICK: self._on_kick,
            POLL: self._on_poll,
            POD_DIES: self._on_pod_dies,
            STREAMS_BROKEN: self._on_streams_broken,
            LOADED: self._on_loaded,
            RUN_DONE: self._on_run_done,
        }
        with collector_paused():  # the records and gaps it builds live to the end
            self._handle_events(collections.deque(arrivals), handlers)
        records = [flight.record for flight in self._flights.values()]
        pods = self.prefill_pods + self.decode_pods
        return summarize(records, slo, pods)

    def _handle_events(
        self, arrivals: collections.deque[_Event], handlers: dict[int, Callable[[float, Any], None]]
    ) -> None:
        """Every event in time order (then phase, then id): the next arrival or the heap's
        first, whichever comes first."""
        events = self._events
        while events or arrivals:
            if arrivals and (not events or arrivals[0] < events[0]):
                now, _, self._event_id, kind, payload = arrivals.popleft()
            else:
                now, _, self._event_id, kind, payload = heapq.heappop(events)
            self.num_events += 1
            handlers[kind](now, payload)

    def decode_pod_name(self, request_id: int) -> str:
        """The decode pod the gateway sent a request to (after `run`)."""
        return self._flights[request_id].decode_pod.name

    def _check_fits(self, requests: list[SimRequest]) -> None:
        limits = self.cluster.limits(self.profile)
        for request in requests:
            if -(-(request.input_len + 1) // limits.block_size) > limits.num_kv_blocks:
                raise ValueError(
                    f"request {request.request_id} ({request.input_len} input tokens) needs "
                    f"more KV blocks than a pod holds ({limits.num_kv_blocks})"
                )

    def _push(self, time_s: float, kind: int, payload: object) -> int:
        """Queues an event; returns its id (`_event_id` while it is handled)."""
        phase = 1 if kind == KICK else 0
        event_id = next(self._order)
        heapq.heappush(self._events, (time_s, phase, event_id, kind, payload))
        return event_id

    # ---- the gateway and the decode pod's choice --------------------------------------------

    def _on_poll(self, now: float, _: object) -> None:
        self._settle_all(now)  # the polls read every pod's load as it stands
        self.gateway.poll()
        if self._num_pending_arrivals > 0:
            self._push(now + self.cluster.gateway_poll_interval_s, POLL, None)

    def _on_arrival(self, now: float, request: SimRequest) -> None:
        self._num_pending_arrivals -= 1
        prefill_pod, decode_pod = self._pick(request, now)
        seq = SimSeq(request, num_tokens=request.input_len)
        flight = _Flight(RequestRecord(request), decode_pod, seq)
        self._flights[request.request_id] = flight
        uncached = request.input_len - decode_pod.num_cached_tokens(request)
        if self._refuses(prefill_pod or decode_pod, decode_pod, uncached):
            flight.record.is_refused = True
            self.gateway.undo(prefill_pod, decode_pod)
            return
        if prefill_pod is None or uncached < self.cluster.local_prefill_threshold:
            self._enqueue(decode_pod, seq, now)
        elif decode_pod.is_busy:
            # The reservation is a command the pod's engine thread takes between steps
            # (shared/async_llm.py): the prefill pod is asked only once this step ends.
            self._interrupt(decode_pod, now)
            self._reserve_mid_step.setdefault(decode_pod.name, []).append((flight, prefill_pod))
        else:
            self._reserve(flight, prefill_pod, now)

    def _pick(self, request: SimRequest, now: float) -> tuple[SimPod | None, SimPod]:
        if self.cluster.gateway_poll_interval_s == 0:
            self._settle_all(now)  # the gateway then reads every pod's load at each pick
        return self.gateway.pick(request)

    def _refuses(self, prefilling: SimPod, decode_pod: SimPod, prompt_tokens: int) -> bool:
        limit = self.cluster.admission_ttft_s
        if limit is None:
            return False
        return predicted_ttft_s(prefilling, decode_pod, prompt_tokens) > limit

    def _reserve(self, flight: _Flight, prefill_pod: SimPod, now: float) -> None:
        """Blocks on the decode pod for a remote prefill, or a local prefill without them."""
        decode_pod, seq, request = flight.decode_pod, flight.decode_seq, flight.record.request
        uncached = request.input_len - decode_pod.num_cached_tokens(request)
        link = (decode_pod.name, prefill_pod.name)
        if self._prefill_pod_is_full(link, uncached, decode_pod) or not decode_pod.try_reserve(seq):
            self._enqueue(decode_pod, seq, now)
            return
        self._remote_tokens[link] = self._remote_tokens.get(link, 0) + uncached
        flight.remote = (prefill_pod.name, uncached)
        # The decode pod loads what its own tiers hold while the prefill pod computes the rest
        # (the load overlaps the remote prefill, so it costs no time here).
        group = request.prefix_group
        if group is not None and group in decode_pod.cache:
            decode_pod.cache.count_hit(group, seq.num_computed)
            decode_pod.remember_prefix(request)
        prefill_seq = SimSeq(request, num_tokens=request.input_len, is_prefill_only=True)
        self._enqueue(prefill_pod, prefill_seq, now)

    def _prefill_pod_is_full(
        self, link: tuple[str, str], uncached: int, decode_pod: SimPod
    ) -> bool:
        """The decode pod's conditional-disaggregation rule (services/common/
        conditional_prefill.py): past the limit of its tokens in flight there, which grows with
        the streams it runs, it prefills the prompt itself."""
        return prefill_pod_is_full(
            self.cluster.max_remote_prefill_tokens,
            self._remote_tokens.get(link, 0),
            uncached,
            len(decode_pod.running),
        )

    def _enqueue(self, pod: SimPod, seq: SimSeq, now: float) -> None:
        """Into the pod's queue; a prefix its offload tiers hold is loaded back first."""
        # Its cache may change below (a tier hit, a prefix back on the device): a decode run
        # planned on the cache as it was ends with the step in flight.
        self._interrupt(pod, now)
        group = seq.request.prefix_group
        tier = None
        if group is not None:
            tier = pod.cache.tier_of(group)
            if tier is not None:
                pod.cache.count_hit(group, pod.num_cached_tokens(seq.request))
        if tier in ("host", "disk"):
            load_s = self.profile.tier_load_s(tier, pod.num_cached_tokens(seq.request))
            pod.remember_prefix(seq.request)  # back on the device once loaded
            self._push(now + load_s, LOADED, (pod, seq))
            return
        pod.add(seq)
        self._kick(pod, now)

    def _on_loaded(self, now: float, payload: tuple[SimPod, SimSeq]) -> None:
        pod, seq = payload
        if pod.name in self._dead:
            self._move(self._flights[seq.request.request_id], now, None)
            return
        pod.add(seq)
        self._kick(pod, now)

    # ---- engine steps -----------------------------------------------------------------------

    def _kick(self, pod: SimPod, now: float) -> None:
        """Starts a step on an idle pod, once this instant's other events are in; new work
        for a pod in a decode run joins after the step in flight."""
        self._interrupt(pod, now)
        if not pod.is_busy and pod.name not in self._kick_pending:
            self._kick_pending.add(pod.name)
            self._push(now, KICK, pod)

    def _on_kick(self, now: float, pod: SimPod) -> None:
        self._kick_pending.discard(pod.name)
        if pod.is_busy or not pod.has_work() or pod.name in self._dead:
            return
        step = pod.schedule()
        self._end_dropped(pod, now)
        if not step.chunks:
            return  # everything waits for blocks that only a finishing request frees
        step = self._beside_neighbors(pod, step)
        pod.is_busy = True
        self._in_flight_step[pod.name] = step
        run = self._plan_run(pod, step, now)
        if run is None:
            pod.busy_s += step.duration_s
            self._push(now + step.duration_s, STEP_DONE, pod)
            return
        pod.busy_s += sum(run.durations)
        self._runs[pod.name] = run
        run.event_id = self._push(run.ends[run.last], RUN_DONE, run)

    # ---- decode runs (decode_runs.py) -------------------------------------------------------

    def _plan_run(self, pod: SimPod, step: ScheduledStep, now: float) -> DecodeRun | None:
        if (
            not self.cluster.decode_runs
            or self.cluster.speculation is not None
            or (pod.profile.neighbor is not None and self._host_mates[pod.name])
            or not is_plain_decode(pod, step)
        ):
            return None
        flights = [self._flights[seq.request.request_id] for seq, _ in step.chunks]
        # A row one token short of its prompt (a cached prefix covering all but the last
        # prompt token, a last 1-token chunk) also counts as decoding, but its first token
        # is its TTFT and caches its prefix: only rows past their first token run ahead.
        if any(flight.num_emitted == 0 for flight in flights):
            return None
        tokens_left = [flight.record.request.output_len - flight.num_emitted for flight in flights]
        return plan_run(pod, step, now, tokens_left, self._run_step_costs)

    def _on_run_done(self, now: float, run: DecodeRun) -> None:
        if self._runs.get(run.pod.name) is not run or run.event_id != self._event_id:
            return  # the run was cut short: a newer event ends it
        self._settle(run.pod, now)
        del self._runs[run.pod.name]
        self._on_step_done(now, run.pod)  # the last step ends as any step does

    def _settle(self, pod: SimPod, now: float) -> None:
        """The steps of the pod's run that ended before `now` give their tokens, and the step
        after them takes its blocks, as step-by-step simulation does at each step end (no row
        finishes before the run's last step, and no block taken evicts a cached prefix, so
        each row's tokens and blocks can go at once)."""
        run = self._runs.get(pod.name)
        if run is None:
            return
        first = run.num_applied
        stop = min(bisect.bisect_left(run.ends, now, first), run.last)
        if stop == first:
            return
        ends = run.ends[first:stop]
        later_gaps = [end - previous for previous, end in zip(ends, ends[1:])]
        for seq in run.seqs:
            self._emit_run_tokens(seq, ends, later_gaps)
            pod.allocate_decode_block(seq)
        run.num_applied = stop

    def _settle_all(self, now: float) -> None:
        for run in self._runs.values():  # settling changes no pod's run
            self._settle(run.pod, now)

    def _interrupt(self, pod: SimPod, now: float) -> None:
        """Ends the pod's run with the step in flight now: what reaches the pod joins the
        step after it, as it would between steps simulated one by one."""
        run = self._runs.get(pod.name)
        if run is None:
            return
        self._settle(pod, now)
        if run.num_applied == run.last:
            return
        pod.busy_s -= sum(run.durations[run.num_applied + 1 : run.last + 1])
        run.last = run.num_applied
        run.event_id = self._push(run.ends[run.last], RUN_DONE, run)

    def _beside_neighbors(self, pod: SimPod, step: ScheduledStep) -> ScheduledStep:
        """`step` slowed by the steps other pods of its machine are running as it starts. Only
        the start is looked at: a step that began alone and is joined midway runs at its own
        cost, one that starts beside a running step pays for the whole of it, which over many
        steps is the same share of overlap on average."""
        slowdown = pod.profile.neighbor
        if slowdown is None:
            return step
        neighbor_kinds = [
            self._in_flight_step[name].kind
            for name in self._host_mates[pod.name]
            if name in self._in_flight_step and name not in self._dead
        ]
        if not neighbor_kinds:
            return step
        return replace(
            step, duration_s=step.duration_s * slowdown.factor(step.kind, neighbor_kinds)
        )

    def _on_step_done(self, now: float, pod: SimPod) -> None:
        pod.is_busy = False
        step = self._in_flight_step.pop(pod.name)
        if pod.name in self._dead:
            return  # it died mid-step: nothing of the step reaches anyone
        for seq in pod.apply(step):
            if seq.is_prefill_only:
                self._send_kv(pod, seq, now)
            else:
                self._emit_tokens(pod, seq, now, 1 + self._accepted_drafts(seq))
        for flight in self._landed_mid_step.pop(pod.name, []):
            self._complete(flight, now)
        for flight, prefill_pod in self._reserve_mid_step.pop(pod.name, []):
            self._reserve(flight, prefill_pod, now)
        self._kick(pod, now)

    def _accepted_drafts(self, seq: SimSeq) -> int:
        speculation = self.cluster.speculation
        if not seq.num_drafts or speculation is None:
            return 0
        return speculation.draw_accepted(self._rng, seq.num_drafts)

    def _end_dropped(self, pod: SimPod, now: float) -> None:
        for seq in pod.dropped:
            self._flights[seq.request.request_id].record.is_dropped = True
        pod.dropped.clear()

    # ---- prefill pod -> decode pod ----------------------------------------------------------

    def _send_kv(self, prefill_pod: SimPod, seq: SimSeq, now: float) -> None:
        prefill_pod.finish(seq)
        prefill_pod.remember_prefix(seq.request)
        flight = self._flights[seq.request.request_id]
        num_tokens = seq.request.input_len - flight.decode_seq.num_computed
        flight.record.transfer_s = self.profile.transfer_s(num_tokens)
        self._push(now + flight.record.transfer_s, KV_LANDED, flight)

    def _on_kv_landed(self, now: float, flight: _Flight) -> None:
        pod = flight.decode_pod
        if flight.remote is not None:  # the prefill call returns as its pages land
            prefill_name, uncached = flight.remote
            self._remote_tokens[pod.name, prefill_name] -= uncached
            flight.remote = None
        if pod.name in self._dead:
            self._move(flight, now, None)  # the pages had nowhere to go
            return
        if pod.is_busy:
            # The pod's engine thread takes the pages (and releases the first token) between
            # steps: a command queued while a step runs waits for its end (shared/async_llm.py).
            self._interrupt(pod, now)
            self._landed_mid_step.setdefault(pod.name, []).append(flight)
            return
        self._complete(flight, now)

    def _complete(self, flight: _Flight, now: float) -> None:
        pod, seq = flight.decode_pod, flight.decode_seq
        pod.complete_reserved(seq)
        self._emit_tokens(pod, seq, now, 1)
        self._kick(pod, now)

    # ---- tokens to the client ---------------------------------------------------------------

    def _request_overhead_s(self, request: SimRequest) -> float:
        """The serving path's time before a first token that no pod's step accounts for."""
        profile = self.profile
        return profile.request_overhead_s + profile.token_overhead_s * request.input_len

    def _emit_tokens(self, pod: SimPod, seq: SimSeq, now: float, count: int) -> None:
        """`count` tokens reach the client together (a verified row's accepted drafts and its
        own token); like the client, each gets an equal share of the gap since the last."""
        flight = self._flights[seq.request.request_id]
        record = flight.record
        count = min(count, seq.request.output_len - flight.num_emitted)
        if flight.num_emitted == 0:
            record.ttft_s = now - seq.request.arrival_s + self._request_overhead_s(seq.request)
            pod.remember_prefix(seq.request)
            num_gaps = count - 1  # the rest of the first burst came with the first token
            gap = 0.0
        else:
            num_gaps = count
            gap = now - flight.last_token_s
        share = gap / max(num_gaps, 1)
        record.itls_s += [share] * num_gaps
        flight.num_emitted += count
        flight.last_token_s = now
        if flight.num_emitted >= seq.request.output_len:
            record.itls_s = self._client_gaps_s(record)
            record.finish_s = now
            pod.finish(seq)
        else:
            seq.num_tokens += count
            seq.num_computed = seq.num_tokens - 1  # the accepted drafts' KV stays

    def _emit_run_tokens(self, seq: SimSeq, ends: list[float], later_gaps: list[float]) -> None:
        """`_emit_tokens` of one token at each of `ends`, for a row that is past its first
        token and does not finish by them (a decode run's row); `later_gaps` are the gaps
        between `ends`, the same for every row of the run."""
        flight = self._flights[seq.request.request_id]
        itls_s = flight.record.itls_s
        itls_s.append(ends[0] - flight.last_token_s)
        itls_s += later_gaps
        flight.num_emitted += len(ends)
        flight.last_token_s = ends[-1]
        seq.num_tokens += len(ends)
        seq.num_computed = seq.num_tokens - 1

    def _client_gaps_s(self, record: RequestRecord) -> list[float]:
        """A finished request's token gaps as the client times them: the steps' gaps plus one
        of the serving path's measured deviations each (none for a bare profile), the
        request's own in token order (gap_spread.py), so that they do not depend on the order
        the pods' steps were simulated in. Added once, as the request finishes: its gaps are
        read only then (`summarize`)."""
        if self._gap_spread is None or not record.itls_s:
            return record.itls_s
        return self._gap_spread.client_gaps_s(record.request.request_id, record.itls_s)

    # ---- pods that die ----------------------------------------------------------------------

    def _on_pod_dies(self, now: float, failure: PodFailure) -> None:
        pod = next(p for p in self.decode_pods if p.name == failure.pod_name)
        self._interrupt(pod, now)  # the steps that ended reached the clients; not the rest
        self._dead.add(pod.name)
        if pod in self.gateway.decode_pods:
            self.gateway.remove_decode_pod(pod)
        self._push(now + failure.detect_s, STREAMS_BROKEN, failure)

    def _on_streams_broken(self, now: float, failure: PodFailure) -> None:
        broken = [
            flight
            for flight in self._flights.values()
            if flight.decode_pod.name == failure.pod_name
            and flight.record.finish_s is None
            and not flight.record.is_dropped
            and not flight.record.is_refused
            and not flight.decode_seq.is_waiting_for_kv  # those move when their pages land
        ]
        # Pages that landed there mid-step, waiting for a step end that never came.
        broken += self._landed_mid_step.pop(failure.pod_name, [])
        broken += [flight for flight, _ in self._reserve_mid_step.pop(failure.pod_name, [])]
        for flight in broken:
            self._move(flight, now, failure)

    def _move(self, flight: _Flight, now: float, failure: PodFailure | None) -> None:
        """The sequence goes to a live decode pod with what the client has, prefilled there."""
        request = flight.record.request
        num_tokens = request.input_len + flight.num_emitted
        limit = failure.max_replay_tokens if failure else math.inf
        if not self.gateway.decode_pods or (flight.num_emitted and num_tokens > limit):
            flight.record.is_dropped = True
            return
        _, pod = self._pick(request, now)
        seq = SimSeq(request, num_tokens=num_tokens)
        flight.decode_pod, flight.decode_seq = pod, seq
        flight.record.num_moves += 1
        self._enqueue(pod, seq, now)


def simulate(
    profile: Profile,
    cluster: ClusterConfig,
    requests: list[SimRequest],
    slo: Slo,
    prefill_profile: Profile | None = None,
) -> SimResult:
    return Simulation(profile, cluster, prefill_profile).run(requests, slo)
