"""Admission control: which requests the gateway lets through to the pods now, which wait, and
which it refuses at once because no pod could serve them within their SLO.

    admit(ask) ─▶ predict its TTFT/TPOT on the pods as they stand (predict.py)
               ─▶ an SLO-bound request whose prediction misses: refused now (429, or 503 when
                  the pool is saturated), before any prefill is spent on it
               ─▶ room in the pool and nobody queued: admitted now
               ─▶ otherwise queued (fair_queue.py); an SLO-bound request whose predicted wait
                  plus service misses its TTFT is refused now instead (503)
               ─▶ a queued request leaves when room frees up (admitted), when its wait passes
                  the queue timeout or its TTFT deadline (408), or when its client goes away
    release(ticket) when the generation ends: its rows are free, its figures are recorded.

Room is counted in rows (sequences in flight through this gateway) against the sum of the
decode pods' row caps: each pod's own maximum, lowered so that its fitted step stays within
the default TPOT objective (`predict.row_cap`). Several gateways in front of one pool each
count only their own requests; the pods' RESOURCE_EXHAUSTED is the backstop there.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc

from splitserve.common.grpc_server import StatusError
from splitserve.gateway.admission.demand import AskDemand
from splitserve.gateway.admission.fair_queue import FairQueue, QueueFull, Waiter
from splitserve.gateway.admission.feedback import (
    INITIAL_ROWS,
    TPOT_TARGET_SHARE,
    Calibration,
    RowLimit,
)
from splitserve.gateway.admission.load_window import LoadWindow
from splitserve.gateway.admission.metrics import AdmissionMetrics
from splitserve.gateway.admission.predict import (
    Prediction,
    best_prediction,
    modelled_gap_ms,
    row_cap,
)
from splitserve.gateway.admission.slo import Slo
from splitserve.gateway.routing.pods import Pod, PodPool

logger = logging.getLogger(__name__)

# How often queued requests are looked at while nothing ends (pods may join or free rows).
QUEUE_TICK_SECONDS = 0.05
# A tenant that asked within this long (or has rows in flight) counts as active: a row is
# kept for it while it is below its share.
ACTIVE_TENANT_SECONDS = 2.0


class AdmissionRefused(StatusError):
    """A request the gateway will not serve now: HTTP 429, 503 or 408 with Retry-After (gRPC
    RESOURCE_EXHAUSTED, UNAVAILABLE or DEADLINE_EXCEEDED). `reason` names why (the metrics'
    label)."""

    _CODES = {
        429: grpc.StatusCode.RESOURCE_EXHAUSTED,
        503: grpc.StatusCode.UNAVAILABLE,
        408: grpc.StatusCode.DEADLINE_EXCEEDED,
    }

    def __init__(self, http_status: int, reason: str, message: str, retry_after_s: float) -> None:
        super().__init__(self._CODES[http_status], message)
        self.http_status = http_status
        self.reason = reason
        self.retry_after_s = retry_after_s

    @property
    def retry_after(self) -> dict[str, str]:
        return {"Retry-After": str(max(1, math.ceil(self.retry_after_s)))}

    @property
    def trailers(self) -> tuple[tuple[str, str], ...]:
        """gRPC clients get the same advice as trailing metadata."""
        return (("retry-after", self.retry_after["Retry-After"]),)


@dataclass(frozen=True)
class AdmissionSettings:
    slo: Slo = field(default_factory=Slo)  # the default objective (--slo-ttft-ms, ...)
    batch_priority: int = 100  # at or past it: batch work, never refused on a prediction
    queue_timeout_s: float = 30.0
    max_queued_per_tenant: int = 256
    fallback_row_cap: int = 64  # rows for a pod that reports no maximum of its own


@dataclass(frozen=True)
class AdmissionAsk:
    """What admission knows of a request: whose, how urgent, how big."""

    request_id: str
    tenant: str
    priority: int
    slo: Slo
    num_sequences: int  # rows it takes (prompts x n)
    num_prompt_tokens: int  # its longest prompt
    max_tokens: int

    @property
    def cost(self) -> float:
        """What serving it advances its tenant's fair-share clock by."""
        return self.num_sequences * (self.num_prompt_tokens + self.max_tokens)


@dataclass
class Ticket:
    """An admitted request: released once, when its generation ends."""

    ask: AdmissionAsk
    predicted: Prediction | None  # at admission, calibrated, the queue's wait in its TTFT
    model: Prediction | None = None  # the cost model's own, uncalibrated, without the wait
    is_released: bool = False
    # Its tenant was under its fair share of the rows when it was admitted, beside others that
    # asked lately: the pods compute it ahead of the other tenants' work (`pod_priority`).
    favoured: bool = False
    asked_at: float = 0.0  # time.monotonic() of its ask: its service time runs from there


def pod_priority(priority: int, favoured: bool) -> int:
    """The priority the pods queue a request by (a lower value first, as vLLM orders them):
    the client's priority first, then, within one, a favoured request ahead of the others.
    Order-preserving, so the client's priorities keep their meaning on the pods."""
    return 2 * priority + (0 if favoured else 1)


class AdmissionController:
    """Owned by the gateway's event loop."""

    def __init__(
        self,
        settings: AdmissionSettings,
        decode_pool: PodPool,
        prefill_pool: PodPool | None,
        metrics: AdmissionMetrics,
        weight_of: Callable[[str], float] | None = None,
    ) -> None:
        self.settings = settings
        self.decode_pool = decode_pool
        self.prefill_pool = prefill_pool
        self.metrics = metrics
        self._queue = FairQueue(settings.max_queued_per_tenant, weight_of)
        self._futures: dict[Waiter, asyncio.Future[Ticket]] = {}
        self._asks: dict[Waiter, AdmissionAsk] = {}
        self.num_rows_in_flight = 0
        self._load = LoadWindow()  # asks and finishes lately: the finish rate, overload
        self._ticker: asyncio.Task | None = None
        self._row_limits: dict[str, RowLimit] = {}  # decode pod address -> its limit
        self._weight_of = weight_of or (lambda tenant: 1.0)
        self._tenant_rows: Counter[str] = Counter()  # tenant -> its rows in flight
        self._last_asked: dict[str, float] = {}  # tenant -> when it last asked
        self._demand = AskDemand()
        # Favoured requests go first on the pods, the others wait behind them as well: two
        # populations whose TTFTs the model misses by different amounts, so each has its own.
        self._ttft_calibrations = {False: Calibration(), True: Calibration()}
        self._tpot_calibration = Calibration()

    @property
    def num_queued(self) -> int:
        return len(self._queue)

    # ---- admitting --------------------------------------------------------------------------

    async def admit(self, ask: AdmissionAsk) -> Ticket:
        """A ticket once `ask` may go to the pods; raises AdmissionRefused."""
        arrived = time.monotonic()
        self._last_asked[ask.tenant] = arrived
        self._demand.note(ask.tenant, arrived, ask.num_sequences)
        self._load.note_ask(arrived)
        favoured = self._is_favoured(ask)
        model = self._model_prediction(ask, favoured)
        judged = None if model is None else self._judged(model, favoured, self._is_saturated(ask))
        bound = self._is_bound(ask)
        if bound and model is not None and judged is not None:
            # On an idle pool the TTFT is the cost model's own: its calibration was learnt
            # under load, from queueing the model does not see, and refusing here spares no
            # one. (The TPOT factor is taken against the rows the pods ran: it stays.)
            if self._is_idle():
                judged = Prediction(model.ttft_ms, judged.tpot_ms)
            self._refuse_if_service_misses(ask, judged)
        if not self._queue and self._has_room(ask) and not self._over_share(ask):
            return self._ticket(ask, arrived, False, model, favoured)
        return await self._wait_in_queue(ask, arrived, judged, bound)

    def first_token(self, ticket: Ticket, ttft_s: float) -> None:
        """The request's first token came `ttft_s` after its dispatch: the TTFT model learns
        how far off it was."""
        if ticket.model is not None:
            calibration = self._ttft_calibrations[ticket.favoured]
            calibration.observe(ttft_s * 1000, ticket.model.ttft_ms)

    def _is_bound(self, ask: AdmissionAsk) -> bool:
        return ask.slo.binds and ask.priority < self.settings.batch_priority

    def release(self, ticket: Ticket, ttft_s: float | None, tpot_s: float | None) -> None:
        """The request's generation ended (`ttft_s`/`tpot_s`: what it measured, None if it
        produced too little): its rows go back, queued requests may follow."""
        if ticket.is_released:
            return
        ticket.is_released = True
        self.num_rows_in_flight -= ticket.ask.num_sequences
        self._tenant_rows[ticket.ask.tenant] -= ticket.ask.num_sequences
        self.metrics.rows_in_flight.set(self.num_rows_in_flight)
        if ttft_s is not None:
            self._load.note_finish(time.monotonic(), ticket.asked_at)
            self._record(ticket, ttft_s, tpot_s)
        # The pods' windows of token gaps are taken when the rows are counted, which a lone
        # stream's admission skips (nothing in flight): count them as each stream ends.
        self.row_capacity()
        self._serve_queue()

    def _record(self, ticket: Ticket, ttft_s: float, tpot_s: float | None) -> None:
        predicted, slo = ticket.predicted, ticket.ask.slo
        if predicted is not None:
            ratio = self.metrics.prediction_ratio
            ratio.labels("ttft").observe(ttft_s * 1000 / max(predicted.ttft_ms, 1e-3))
            if tpot_s is not None:
                ratio.labels("tpot").observe(tpot_s * 1000 / max(predicted.tpot_ms, 1e-3))
        if slo.binds:
            tpot_ms = None if tpot_s is None else tpot_s * 1000
            met = slo.is_met(ttft_s * 1000, tpot_ms)
            self.metrics.slo_requests.labels("met" if met else "missed").inc()

    def _ticket(
        self,
        ask: AdmissionAsk,
        arrived: float,
        queued: bool,
        model: Prediction | None,
        favoured: bool,
    ) -> Ticket:
        """Admits `ask` now; `model`: the cost model's prediction for the pods as they stand,
        `favoured` as it was made (its TTFT is filed under that calibration)."""
        self.num_rows_in_flight += ask.num_sequences
        self._tenant_rows[ask.tenant] += ask.num_sequences
        self.metrics.rows_in_flight.set(self.num_rows_in_flight)
        queued_s = time.monotonic() - arrived
        predicted = None
        if model is not None:
            service = self._calibrated(model, favoured)
            predicted = Prediction(service.ttft_ms + queued_s * 1000, service.tpot_ms)
        self.metrics.admitted(queued)
        if queued:
            self.metrics.queue_seconds.observe(queued_s)
        return Ticket(ask, predicted, model, favoured=favoured, asked_at=arrived)

    # ---- refusing ---------------------------------------------------------------------------

    def _refuse_if_service_misses(self, ask: AdmissionAsk, prediction: Prediction) -> None:
        """Refuses `ask` when even the best pod, with no queue before it, misses its SLO."""
        slo = ask.slo
        misses = []
        if slo.ttft_ms is not None and prediction.ttft_ms > slo.ttft_ms:
            misses.append(f"time to first token {prediction.ttft_ms:.0f} ms > {slo.ttft_ms:g} ms")
        tpot = slo.tpot_ms
        if tpot is not None and not self._row_limits_hold(tpot) and prediction.tpot_ms > tpot:
            misses.append(f"time per output token {prediction.tpot_ms:.0f} ms > {slo.tpot_ms:g} ms")
        if not misses:
            return
        saturated = bool(self._queue) or not self._has_room(ask)
        self._refuse(
            503 if saturated else 429,
            "saturated" if saturated else "slo",
            f"no pod can serve this request within its SLO now: predicted {', '.join(misses)}",
            self._service_seconds(prediction, ask),
        )

    def _row_limits_hold(self, tpot_ms: float) -> bool:
        """Whether the pods' row limits hold a request to `tpot_ms` already: they steer each
        decode pod's token gaps to a share of the default TPOT objective, and a request that
        finds no row within them waits for one. A prediction near that objective is mostly
        the noise of the gaps it was calibrated on; refusing on it turned away requests the
        limits kept within their SLO (a quiet tenant beside a flood). A tighter objective
        than the default is still checked against the prediction, and so is every request
        once each pod's limit has sunk to one row: then no limit can hold the objective."""
        default = self.settings.slo.tpot_ms
        if default is None or tpot_ms < default:
            return False
        limits = (self._row_limits.get(pod.address) for pod in self.decode_pool.available())
        return any(limit is not None and limit.rows > 1 for limit in limits)

    def _refuse(self, status: int, reason: str, message: str, retry_after_s: float) -> None:
        self.metrics.refused(reason)
        raise AdmissionRefused(status, reason, message, retry_after_s)

    # ---- the queue --------------------------------------------------------------------------

    async def _wait_in_queue(
        self, ask: AdmissionAsk, arrived: float, prediction: Prediction | None, bound: bool
    ) -> Ticket:
        waiter = Waiter(ask.tenant, ask.priority, ask.cost, arrived)
        try:
            self._queue.push(waiter)
        except QueueFull:
            self._refuse(
                429,
                "queue_full",
                f"tenant {ask.tenant!r} has {self.settings.max_queued_per_tenant} requests "
                f"queued at priority {ask.priority} already",
                self._wait_s(waiter, ask, prediction),
            )
        future: asyncio.Future[Ticket] = asyncio.get_running_loop().create_future()
        self._futures[waiter], self._asks[waiter] = future, ask
        self.metrics.queued.set(len(self._queue))
        self._serve_queue()  # it may be next at once: a tenant under its share beside a backlog
        if future.done():  # served (or refused) now: no wait to predict
            return future.result()
        try:
            timeout = self._timeout_s(waiter, ask, prediction, bound)
        except AdmissionRefused:
            self._futures.pop(waiter, None)
            self._asks.pop(waiter, None)
            raise
        self._ensure_ticking()
        try:
            done, _ = await asyncio.wait({future}, timeout=timeout)
        except asyncio.CancelledError:  # the client went away while it waited
            self._abandon(waiter, future)
            raise
        if not done:
            self._abandon(waiter, future)
            deadline = bound and timeout < self.settings.queue_timeout_s
            self._refuse(
                408,
                "slo_deadline" if deadline else "queue_timeout",
                f"the request waited {timeout:.1f} s in the queue "
                + ("and could no longer meet its SLO" if deadline else "(the queue timeout)"),
                self._wait_s(waiter, ask, prediction),
            )
        return future.result()

    def _timeout_s(
        self, waiter: Waiter, ask: AdmissionAsk, prediction: Prediction | None, bound: bool
    ) -> float:
        """The queue timeout, or less for an SLO-bound request: the time left to start it
        within its TTFT. A bound request that would not get even that is refused now (503)."""
        timeout = self.settings.queue_timeout_s
        if not bound or prediction is None or ask.slo.ttft_ms is None:
            return timeout
        slack_s = (ask.slo.ttft_ms - prediction.ttft_ms) / 1000
        wait_s = self._wait_s(waiter, ask, prediction)
        if wait_s > slack_s:
            self._queue.remove(waiter)
            self._refuse(
                503,
                "saturated",
                f"the pool is saturated: this request would wait about {wait_s:.1f} s and miss "
                f"its time to first token of {ask.slo.ttft_ms:g} ms",
                wait_s,
            )
        return min(timeout, slack_s)

    def _abandon(self, waiter: Waiter, future: asyncio.Future[Ticket]) -> None:
        """A waiter leaves (timeout, cancellation): out of the queue, or, if it was admitted
        in the same instant, its rows given back."""
        self._futures.pop(waiter, None)
        self._asks.pop(waiter, None)
        if future.done() and not future.cancelled() and future.exception() is None:
            self.release(future.result(), None, None)
        else:
            self._queue.remove(waiter)
            future.cancel()
        self.metrics.queued.set(len(self._queue))

    def _serve_queue(self) -> None:
        """Admits queued requests, in the queue's order, while there is room; one that can
        no longer meet its TTFT is refused instead of taking the room from one that can."""
        over_share: set[str] = set()  # tenants passed over this time
        while (waiter := self._queue.peek(over_share)) is not None:
            ask = self._asks[waiter]
            if not self._has_room(ask):
                break
            if self._over_share(ask):
                over_share.add(ask.tenant)
                continue
            self._queue.pop(over_share)
            future = self._futures.pop(waiter)
            del self._asks[waiter]
            favoured = self._is_favoured(ask)
            model = self._model_prediction(ask, favoured)
            late = self._lateness_ms(ask, waiter, model, favoured)
            if late is None:
                future.set_result(self._ticket(ask, waiter.enqueued_at, True, model, favoured))
            else:
                self.metrics.refused("slo_deadline")
                future.set_exception(self._deadline_refusal(waiter, late))
        self.metrics.queued.set(len(self._queue))

    def _lateness_ms(
        self, ask: AdmissionAsk, waiter: Waiter, model: Prediction | None, favoured: bool
    ) -> float | None:
        """By how much a bound request's TTFT would miss if dispatched now (its wait so far
        and the predicted service); None when it would not, or nothing binds it."""
        if not self._is_bound(ask) or ask.slo.ttft_ms is None or model is None:
            return None
        waited_ms = (time.monotonic() - waiter.enqueued_at) * 1000
        late = waited_ms + self._judged(model, favoured, True).ttft_ms - ask.slo.ttft_ms
        return late if late > 0 else None

    def _deadline_refusal(self, waiter: Waiter, late_ms: float) -> AdmissionRefused:
        waited = time.monotonic() - waiter.enqueued_at
        return AdmissionRefused(
            408,
            "slo_deadline",
            f"the request waited {waited:.1f} s in the queue and would now miss its time to "
            f"first token by about {late_ms:.0f} ms",
            max(waited, 1.0),
        )

    def _ensure_ticking(self) -> None:
        if self._ticker is None or self._ticker.done():
            self._ticker = asyncio.create_task(self._tick(), name="admission-queue")

    async def _tick(self) -> None:
        """While requests wait: pods join, answer polls with more room, or come back."""
        while self._queue:
            await asyncio.sleep(QUEUE_TICK_SECONDS)
            self._serve_queue()

    async def close(self) -> None:
        if self._ticker is not None:
            self._ticker.cancel()

    # ---- room, predictions, waits -----------------------------------------------------------

    def _is_saturated(self, ask: AdmissionAsk) -> bool:
        """Whether admitting `ask` would take pod time another request could meet its SLO in:
        a queue, no row free, or asked for well past what the pool finishes."""
        return bool(self._queue) or not self._has_room(ask) or self._is_overloaded()

    def _is_overloaded(self) -> bool:
        """Asked for well past what the pool finishes (`LoadWindow.is_overloaded`): the rows
        may have room while the prompts queue on the pods (a CPU prefill pod is the
        bottleneck there)."""
        return self._load.is_overloaded(time.monotonic())

    def _is_idle(self) -> bool:
        """Nothing in flight through this gateway and nothing queued."""
        return self.num_rows_in_flight == 0 and not self._queue

    def _has_room(self, ask: AdmissionAsk) -> bool:
        """Rows for `ask` under the pool's cap; a request larger than the whole cap still goes
        when nothing else is in flight, or it would wait for ever."""
        if self.num_rows_in_flight == 0:
            return bool(self.decode_pool.available())
        return self.num_rows_in_flight + ask.num_sequences <= self.row_capacity()

    def _over_share(self, ask: AdmissionAsk) -> bool:
        """Whether `ask` would take its tenant past its weighted share of the rows and leave
        fewer free rows than there are other tenants below their share that asked lately:
        one row is kept for each of them, so their next request starts at once instead of
        waiting behind the backlog for a row to free up (a flood cannot take a quiet tenant's
        latency, at the cost of a row or so idle while they are quiet)."""
        others = self._other_active_tenants(ask.tenant)
        if not others or self._within_share(ask, others):
            return False
        capacity = self.row_capacity()
        kept = sum(self._tenant_rows[t] < self._share(t, ask.tenant, others) for t in others)
        free_after = capacity - self.num_rows_in_flight - ask.num_sequences
        return free_after < kept

    def _is_favoured(self, ask: AdmissionAsk) -> bool:
        """Whether `ask` keeps its tenant within its weighted share of the rows while other
        tenants asked lately, and its tenant neither has anything queued here nor asked for
        more than its share of what the active tenants asked (demand.py): the pods then
        compute it ahead of their work (`pod_priority`), so a flood's prompts queued on the
        pods do not stand before a quiet tenant's. A tenant with a backlog, or one whose
        excess is refused, asks for more than its share; each of its admissions was within
        its share of the rows all the same (the queue, or the refusals, saw to that), and
        favouring them too (2026-12-03, an EPYC: most of a 10x flood's admissions) put the
        flood's prompts level with the quiet tenant's again."""
        others = self._other_active_tenants(ask.tenant)
        if not others or self._queue.has_queued(ask.tenant):
            return False
        if self._demand.exceeds_share(ask.tenant, others, self._weight_of, time.monotonic()):
            return False
        return self._within_share(ask, others)

    def _other_active_tenants(self, tenant: str) -> list[str]:
        now = time.monotonic()
        return [
            other
            for other, asked in self._last_asked.items()
            if other != tenant
            and (now - asked < ACTIVE_TENANT_SECONDS or self._tenant_rows[other] > 0)
        ]

    def _within_share(self, ask: AdmissionAsk, others: list[str]) -> bool:
        rows = self._tenant_rows[ask.tenant] + ask.num_sequences
        return rows <= self._share(ask.tenant, ask.tenant, others)

    def _share(self, tenant: str, asking: str, others: list[str]) -> float:
        """`tenant`'s weighted share of the rows among `asking` and `others`."""
        total = sum(self._weight_of(t) for t in [asking, *others])
        return self.row_capacity() * self._weight_of(tenant) / total

    def row_capacity(self) -> int:
        return sum(self._pod_rows(pod) for pod in self.decode_pool.available())

    def _pod_rows(self, pod: Pod) -> int:
        """The pod's row cap by its fitted costs; with a default TPOT objective, the limit
        its measured token gaps steer (feedback.py), which starts at that cap. A window of
        gaps also calibrates the TPOT model, objective or not (requests may bring their own)."""
        tpot = self.settings.slo.tpot_ms
        cap = row_cap(pod, tpot, self.settings.fallback_row_cap)
        if pod.stats is None:
            return cap
        measured_ms = pod.token_gaps.take(time.monotonic())
        rows_in_use = pod.num_queued
        if measured_ms is not None:
            self._calibrate_tpot(pod, measured_ms, rows_in_use)
        if tpot is None:
            return cap
        limit = self._row_limits.get(pod.address)
        if limit is None:
            ceiling = pod.stats.max_num_seqs or self.settings.fallback_row_cap
            start = float(min(cap, INITIAL_ROWS))
            limit = self._row_limits[pod.address] = RowLimit(start, min(cap, ceiling))
        if measured_ms is not None:
            limit.update(measured_ms, tpot * TPOT_TARGET_SHARE, rows_in_use)
            self.metrics.row_limit.labels(pod.address).set(limit.rows)
        return limit.rows

    def _calibrate_tpot(self, pod: Pod, measured_ms: float, rows_in_use: int) -> None:
        """The TPOT model learns from the gaps the pod's streams showed against its step at
        the rows it ran then, not from each request's mean gap against the rows it found when
        admitted: under a backlog a pod fills up after every admission, and that bias would
        grow the factor until requests the row limit keeps within the SLO were refused."""
        modelled = modelled_gap_ms(pod, rows_in_use)
        if modelled is not None:
            self._tpot_calibration.observe(measured_ms, modelled)

    def _model_prediction(self, ask: AdmissionAsk, favoured: bool) -> Prediction | None:
        """`favoured`: only the favoured prompts queued on the pods stand before it."""
        prefill_pods = self.prefill_pool.available() if self.prefill_pool is not None else []
        limits = {address: limit.rows for address, limit in self._row_limits.items()}
        return best_prediction(
            self.decode_pool.available(),
            prefill_pods,
            ask.num_prompt_tokens,
            ask.max_tokens,
            favoured,
            limits,
        )

    def _judged(self, model: Prediction, favoured: bool, saturated: bool) -> Prediction:
        """What a request's SLO is judged against. In a saturated pool (a queue, no room, or
        asked for well past what it finishes: `_is_overloaded`), its TTFT at the upper end of
        how far recent ones were off (`Calibration.upper_factor_at`): each request admitted
        there takes pod time (a row, a prefill) from another that could meet its SLO, so the
        admitted must meet theirs nearly always, not half the time at the margin (judged at
        the middle, 10-19% of them missed on an EPYC at 2-3x saturation). With time to spare
        it is judged at the middle: a refusal there spares no one (at the upper end, 6 of 20
        requests at half saturation were refused). A favoured request (its tenant within its
        share, without a backlog) is judged at the middle too: the pod time it takes is its
        tenant's share, not another's (judged at the upper end beside a 10x flood, 19 of a
        quiet tenant's 27 were refused). Its TPOT as calibrated (the row limits hold the
        default one)."""
        calibrated = self._calibrated(model, favoured)
        if not saturated or favoured:
            return calibrated
        upper = self._ttft_calibrations[favoured].upper_factor_at(time.monotonic())
        return Prediction(model.ttft_ms * upper, calibrated.tpot_ms)

    def _calibrated(self, model: Prediction, favoured: bool) -> Prediction:
        """The cost model's prediction, corrected by how far it was off lately."""
        return Prediction(
            model.ttft_ms * self._ttft_calibrations[favoured].factor,
            model.tpot_ms * self._tpot_calibration.factor,
        )

    def _wait_s(self, waiter: Waiter, ask: AdmissionAsk, prediction: Prediction | None) -> float:
        """About how long `waiter` will queue: one request finishes for each one ahead of it,
        at the rate requests finished lately (or, with too few finished, the rate the pool's
        rows would turn over by the cost model)."""
        rate = self._completion_rate() or self._modelled_rate(ask, prediction)
        if rate <= 0:
            return 0.0
        return (self._queue.ahead_of(waiter, self._passed_over_for(ask)) + 1) / rate

    def _passed_over_for(self, ask: AdmissionAsk) -> set[str]:
        """The tenants whose queued requests a row freed for `ask` would not go to: while its
        tenant is within its share, the others at or past theirs (`_over_share` keeps a row
        from them)."""
        others = self._other_active_tenants(ask.tenant)
        if not others or not self._within_share(ask, others):
            return set()
        return {t for t in others if self._tenant_rows[t] >= self._share(t, ask.tenant, others)}

    def _completion_rate(self) -> float:
        return self._load.completion_rate(time.monotonic())

    def _modelled_rate(self, ask: AdmissionAsk, prediction: Prediction | None) -> float:
        """Requests per second the pool finishes if every row serves one like `ask`."""
        if prediction is None:
            return 0.0
        return self.row_capacity() / self._service_seconds(prediction, ask)

    @staticmethod
    def _service_seconds(prediction: Prediction, ask: AdmissionAsk) -> float:
        return (prediction.ttft_ms + prediction.tpot_ms * max(ask.max_tokens - 1, 0)) / 1000
