"""Admission control's parts on their own (issue 35): the fair queue's order, bounds and
removal; the predictions and row caps from a pod's reported stats; the SLO's sources. The
behaviour through real processes is tests/test_admission.py's."""

from __future__ import annotations

import random

import pytest

from splitserve.gateway.admission.fair_queue import FairQueue, QueueFull, Waiter
from splitserve.gateway.admission.feedback import (
    CALIBRATION_HALF_LIFE_S,
    CALIBRATION_HOLD_S,
    Calibration,
    RowLimit,
    TokenGaps,
)
from splitserve.gateway.admission.predict import best_prediction, row_cap
from splitserve.gateway.admission.slo import Slo, requested_slo
from splitserve.gateway.auth.keys import KeyRing
from splitserve.gateway.errors import RequestError
from splitserve.gateway.routing.pods import Pod
from splitserve.v1 import worker_pb2

# ---- the fair queue --------------------------------------------------------------------------


def _push(queue: FairQueue, tenant: str, count: int, priority: int = 0) -> list[Waiter]:
    waiters = [Waiter(tenant, priority, cost=100.0) for _ in range(count)]
    for waiter in waiters:
        queue.push(waiter)
    return waiters


def _drain(queue: FairQueue) -> list[str]:
    order = []
    while (waiter := queue.pop()) is not None:
        order.append(waiter.tenant)
    return order


def test_a_flooding_tenant_only_lengthens_its_own_queue():
    queue = FairQueue(max_per_tenant=100)
    _push(queue, "flood", 20)
    _push(queue, "quiet", 2)
    order = _drain(queue)
    assert order[:4] == ["flood", "quiet", "flood", "quiet"]
    assert order[4:] == ["flood"] * 18


def test_strict_priority_comes_before_fair_share():
    queue = FairQueue(max_per_tenant=100)
    _push(queue, "a", 3, priority=5)
    _push(queue, "b", 2, priority=0)
    assert [w.priority for w in iter(queue.pop, None)] == [0, 0, 5, 5, 5]


def test_weights_set_the_shares():
    weights = {"heavy": 2.0, "light": 1.0}
    queue = FairQueue(max_per_tenant=100, weight_of=weights.__getitem__)
    _push(queue, "heavy", 30)
    _push(queue, "light", 30)
    first = _drain(queue)[:30]
    assert first.count("heavy") == 20 and first.count("light") == 10


def test_an_idle_tenant_banks_no_credit():
    """A tenant that was idle while another was served alone comes back at the clock the last
    served request started at: served next, then they alternate; it does not get its idle
    time's worth of turns in a row."""
    queue = FairQueue(max_per_tenant=100)
    _push(queue, "busy", 10)
    for _ in range(5):
        queue.pop()  # "busy" served alone: its clock is ahead of an idle tenant's
    _push(queue, "late", 5)
    assert _drain(queue)[:6] == ["late", "busy"] * 3


def test_a_tenant_under_its_share_is_served_next_beside_a_backlog():
    """One request at a time from a light tenant, a standing backlog from a heavy one: each
    light request is the next one served, whenever it arrives."""
    queue = FairQueue(max_per_tenant=100)
    _push(queue, "heavy", 30)
    for _ in range(5):
        queue.pop()
        queue.pop()
        _push(queue, "light", 1)
        assert queue.pop().tenant == "light"


def test_the_bound_is_per_tenant_and_priority():
    queue = FairQueue(max_per_tenant=2)
    _push(queue, "a", 2)
    with pytest.raises(QueueFull):
        _push(queue, "a", 1)
    _push(queue, "b", 2)  # another tenant has its own room
    _push(queue, "a", 1, priority=3)  # and so has another priority
    assert len(queue) == 5


def test_removed_waiters_are_never_served():
    queue = FairQueue(max_per_tenant=10)
    first, second, third = _push(queue, "a", 3)
    assert queue.remove(second)
    assert not queue.remove(second)
    assert len(queue) == 2
    assert [queue.pop(), queue.pop(), queue.pop()] == [first, third, None]


def test_ahead_of_counts_fair_share_not_arrival_order():
    queue = FairQueue(max_per_tenant=100)
    _push(queue, "flood", 50)
    (quiet,) = _push(queue, "quiet", 1)
    assert queue.ahead_of(quiet) == 1  # one of the flood's, then its own turn
    (urgent,) = _push(queue, "other", 1, priority=-1)
    assert queue.ahead_of(urgent) == 0
    assert queue.ahead_of(quiet) == 2
    # The flood over its share of the rows is skipped for a quiet tenant under its own.
    assert queue.ahead_of(quiet, passed_over={"flood"}) == 1


def test_a_tenant_back_from_idling_has_none_of_a_served_backlog_ahead():
    """Once the flood's requests are being served, a quiet tenant's next request starts at the
    virtual time, behind the flood's clock: it is next (the wait the controller predicts from
    this is one completion, not two)."""
    queue = FairQueue(max_per_tenant=100)
    _push(queue, "flood", 50)
    for _ in range(5):
        queue.pop()
    (quiet,) = _push(queue, "quiet", 1)
    assert queue.ahead_of(quiet) == 0
    assert queue.pop() is quiet


@pytest.mark.parametrize("seed", range(20))
def test_ahead_of_is_the_position_pop_serves_it_at(seed):
    """Random tenants, weights, costs, priorities and pops between pushes: for every queued
    request, ahead_of counts exactly the requests `pop` then serves before it."""
    rng = random.Random(seed)
    weights = {tenant: rng.choice([0.5, 1.0, 2.0, 3.0]) for tenant in "abcd"}
    queue = FairQueue(max_per_tenant=100, weight_of=weights.__getitem__)
    for step in range(40):
        if rng.random() < 0.25:
            queue.pop()
            continue
        tenant = rng.choice("abcd")
        priority = rng.choice([0, 0, 0, 1])
        queue.push(Waiter(tenant, priority, cost=rng.uniform(10, 500), enqueued_at=step))
    queued = [w for level in queue._levels.values() for q in level.queues.values() for w in q]
    expected = {waiter: queue.ahead_of(waiter) for waiter in queued}
    served = []
    while (waiter := queue.pop()) is not None:
        served.append(waiter)
    assert {waiter: served.index(waiter) for waiter in queued} == expected


# ---- predictions from a pod's stats ----------------------------------------------------------


def _pod(address: str, **stats) -> Pod:
    fields = dict(model="m", max_num_seqs=64, max_num_batched_tokens=512)
    fields.update(stats)
    return Pod(address, stub=None, stats=worker_pb2.WorkerStats(**fields))  # type: ignore[arg-type]


COSTS = dict(step_base_ms=20.0, step_row_ms=2.0, step_prefill_token_ms=0.5)


def test_a_pod_without_fitted_costs_predicts_nothing():
    assert best_prediction([_pod("d:1")], [], 100, 10) is None


def test_colocated_prediction_counts_the_queue_and_the_rows():
    idle = _pod("d:1", **COSTS)
    busy = _pod("d:2", **COSTS, num_running=10, num_waiting_prompt_tokens=1000)
    alone = best_prediction([idle], [], 100, 10)
    assert alone is not None
    # 100 tokens in one step: 20 + 0.5 * 100, then a decode step of one row: 20 + 2.
    assert alone.ttft_ms == pytest.approx(70 + 22)
    loaded = best_prediction([busy], [], 100, 10)
    assert loaded is not None and loaded.ttft_ms > alone.ttft_ms + 500
    assert loaded.tpot_ms > alone.tpot_ms
    both = best_prediction([busy, idle], [], 100, 10)
    assert both == alone  # the best pod's


def test_disaggregated_prediction_takes_the_prefill_pods_queue():
    decode = _pod("d:1", **COSTS, num_running=4)
    prefill = _pod("p:1", **COSTS, num_waiting_prompt_tokens=400)
    predicted = best_prediction([decode], [prefill], 100, 10)
    assert predicted is not None
    # 500 tokens on the prefill pod (one step: 20 + 250), then a step of 5 rows (20 + 10).
    assert predicted.ttft_ms == pytest.approx(270 + 30)
    assert predicted.tpot_ms == pytest.approx(30)


def test_a_calls_prompt_awaits_on_the_prefill_pod_it_names_until_taken_back():
    """A prefill pod's stats lag its backlog by a poll and by the step it is in (seconds on a
    slow CPU): the gateway's own calls naming it are the fresher floor, as on a decode pod."""
    from splitserve.gateway.generation import SequenceCall, _count_awaiting, _prefilling_pods
    from splitserve.gateway.routing.scoring import RoutingDecision

    decode, prefill = _pod("d:1", **COSTS, num_running=4), _pod("p:1", **COSTS)
    decision = RoutingDecision("d", "d:1", "p", "p:1", "cache_aware", {}, 0)
    request = worker_pb2.DecodeRequest(prompt_token_ids=list(range(400)))
    call = SequenceCall(0, 0, request, decode, decision, prefill_pod=prefill)
    before = best_prediction([decode], [prefill], 100, 10)
    awaiting_on = _prefilling_pods(call)
    _count_awaiting(awaiting_on, False, 400)
    call.prefill_pod = None  # a migration names none later: the count still comes back off
    during = best_prediction([decode], [prefill], 100, 10)
    assert before is not None and during is not None
    # 400 tokens more ahead on the prefill pod: 0.5 ms each, in the same one step.
    assert during.ttft_ms == pytest.approx(before.ttft_ms + 200)
    _count_awaiting(awaiting_on, False, -400)
    assert (decode.awaiting_prompt_tokens, prefill.awaiting_prompt_tokens) == (0, 0)
    assert best_prediction([decode], [prefill], 100, 10) == before


def test_row_cap_keeps_a_step_within_the_tpot_objective():
    pod = _pod("d:1", **COSTS)
    assert row_cap(pod, None, 8) == 64  # no objective: the pod's own maximum
    assert row_cap(pod, 100.0, 8) == 30  # (0.8 * 100 - 20) / 2
    assert row_cap(pod, 10.0, 8) == 1  # never below one row
    assert row_cap(_pod("d:2", max_num_seqs=0), 100.0, 8) == 8  # reports nothing: fallback


# ---- where an SLO comes from -----------------------------------------------------------------


def test_headers_tenant_and_default_layer_in_that_order():
    asked = requested_slo({"x-slo-ttft-ms": "500"})
    tenant = Slo(ttft_ms=2000, tpot_ms=150)
    default = Slo(ttft_ms=3000, tpot_ms=200)
    assert asked.over(tenant).over(default) == Slo(500, 150)
    assert requested_slo({}).over(Slo()).over(default) == default
    assert not requested_slo({}).binds


@pytest.mark.parametrize("value", ["0", "-5", "nan", "fast", "1e12"])
def test_a_bad_slo_header_is_a_400_naming_it(value):
    with pytest.raises(RequestError) as caught:
        requested_slo({"x-slo-tpot-ms": value})
    assert caught.value.param == "x-slo-tpot-ms"


def test_the_key_file_gives_a_tenant_its_slo_and_weight():
    keys = KeyRing.from_entries(
        [
            {"key": "sk-gold-000001", "tenant": "gold", "slo_ttft_ms": 800, "weight": 3},
            {"key": "sk-gold-000002", "tenant": "gold"},
            {"key": "sk-free-000001", "tenant": "free"},
        ]
    )
    gold = keys.lookup("sk-gold-000002")
    assert gold is not None and gold.slo == Slo(ttft_ms=800)
    assert keys.weight_of("gold") == 3 and keys.weight_of("free") == 1
    with pytest.raises(ValueError, match="weight"):
        KeyRing.from_entries([{"key": "sk-x-00000001", "tenant": "x", "weight": 0}])
    with pytest.raises(ValueError, match="slo_tpot_ms"):
        KeyRing.from_entries([{"key": "sk-x-00000001", "tenant": "x", "slo_tpot_ms": "soon"}])


# ---- what admission learns from the streams -------------------------------------------------


def test_token_gaps_report_a_window_once_it_is_old_and_full_enough():
    gaps = TokenGaps(started=0.0)
    gaps.add(0.5, 5)
    assert gaps.take(now=0.5) is None  # too young
    assert gaps.take(now=1.0) is None  # old enough, too few tokens: dropped, starts over
    gaps.add(1.2, 12)
    assert gaps.take(now=2.0) == pytest.approx(100.0)
    assert gaps.num_tokens == 0


def test_row_limit_shrinks_past_the_target_and_grows_only_when_it_binds():
    limit = RowLimit(limit=16.0, ceiling=32)
    limit.update(measured_ms=400.0, target_ms=100.0, rows_in_use=16)
    assert limit.rows == 8  # halved at most per window
    limit = RowLimit(limit=8.0, ceiling=32)
    limit.update(measured_ms=50.0, target_ms=100.0, rows_in_use=3)
    assert limit.rows == 8  # below target, but the limit does not bind: it stays
    for _ in range(20):
        limit.update(measured_ms=50.0, target_ms=100.0, rows_in_use=limit.rows)
    assert limit.rows == 32  # grows while it binds, never past the pod's own maximum
    for _ in range(20):
        limit.update(measured_ms=1000.0, target_ms=100.0, rows_in_use=limit.rows)
    assert limit.rows == 1  # never below one row


def test_calibration_learns_a_steady_bias_and_ignores_nonsense():
    calibration = Calibration()
    assert calibration.factor == 1.0
    cold = Calibration()
    cold.observe(measured=1000.0, predicted=100.0)  # one cold request does not set it alone
    assert 1.0 < cold.factor < 2.0
    for _ in range(30):
        calibration.observe(measured=300.0, predicted=100.0)
    assert calibration.factor == pytest.approx(3.0, rel=0.01)
    calibration.observe(measured=0.0, predicted=100.0)  # no measurement: nothing learnt
    assert calibration.factor == pytest.approx(3.0, rel=0.01)
    for _ in range(60):
        calibration.observe(measured=1e9, predicted=1.0)  # clamped
    assert calibration.factor == pytest.approx(10.0, rel=0.01)


def test_a_calibration_fades_toward_one_while_nothing_is_observed():
    # Learnt in an overload (first tokens 5x late), then nothing admitted: it must not keep
    # refusing on an idle pool for ever.
    calibration = Calibration()
    for i in range(40):
        calibration.observe(measured=500.0, predicted=100.0, now=float(i) * 2.0)
    last = 78.0
    # Observed every 2 s: learnt in full, and held while observations keep coming.
    assert calibration.factor_at(last) == pytest.approx(5.0, rel=0.02)
    assert calibration.factor_at(last + CALIBRATION_HOLD_S) == calibration.factor_at(last)
    halved = calibration.factor_at(last + CALIBRATION_HOLD_S + CALIBRATION_HALF_LIFE_S)
    assert halved == pytest.approx(5.0**0.5, rel=0.02)
    idle = last + CALIBRATION_HOLD_S + 6 * CALIBRATION_HALF_LIFE_S
    assert calibration.factor_at(idle) < 1.03
    # What it sees next builds on the faded factor, not on the stale one.
    calibration.observe(measured=100.0, predicted=100.0, now=idle)
    assert calibration.factor_at(idle) < 1.03


def test_a_ttft_is_judged_at_the_upper_end_of_how_far_recent_ones_were_off():
    """Ratios spread 0.5x to 1.5x around a middle of 1: the running factor stays near 1, the
    upper one is their 90th percentile; with too few seen, or all alike, the two agree."""
    spread = Calibration()
    for ratio in [0.5, 0.75, 1.0, 1.25, 1.5] * 6:
        spread.observe(measured=100.0 * ratio, predicted=100.0, now=0.0)
    assert 0.85 < spread.factor_at(0.0) < 1.15
    assert spread.upper_factor_at(0.0) == pytest.approx(1.5)
    steady = Calibration()
    for _ in range(30):
        steady.observe(measured=200.0, predicted=100.0, now=0.0)
    assert steady.upper_factor_at(0.0) == pytest.approx(steady.factor_at(0.0), rel=0.05)
    few = Calibration()
    for ratio in (0.5, 1.5, 1.5):
        few.observe(measured=100.0 * ratio, predicted=100.0, now=0.0)
    assert few.upper_factor_at(0.0) == few.factor_at(0.0)
    # Stale, the upper end fades toward 1 as the middle does.
    assert spread.upper_factor_at(100.0) < 1.01


def test_a_saturated_pool_judges_a_ttft_at_the_upper_end_and_one_with_room_at_the_middle():
    """First tokens spread 0.5x-1.5x the model. With a row free, a request whose objective is
    1.2x the model (inside by the middle of the ratios) is admitted: refusing it spares no
    one. With no row free it is refused (503): inside only by the middle, it would take the
    next row from a request that can meet its objective surely. One at 2x the model queues."""
    import asyncio

    from splitserve.gateway.admission.controller import AdmissionRefused

    async def run():
        controller = _controller(max_rows=2)
        for ratio in [0.5, 0.75, 1.0, 1.25, 1.5] * 6:
            ticket = await controller.admit(_ask("a"))
            ttft_s = ticket.model.ttft_ms * ratio / 1000
            controller.first_token(ticket, ttft_s)
            controller.release(ticket, ttft_s, 0.02)  # 30 just finished: no wait to speak of
        busy = await controller.admit(_ask("a"))  # one row of two in flight
        model_ms = busy.model.ttft_ms
        with_room = await controller.admit(_ask("a", ttft_ms=1.2 * model_ms))
        with pytest.raises(AdmissionRefused) as saturated:
            await controller.admit(_ask("a", ttft_ms=1.2 * model_ms))
        roomy = asyncio.create_task(controller.admit(_ask("a", ttft_ms=2 * model_ms)))
        await asyncio.sleep(0)
        queued = controller.num_queued
        roomy.cancel()
        await controller.close()
        return with_room, saturated.value, queued

    with_room, refusal, queued = asyncio.run(run())
    assert with_room.model is not None
    assert refusal.http_status == 503 and refusal.reason == "saturated"
    assert queued == 1


def test_a_pool_asked_for_well_past_what_it_finishes_judges_at_the_upper_end_with_room():
    """Rows free, but 30 asked in the window and none finished (prompts queue on the pods):
    the 1.2x request a pool with time to spare admits is refused (429)."""
    import asyncio

    from splitserve.gateway.admission.controller import AdmissionRefused

    async def run():
        controller = _controller(max_rows=8)
        for ratio in [0.5, 0.75, 1.0, 1.25, 1.5] * 6:
            ticket = await controller.admit(_ask("a"))
            controller.first_token(ticket, ticket.model.ttft_ms * ratio / 1000)
            controller.release(ticket, None, None)  # nothing counted as finished
        busy = await controller.admit(_ask("a"))
        with pytest.raises(AdmissionRefused) as overloaded:
            await controller.admit(_ask("a", ttft_ms=1.2 * busy.model.ttft_ms))
        await controller.close()
        return overloaded.value

    refusal = asyncio.run(run())
    assert refusal.http_status == 429 and refusal.reason == "slo"


def test_a_favoured_request_is_judged_at_the_middle_in_an_overloaded_pool():
    """The pod time a tenant within its share takes is its own share: beside another tenant,
    30 asked and none finished (overloaded), its first tokens spread 0.5x-1.5x the model, a
    request of it with an objective 1.2x the model is admitted, where the same request
    from a lone tenant (not favoured) is refused (the test above)."""
    import asyncio

    async def run():
        controller = _controller(max_rows=8)
        other = await controller.admit(_ask("other"))  # another tenant with a row in flight
        for ratio in [0.5, 0.75, 1.0, 1.25, 1.5] * 6:
            # It asks as often as the quiet tenant does: neither asks past its share.
            controller.release(await controller.admit(_ask("other")), None, None)
            ticket = await controller.admit(_ask("quiet"))
            assert ticket.favoured
            controller.first_token(ticket, ticket.model.ttft_ms * ratio / 1000)
            controller.release(ticket, None, None)  # nothing counted as finished
        probe = await controller.admit(_ask("quiet"))
        admitted = await controller.admit(_ask("quiet", ttft_ms=1.2 * probe.model.ttft_ms))
        await controller.close()
        return other, admitted

    _, admitted = asyncio.run(run())
    assert admitted.favoured and admitted.model is not None


# ---- favoured requests: a tenant within its share goes first on the pods ---------------------


def test_pod_priority_keeps_the_clients_order_and_puts_favoured_first_within_it():
    from splitserve.gateway.admission.controller import pod_priority

    order = sorted(
        ((p, f) for p in (-1, 0, 3) for f in (False, True)), key=lambda pf: pod_priority(*pf)
    )
    assert order == [(-1, True), (-1, False), (0, True), (0, False), (3, True), (3, False)]


def test_a_favoured_prediction_waits_behind_favoured_prompts_only():
    pod = _pod("d:1", **COSTS, num_running=3, num_waiting_prompt_tokens=2000)
    pod.awaiting_favoured_prompt_tokens = 100
    plain = best_prediction([pod], [], 100, 10)
    favoured = best_prediction([pod], [], 100, 10, favoured=True)
    assert plain is not None and favoured is not None
    # Its prefill: 200 tokens in one step beside 3 rows (20 + 6 + 100), then a step of 4 rows.
    assert favoured.ttft_ms == pytest.approx(126 + 28)
    assert plain.ttft_ms > favoured.ttft_ms + 900  # 2100 tokens ahead of it otherwise
    assert favoured.tpot_ms == plain.tpot_ms  # its steps still interleave every prompt


def _controller(max_rows: int, default_slo: Slo | None = None):
    from prometheus_client import CollectorRegistry

    from splitserve.gateway.admission.controller import AdmissionController, AdmissionSettings
    from splitserve.gateway.admission.metrics import AdmissionMetrics
    from splitserve.gateway.routing.pods import PodPool

    pool = PodPool("decode", [], "m")
    pod = _pod("d:1", **COSTS, max_num_seqs=max_rows)
    pod.is_serving_model = True
    pool.pods.append(pod)
    metrics = AdmissionMetrics(CollectorRegistry())
    settings = AdmissionSettings(slo=default_slo or Slo())
    return AdmissionController(settings, pool, None, metrics)


def _ask(tenant: str, ttft_ms: float | None = None, tpot_ms: float | None = None):
    from splitserve.gateway.admission.controller import AdmissionAsk

    return AdmissionAsk(f"{tenant}-req", tenant, 0, Slo(ttft_ms, tpot_ms), 1, 100, 10)


def test_a_quiet_tenant_takes_its_kept_row_at_once_beside_a_flood_and_is_favoured():
    """Four rows, two tenants: the flood gets its share and a row past it, the last row is
    kept for the quiet tenant, the rest of the flood queues. A quiet request with a TTFT
    objective tighter than any queue wait is admitted at once into the kept row (it is served
    before its wait is predicted), favoured on the pods; of the flood's, only the first, asked
    while it had asked no more than the quiet tenant (then it asked past its share)."""
    import asyncio

    async def run() -> tuple[list[bool], bool, int]:
        controller = _controller(max_rows=4)
        controller.release(await controller.admit(_ask("quiet")), None, None)  # it asked
        flood = [await controller.admit(_ask("flood")) for _ in range(3)]
        queued = [asyncio.create_task(controller.admit(_ask("flood"))) for _ in range(2)]
        await asyncio.sleep(0)
        quiet = await asyncio.wait_for(controller.admit(_ask("quiet", ttft_ms=150.0)), 1.0)
        waiting = controller.num_queued
        for task in queued:
            task.cancel()
        await controller.close()
        return [ticket.favoured for ticket in flood], quiet.favoured, waiting

    flood_favoured, quiet_favoured, waiting = asyncio.run(run())
    assert flood_favoured == [True, False, False]
    assert quiet_favoured
    assert waiting == 2  # the flood's two still queue


def test_a_tenant_asking_past_its_share_is_not_favoured_though_its_excess_was_refused():
    """A flood whose excess admission refuses has no backlog, and each admitted request of it
    is within its share of the rows: its asks, ten to the quiet tenant's one, are what say it
    wants more than its share. Its admission goes to the pods unfavoured, the quiet tenant's
    favoured."""
    import asyncio

    from splitserve.gateway.admission.controller import AdmissionRefused

    async def run() -> tuple[bool, bool]:
        controller = _controller(max_rows=8)
        await controller.admit(_ask("quiet"))  # a row in flight: the pool is not idle
        for _ in range(9):  # refused at once, as a prediction past its SLO would be
            with pytest.raises(AdmissionRefused):
                await controller.admit(_ask("flood", ttft_ms=0.001))
        flood = await controller.admit(_ask("flood"))
        quiet = await controller.admit(_ask("quiet"))
        await controller.close()
        return flood.favoured, quiet.favoured

    flood_favoured, quiet_favoured = asyncio.run(run())
    assert not flood_favoured and quiet_favoured


def test_ask_demand_fades_so_a_tenant_that_stopped_flooding_is_within_its_share_again():
    from splitserve.gateway.admission.demand import ASK_HALF_LIFE_S, AskDemand

    demand, alike = AskDemand(), lambda tenant: 1.0
    for _ in range(10):
        demand.note("flood", 0.0)
    demand.note("quiet", 0.0)
    assert demand.exceeds_share("flood", ["quiet"], alike, 0.0)
    assert not demand.exceeds_share("quiet", ["flood"], alike, 0.0)
    assert demand.asked("flood", ASK_HALF_LIFE_S) == pytest.approx(5.0)
    demand.note("quiet", 6 * ASK_HALF_LIFE_S)  # the flood's ten asks have faded to 0.16
    assert not demand.exceeds_share("flood", ["quiet"], alike, 6 * ASK_HALF_LIFE_S)
    # Weights: a tenant of weight 3 may ask three times another's before it exceeds.
    heavy = {"big": 3.0, "small": 1.0}.__getitem__
    for _ in range(3):
        demand.note("big", 7 * ASK_HALF_LIFE_S)
    demand.note("small", 7 * ASK_HALF_LIFE_S)
    assert not demand.exceeds_share("big", ["small"], heavy, 7 * ASK_HALF_LIFE_S)
    assert demand.exceeds_share("big", ["small"], alike, 7 * ASK_HALF_LIFE_S)
    # An ask for n sequences counts as n asks.
    demand.note("wide", 8 * ASK_HALF_LIFE_S, num_sequences=4)
    assert demand.asked("wide", 8 * ASK_HALF_LIFE_S) == pytest.approx(4.0)


def test_a_tenant_with_a_backlog_is_not_favoured_even_within_its_share():
    """The queue lets a flooding tenant in exactly up to its share, so each admission from its
    backlog is within it: favoured too, its prompts would stand level with a quiet tenant's on
    the pods again. Only once its backlog is gone is it favoured."""
    import asyncio

    async def run() -> list[bool]:
        controller = _controller(max_rows=2)
        for _ in range(3):  # it asked as often as the flood will: only the backlog differs
            controller.release(await controller.admit(_ask("quiet")), None, None)
        first = await controller.admit(_ask("flood"))  # its share: one row of two
        backlog = [asyncio.create_task(controller.admit(_ask("flood"))) for _ in range(2)]
        await asyncio.sleep(0)
        assert controller.num_queued == 2  # the other row is kept for the quiet tenant
        controller.release(first, None, None)
        second = await asyncio.wait_for(backlog[0], 1.0)  # one more still queued behind it
        controller.release(second, None, None)
        third = await asyncio.wait_for(backlog[1], 1.0)  # nothing behind it
        await controller.close()
        return [first.favoured, second.favoured, third.favoured]

    assert asyncio.run(run()) == [True, False, True]


# ---- calibrations ----------------------------------------------------------------------------


def _window_of_gaps(controller, gap_ms: float) -> None:
    """The pod's streams showed `gap_ms` between tokens over a full window, and the controller
    looked (it does whenever it counts the pool's rows)."""
    pod = controller.decode_pool.pods[0]
    pod.token_gaps = TokenGaps(started=pod.token_gaps.started - 2.0)
    pod.token_gaps.add(gap_ms * 10 / 1000, 10)
    controller.row_capacity()


@pytest.mark.parametrize("default_tpot_ms", [100.0, None])
def test_the_tpot_model_learns_from_the_pods_gaps_not_from_each_requests_own(default_tpot_ms):
    """A request's mean gap is measured over rows that joined after it was admitted (under a
    backlog, always more): learning from it inflated every later prediction. The pod's windows
    of gaps against its step at the rows it ran then are what the model learns from, with a
    default TPOT objective or without (a request may bring its own)."""
    import asyncio

    async def predicted_tpots() -> list[float]:
        controller = _controller(max_rows=8, default_slo=Slo(tpot_ms=default_tpot_ms))
        first = await controller.admit(_ask("a"))
        controller.release(first, ttft_s=0.1, tpot_s=1.0)  # 45x the model's step: ignored
        second = await controller.admit(_ask("a"))
        controller.release(second, None, None)
        _window_of_gaps(controller, 88.0)  # 4x the modelled step of one row (22 ms)
        third = await controller.admit(_ask("a"))
        return [t.predicted.tpot_ms for t in (first, second, third) if t.predicted]

    first, second, third = asyncio.run(predicted_tpots())
    # 20 + 2 x 1 row, and its own 100 prompt tokens spread over its 10 (colocated): 5 ms.
    assert first == pytest.approx(27.0)
    assert second == first
    assert third == pytest.approx(27.0 * 4**0.2)  # one window moves the factor a fifth


def test_the_row_limits_hold_the_default_tpot_a_tighter_one_meets_the_prediction():
    """After the pod filled up, the prediction (its step at the row limit, calibrated on
    slower gaps) passes the default objective: the row limits hold that objective, so a
    request bound by it is admitted; one with a tighter objective is refused (429)."""
    import asyncio

    from splitserve.gateway.admission.controller import AdmissionRefused

    async def run():
        controller = _controller(max_rows=64, default_slo=Slo(tpot_ms=100.0))
        for _ in range(40):
            _window_of_gaps(controller, 88.0)  # below the 90 ms target: the limit stays 8
        pod = controller.decode_pool.pods[0]
        pod.stats = worker_pb2.WorkerStats(
            model="m", max_num_seqs=64, max_num_batched_tokens=512, num_running=20, **COSTS
        )
        held = await controller.admit(_ask("a", tpot_ms=100.0))
        with pytest.raises(AdmissionRefused) as refused:
            await controller.admit(_ask("a", tpot_ms=50.0))
        await controller.close()
        return held, refused.value

    held, refused = asyncio.run(run())
    # The step at the limit (20 + 2 x 8, and its own prompt's 5) times the calibrated factor
    # (about 4).
    assert held.predicted is not None and held.predicted.tpot_ms > 100.0
    assert refused.http_status == 429 and "time per output token" in str(refused)


def test_a_flood_waiting_behind_favoured_work_does_not_raise_a_favoured_ttft():
    """The pods compute favoured prompts first, so a flood's measured TTFTs run past the
    model by more than a favoured request's do: each class keeps its own calibration."""
    import asyncio

    async def run():
        controller = _controller(max_rows=4)
        controller.release(await controller.admit(_ask("quiet")), None, None)  # it asked
        flood = [await controller.admit(_ask("flood")) for _ in range(3)]
        plain = [ticket for ticket in flood if not ticket.favoured]  # the row past its share
        for ticket in plain:  # its first token came 10x later than modelled, many times
            assert ticket.model is not None
            for _ in range(10):
                controller.first_token(ticket, ticket.model.ttft_ms * 10 / 1000)
        quiet = await controller.admit(_ask("quiet"))
        await controller.close()
        return quiet, plain

    quiet, plain = asyncio.run(run())
    assert len(plain) == 2  # past its share of the rows, then of the asks
    assert quiet.favoured and quiet.model is not None and quiet.predicted is not None
    # Its prediction is the model's (plus the moment it took to admit), not 10x it.
    assert quiet.predicted.ttft_ms < 2 * quiet.model.ttft_ms


def test_an_idle_pool_refuses_only_on_the_cost_models_own_prediction():
    """A TTFT factor learnt under load (first tokens 10x the model) does not refuse a request
    that finds the pool idle, where the model alone meets its objective; the same request
    beside one in flight is refused on the calibrated prediction (429)."""
    import asyncio

    from splitserve.gateway.admission.controller import AdmissionRefused

    async def run():
        controller = _controller(max_rows=8)
        for _ in range(30):
            ticket = await controller.admit(_ask("a"))
            controller.first_token(ticket, ticket.model.ttft_ms * 10 / 1000)
            controller.release(ticket, None, None)
        probe = await controller.admit(_ask("a"))
        objective_ms = 3 * probe.model.ttft_ms  # the model meets it, 10x the model does not
        controller.release(probe, None, None)
        alone = await controller.admit(_ask("a", ttft_ms=objective_ms))
        with pytest.raises(AdmissionRefused) as beside:
            await controller.admit(_ask("a", ttft_ms=objective_ms))
        await controller.close()
        return alone, beside.value

    alone, refusal = asyncio.run(run())
    assert alone.model is not None
    assert refusal.http_status == 429 and refusal.reason == "slo"


def test_once_every_row_limit_is_one_row_the_default_tpot_meets_the_prediction():
    """Gaps far past the objective even at one row: no row limit can hold it, so a request
    bound by the default objective is refused on the prediction again."""
    import asyncio

    from splitserve.gateway.admission.controller import AdmissionRefused

    async def run():
        controller = _controller(max_rows=64, default_slo=Slo(tpot_ms=100.0))
        for _ in range(40):
            _window_of_gaps(controller, 1000.0)  # the limit halves to one row, the factor 10
        with pytest.raises(AdmissionRefused) as refused:
            await controller.admit(_ask("a", tpot_ms=100.0))
        await controller.close()
        return refused.value

    refused = asyncio.run(run())
    assert refused.http_status == 429 and "time per output token" in str(refused)


def test_a_lone_stream_ending_lets_the_controller_take_its_pods_gaps():
    """One request at a time never has rows counted at admission (nothing in flight): the
    window of its stream's gaps is taken when it ends, so the next prediction learns from it."""
    import asyncio

    async def run() -> tuple[float, float]:
        controller = _controller(max_rows=8, default_slo=Slo(tpot_ms=100.0))
        first = await controller.admit(_ask("a"))
        pod = controller.decode_pool.pods[0]
        pod.token_gaps = TokenGaps(started=pod.token_gaps.started - 2.0)
        pod.token_gaps.add(0.88, 10)  # 88 ms a token while it streamed
        controller.release(first, ttft_s=0.1, tpot_s=0.088)
        second = await controller.admit(_ask("a"))
        assert first.predicted is not None and second.predicted is not None
        return first.predicted.tpot_ms, second.predicted.tpot_ms

    first, second = asyncio.run(run())
    assert second == pytest.approx(first * 4**0.2)
