"""`plan validate --json` records and `--replay`: recorded runs simulated again, nothing run."""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import asdict, replace

import pytest

from splitserve.planner.profile import ServingCosts, synthetic_profile
from splitserve.planner.validate.compare import (
    Comparison,
    Latencies,
    run_validation,
    save_record,
    simulated_beside,
)

NOTHING = Latencies(math.nan, math.nan, math.nan, math.nan)


def _measured(config: str, workload: str) -> Comparison:
    return Comparison(
        config,
        workload,
        rate=0.5,
        num_requests=30,
        num_ok=30,
        foreign_cores=0.0,
        measured=Latencies(0.2, 0.4, 0.03, 0.05),
        simulated=NOTHING,
        overheads=ServingCosts(),
        simulated_with_overheads=NOTHING,
        ttfts_s=[0.2, 0.3],
        itls_s=[[0.03, 0.031], [0.05]],
    )


def _args(tmp_path, **overrides) -> argparse.Namespace:
    profile = replace(
        synthetic_profile(0.05, prefill_per_token_s=1e-4, decode_step_s=0.02),
        serving={"colocated": ServingCosts(step_s=0.002, itl_spread_s=(-0.001, 0.0, 0.003))},
    )
    profile_path = tmp_path / "profile.json"
    profile.save(str(profile_path))
    fields = dict(
        profile=str(profile_path),
        margin=0.1,
        duration=20.0,
        seed=3,
        json=None,
        plot=None,
        replay=None,
        only=None,
        fresh_profile=False,
    )
    fields.update(overrides)
    return argparse.Namespace(**fields)


def test_a_recorded_run_replays_as_it_was_simulated(tmp_path, capsys) -> None:
    args = _args(tmp_path)
    profile = synthetic_profile(0.05, prefill_per_token_s=1e-4, decode_step_s=0.02)
    profile = replace(profile, serving={"colocated": ServingCosts(0.002, 0.0, 0.0, 0.0, (0.0,))})
    recorded = [
        simulated_beside(_measured(config, "chat"), profile, 0.1, args.seed, args.duration)
        for config in ("colocated-1", "colocated-2")
    ]
    record = tmp_path / "runs.json"
    save_record(str(record), recorded, args)
    body = json.loads(record.read_text())
    assert body["comparisons"][0]["itls_s"] == [[0.03, 0.031], [0.05]]
    # The machine the runs were measured on goes with them: its features and kernels' ISA.
    assert "avx2" in body["machine"]["flags"] and body["machine"]["kernel_isa"]["name"]

    # Replayed with the profile on disk (another spread): the measured side is what was
    # recorded, the simulated side is what that profile makes of the same seeded requests.
    replay_args = _args(tmp_path, replay=str(record), json=str(tmp_path / "again.json"))
    assert run_validation(replay_args) == 0
    report = capsys.readouterr().out
    assert "colocated-2  chat" in report and "within 20%" in report
    assert "-1.1 to +3.3 ms around the step" in report  # the spread with the 10% margin
    again = json.loads((tmp_path / "again.json").read_text())["comparisons"]
    assert [c["measured"] for c in again] == [asdict(c.measured) for c in recorded]
    assert again[0]["simulated"] == asdict(recorded[0].simulated)  # bare: the same model
    assert again[0]["overheads"]["itl_spread_s"] == pytest.approx([-0.0011, 0.0, 0.0033])
    assert all(math.isfinite(v) for v in again[1]["simulated_with_overheads"].values())


def _replayed_report(tmp_path, recorded: list[Comparison], capsys) -> str:
    """What `--replay` prints for `recorded` saved as a record."""
    record = tmp_path / "recorded.json"
    save_record(str(record), recorded, _args(tmp_path))
    assert run_validation(_args(tmp_path, replay=str(record))) == 0
    return capsys.readouterr().out


def test_a_run_paced_by_the_engine_is_simulated_again_at_that_pace(tmp_path, capsys) -> None:
    """A run the bare engine was timed around at half the profile's speed is simulated a third
    time with the profile's steps twice as long; the planner's own figures stay as they were."""
    args = _args(tmp_path)
    profile = synthetic_profile(0.05, prefill_per_token_s=1e-4, decode_step_s=0.02)
    slow = replace(_measured("colocated-1", "chat"), engine_pace=(2.0, 2.0))
    steady = _measured("colocated-2", "chat")
    recorded = [
        simulated_beside(run, profile, 0.1, args.seed, args.duration) for run in (slow, steady)
    ]
    unpaced = simulated_beside(_measured("colocated-1", "chat"), profile, 0.1, 3, 20.0)
    assert recorded[0].simulated_with_overheads == unpaced.simulated_with_overheads
    at_pace, planned = recorded[0].simulated_at_pace, recorded[0].simulated_with_overheads
    assert at_pace.itl_p50 == pytest.approx(2 * planned.itl_p50, rel=0.05)
    assert at_pace.ttft_p50 > 1.5 * planned.ttft_p50
    assert all(math.isnan(v) for v in asdict(recorded[1].simulated_at_pace).values())

    report = _replayed_report(tmp_path, recorded, capsys)
    assert "decode steps at x2.00-2.00" in report
    assert "colocated-1  chat         prefill x2.00 decode x2.00" in report
    assert "colocated-2  chat         prefill" not in report  # not paced: not in the block


def test_replay_refuses_what_is_not_a_record(tmp_path) -> None:
    not_record = tmp_path / "list.json"
    not_record.write_text("[]")
    with pytest.raises(ValueError, match="not a `validate --json` record"):
        run_validation(_args(tmp_path, replay=str(not_record)))
    unknown = tmp_path / "unknown.json"
    body = {"seed": 0, "duration_s": 10.0, "comparisons": [{"config": "colocated-9"}]}
    unknown.write_text(json.dumps(body))
    with pytest.raises(ValueError, match="not a recorded run"):
        run_validation(_args(tmp_path, replay=str(unknown)))
    with pytest.raises(ValueError, match="cannot read"):
        run_validation(_args(tmp_path, replay=str(tmp_path / "missing.json")))


def _run(config: str, simulated_score_s: float, ttfts_s: list[float], itl_s: float) -> Comparison:
    """A recorded chat run whose simulated figures give `simulated_score_s` (all TTFT)."""
    itls = [[itl_s * (1 + 0.01 * (i % 5)) for _ in range(10)] for i in range(len(ttfts_s))]
    return replace(
        _measured(config, "chat"),
        measured=Latencies(sorted(ttfts_s)[len(ttfts_s) // 2], 0.0, itl_s, 0.0),
        simulated_with_overheads=Latencies(simulated_score_s, 0.0, 0.0, 0.0),
        ttfts_s=ttfts_s,
        itls_s=itls,
    )


def test_the_ranking_check_tells_a_miss_from_a_tie_within_noise() -> None:
    from splitserve.planner.validate.compare import WORKLOADS
    from splitserve.planner.validate.ranking import bootstrap_gap, format_ranking

    chat = WORKLOADS[0]
    spread = [0.1 + 0.002 * i for i in range(40)]  # 100-178 ms
    fast = _run("colocated-1", 0.3, spread, 0.020)
    same = _run("colocated-2", 0.4, [t + 0.001 for t in spread], 0.020)  # 1 ms behind
    slow = _run("1P+1D", 0.5, [t + 0.2 for t in spread], 0.030)  # clearly behind
    assert "measures best: yes" in format_ranking([fast, same, slow], WORKLOADS)
    # The pick 1 ms behind, over 40 requests spread across 78 ms: the interval holds 0.
    same_picked = replace(same, simulated_with_overheads=Latencies(0.2, 0.0, 0.0, 0.0))
    low, high = bootstrap_gap(same_picked, fast, chat)
    assert low < 0 < high
    verdict = format_ranking([fast, same_picked], WORKLOADS)
    assert "within noise (colocated-2 behind colocated-1" in verdict
    # 200 ms and 10 ms a gap behind: a miss however the requests are resampled.
    slow_picked = replace(slow, simulated_with_overheads=Latencies(0.2, 0.0, 0.0, 0.0))
    assert "measures best: NO (1P+1D behind colocated-1:" in format_ranking(
        [fast, slow_picked], WORKLOADS
    )
    assert bootstrap_gap(slow_picked, fast, chat)[0] > 0.2
    # Without per-request timings there is nothing to resample: a miss is a miss.
    untimed = replace(same_picked, ttfts_s=[], itls_s=[])
    assert "NO (colocated-2 behind colocated-1; no per-request timings" in format_ranking(
        [fast, untimed], WORKLOADS
    )


def test_goodput_counts_requests_within_both_slos_per_pod_and_checks_the_pick() -> None:
    from splitserve.loadgen.stats import Slo
    from splitserve.planner.validate.compare import WORKLOADS
    from splitserve.planner.validate.goodput import (
        format_goodput,
        measured_attainment,
        pick_shortfall,
        workload_slo,
    )

    slo = Slo(ttft_s=0.25, itl_s=0.04)
    # 30 requests offered, 2 recorded finished: one within both SLOs (TTFT 0.2 s, mean gap
    # 30.5 ms), one past the TTFT SLO; the other 28 failed, and a failed request misses.
    one_of_two = replace(_measured("colocated-1", "chat"), goodput_slo=(0.25, 0.04))
    assert measured_attainment(one_of_two, slo) == pytest.approx(1 / 30)
    # All 30 finished within both, on one pod and on two: per pod, one pod does twice as much.
    good = replace(one_of_two, ttfts_s=[0.1] * 30, itls_s=[[0.03]] * 30, simulated_attainment=1.0)
    two_pods = replace(good, config="colocated-2", simulated_attainment=1.0)
    pick, best, shortfall = pick_shortfall([good, two_pods])
    assert (pick.config, best.config, shortfall) == ("colocated-1", "colocated-1", 0.0)
    # The simulator picks a layout whose requests measure as missing their ITL SLO: a miss.
    slow = replace(two_pods, itls_s=[[0.05]] * 30)
    wrong = [replace(good, simulated_attainment=0.3), slow]
    pick, best, shortfall = pick_shortfall(wrong)
    assert (pick.config, best.config, shortfall) == ("colocated-2", "colocated-1", 1.0)
    report = format_goodput(wrong, WORKLOADS)
    assert "the simulator's pick, colocated-2, measures 100% below the best" in report
    assert "within 10%: NO" in report
    # The SLOs scale with the machine: a profile twice as slow gives SLOs twice as long.
    shape = WORKLOADS[0].shape
    fast_slo = workload_slo(synthetic_profile(0.05, decode_step_s=0.02), shape)
    slow_slo = workload_slo(synthetic_profile(0.1, decode_step_s=0.04), shape)
    assert slow_slo.ttft_s == pytest.approx(2 * fast_slo.ttft_s)
    assert slow_slo.itl_s == pytest.approx(2 * fast_slo.itl_s)


def test_a_run_paced_by_its_pods_step_logs_is_simulated_at_that_pace(tmp_path, capsys) -> None:
    """The pods' own pace (their step logs) is simulated and reported beside the engine's,
    and survives a record's round trip: a replay recomputes the run at it."""
    args = _args(tmp_path)
    profile = synthetic_profile(0.05, prefill_per_token_s=1e-4, decode_step_s=0.02)
    slow = replace(_measured("colocated-1", "chat"), pod_pace=(1.0, 3.0))
    recorded = [simulated_beside(slow, profile, 0.1, args.seed, args.duration)]
    at_pods, planned = recorded[0].simulated_at_pod_pace, recorded[0].simulated_with_overheads
    assert at_pods.itl_p50 == pytest.approx(3 * planned.itl_p50, rel=0.05)
    assert all(math.isnan(v) for v in asdict(recorded[0].simulated_at_pace).values())

    report = _replayed_report(tmp_path, recorded, capsys)
    assert "the pods' own steps during the runs" in report
    assert "decode at x3.00-3.00" in report
    assert "colocated-1  chat         prefill x1.00 decode x3.00" in report
    assert "bare engine around each run" not in report  # no engine pace: not its block
