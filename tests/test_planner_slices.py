"""`recommend` at cluster scale by slices (`planner/slices.py`), the judge's early stop and its
seeds run in worker processes."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from splitserve.loadgen.stats import Slo
from splitserve.loadgen.workload import LengthDistribution, WorkloadSpec
from splitserve.planner.__main__ import main as plan_main
from splitserve.planner.pool import simulation_pool
from splitserve.planner.profile import synthetic_profile
from splitserve.planner.recommend import recommend
from splitserve.planner.search import Recommendation, SearchSpec, workload_at
from splitserve.planner.simulate.cluster import ClusterConfig
from splitserve.planner.sizing import Target, Verdict, judge
from splitserve.planner.slices import CONFIRM_STEP, MAX_CONFIRM_STEPS, scale_up, settle

# Each 64-token prompt takes 0.25 s of prefill (one a step); decode steps are 10 ms: the
# layouts that hold most per pod are prefill-heavy, and a whole layout needs ~R / 4 prefill pods.
PROFILE = synthetic_profile(0.25, decode_step_s=0.01, max_num_batched_tokens=64)
SLO = Slo(ttft_s=1.5, itl_s=0.1)


def _workload(rate: float, num_requests: int) -> WorkloadSpec:
    return WorkloadSpec(rate, num_requests, LengthDistribution(64, 64), LengthDistribution(16, 16))


def _spec(**options) -> SearchSpec:
    # 20 s of arrivals at 40 req/s
    defaults = dict(max_pods=100, num_seeds=3, confidence=0.66, local_prefill_threshold=0)
    return SearchSpec(_workload(40.0, 800), SLO, **{**defaults, **options})


@pytest.fixture(scope="module")
def sliced() -> Recommendation:
    """One search past 64 pods, shared by the tests that read it (a few seconds)."""
    return recommend(PROFILE, _spec())


def test_a_slice_scales_up_with_each_role_rounded_up() -> None:
    whole = scale_up(ClusterConfig(3, 7, pods_per_host=2), 33.4)
    # 100.2 prefill and 233.8 decode pods' worth: neither role may carry more than its share
    assert (whole.num_prefill, whole.num_decode, whole.pods_per_host) == (101, 234, 2)
    assert (scale_up(ClusterConfig(3, 7), 100.0).num_prefill) == 300  # no float residue


def test_past_64_pods_recommend_judges_slices_and_the_whole_it_picks_meets(sliced) -> None:
    spec = _spec()
    assert spec.slice_size == 10 and _spec(max_pods=64).slice_size == 0
    recommendation = sliced
    assert recommendation.slice_pods == 10
    best = recommendation.best
    assert best is not None and best.layout is not None
    assert best.num_pods > 10  # a whole layout, not the slice
    assert best.verdict.cluster.num_prefill + best.verdict.cluster.num_decode == 10
    # The slice's claim, checked on the whole layout at the whole rate: it meets the target.
    whole = judge(PROFILE, best.cluster, spec.workload, spec.target)
    assert whole.meets, [r.attainment for r in whole.results]
    # The whole is R / r slices of the layout, each role rounded up; it has enough prefill
    # pods for 40 prompts/s at 4/s each.
    (point,) = [p for p in recommendation.ratios if p.settled and p.verdict is best.verdict]
    slices = 40.0 / point.max_rate
    slice_cluster = best.verdict.cluster
    assert best.cluster.num_prefill == math.ceil(slice_cluster.num_prefill * slices)
    assert best.cluster.num_decode == math.ceil(slice_cluster.num_decode * slices)
    assert best.cluster.num_prefill >= 10
    for candidate in recommendation.candidates:  # a whole serves no more than it is offered
        assert candidate.goodput <= 40.0 * 1.05, candidate.cluster.label


def test_a_settled_slice_rate_meets_and_one_step_more_does_not(sliced) -> None:
    spec = _spec()
    recommendation = sliced
    settled = [point for point in recommendation.ratios if point.settled]
    screened = [point for point in recommendation.ratios if not point.settled]
    assert settled and screened  # the far layouts were only screened
    best = max(recommendation.ratios, key=lambda point: point.goodput_per_pod)
    assert recommendation.best_ratio is best and best.settled
    assert all(point.goodput_per_pod < 0.9 * best.goodput_per_pod for point in screened)
    for point in [point for point in settled if point.max_rate > 0]:
        for rate, meets in ((point.max_rate, True), (point.max_rate * (1 + CONFIRM_STEP), False)):
            workload = workload_at(spec.workload, rate, keep_duration=True)
            assert judge(PROFILE, point.cluster, workload, spec.target).meets == meets
    # the span kept: a slice's trace has its share of the whole's requests
    chosen = recommendation.best
    assert chosen is not None
    slice_requests = chosen.verdict.results[0].num_requests
    expected = 800 * chosen.verdict.cluster.num_prefill / chosen.cluster.num_prefill
    assert slice_requests == pytest.approx(expected, rel=0.1)


def test_the_early_stop_and_the_worker_processes_change_no_verdict() -> None:
    cluster = ClusterConfig(1, 1, local_prefill_threshold=0)
    target = Target(SLO, 0.9, 0.6, num_seeds=5)
    with simulation_pool(2) as workers:
        for rate in (2.0, 3.6, 4.2, 6.0):  # meets, near the edge, fails
            workload = _workload(rate, 120)
            plain = judge(PROFILE, cluster, workload, target)
            stopped = judge(PROFILE, cluster, workload, target, stop_once_failed=True)
            parallel = judge(
                PROFILE, cluster, workload, target, stop_once_failed=True, workers=workers
            )
            assert plain.meets == stopped.meets == parallel.meets
            assert [r.attainment for r in stopped.results] == [
                r.attainment for r in parallel.results
            ]
            assert [r.attainment for r in stopped.results] == [
                r.attainment for r in plain.results[: len(stopped.results)]
            ]
            if not plain.meets:
                assert len(stopped.results) < 5  # it stopped once 3 seeds missed


def test_the_command_prints_the_slices_and_the_time_and_refuses_a_bad_slice(
    tmp_path, capsys
) -> None:
    profile_path = tmp_path / "profile.json"
    PROFILE.save(str(profile_path))
    common = [
        "recommend", "--profile", str(profile_path), "--rate", "40", "--num-requests", "800",
        "--input-lens", "64", "--output-lens", "16", "--ttft-slo", "1.5", "--itl-slo", "0.1",
        "--local-prefill-threshold", "0", "--seeds", "3", "--confidence", "0.66",
        "--margin", "0", "--plot", "",
    ]  # fmt: skip
    plot = tmp_path / "layouts.png"
    sliced_run = ["--max-pods", "60", "--slice-pods", "4", "--jobs", "2", "--plot", str(plot)]
    assert plan_main([*common, *sliced_run]) == 0
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out = capsys.readouterr().out
    assert "judged by slices of 4 pods" in out and "(searched in" in out
    assert "<== fewest devices" in out and "(screened)" in out
    assert "prefill:\n  replicas: " in out
    for bad in (["--slice-pods", "1"], ["--jobs", "0"]):
        assert plan_main([*common, "--max-pods", "60", *bad]) == 2
        assert "must be" in capsys.readouterr().err


def test_a_target_no_slice_meets_or_none_fits_max_pods_is_a_clear_no(capsys, tmp_path) -> None:
    # a TTFT SLO under one prompt's prefill: no slice holds any rate
    impossible = replace(_spec(), slo=Slo(ttft_s=0.2, itl_s=0.1))
    recommendation = recommend(PROFILE, impossible)
    assert recommendation.best is None and recommendation.candidates == []
    assert all(point.max_rate == 0 for point in recommendation.ratios)
    # 400 req/s needs ~120 pods of this profile (4 prompts/s per prefill pod): 65 do not fit
    profile_path = tmp_path / "profile.json"
    PROFILE.save(str(profile_path))
    status = plan_main(
        [
            "recommend", "--profile", str(profile_path), "--rate", "400", "--num-requests",
            "8000", "--input-lens", "64", "--output-lens", "16", "--ttft-slo", "1.5",
            "--itl-slo", "0.1", "--local-prefill-threshold", "0", "--seeds", "3",
            "--confidence", "0.66", "--margin", "0", "--plot", "", "--max-pods", "65",
            "--jobs", "1",
        ]
    )  # fmt: skip
    assert status == 1
    out = capsys.readouterr().out
    assert "no configuration of up to 65 pods meets the target" in out
    assert "the best slice layout (" in out and "the target needs more pods" in out


def _threshold_test(highest: float, tried: list[float]):
    """A full test that meets at or below `highest` req/s (what settle's search sees)."""

    def test(rate: float) -> Verdict:
        tried.append(rate)
        meets = rate <= highest
        return Verdict(ClusterConfig(1, 1), [], float(meets), meets, "decode step", {})

    return test


@pytest.mark.parametrize("start", [3.0, 9.0, 9.9, 10.0, 10.2, 14.0, 40.0])
def test_settle_finds_the_highest_rate_that_meets_to_within_one_step(start: float) -> None:
    tried: list[float] = []
    rate, verdict = settle(_threshold_test(10.0, tried), start)
    assert verdict.meets and rate <= 10.0
    assert rate * (1 + CONFIRM_STEP) > 10.0 * (1 - 1e-9)  # one step up would fail
    assert len(tried) <= 2 * MAX_CONFIRM_STEPS + 8


def test_settle_says_0_when_nothing_meets_and_a_lower_bound_past_its_steps_up() -> None:
    rate, verdict = settle(_threshold_test(0.0, []), 5.0)
    assert rate == 0.0 and not verdict.meets
    tried: list[float] = []
    rate, verdict = settle(_threshold_test(1e9, tried), 1.0)
    assert verdict.meets and rate == max(tried) and len(tried) == MAX_CONFIRM_STEPS + 1


def test_a_whole_no_larger_than_a_slice_is_judged_whole_once() -> None:
    # 3 req/s: a 10-pod slice holds several times that, so the wholes are 2-4 pods
    spec = replace(_spec(), workload=_workload(3.0, 60))
    recommendation = recommend(PROFILE, spec)
    layouts = [(c.cluster.num_prefill, c.cluster.num_decode) for c in recommendation.candidates]
    assert len(layouts) == len(set(layouts))  # one candidate per whole layout
    small = [c for c in recommendation.candidates if c.num_pods <= 10]
    assert small and all(c.layout is None and c.verdict.cluster is c.cluster for c in small)
    for candidate in recommendation.candidates:  # a whole serves no more than it is offered
        assert candidate.goodput <= 3.0 * 1.15, candidate.cluster.label


def test_the_fewest_devices_pick_comes_from_the_spec_s_own_limit_without_admission() -> None:
    spec = _spec(try_admission=True, remote_prefill_limits=(128,), slice_pods=4)
    recommendation = recommend(PROFILE, spec)
    assert any(p.cluster.admission_ttft_s is not None for p in recommendation.ratios)
    assert any(p.cluster.max_remote_prefill_tokens == 128 for p in recommendation.ratios)
    assert recommendation.candidates
    for candidate in recommendation.candidates:
        assert candidate.cluster.admission_ttft_s is None
        assert candidate.cluster.max_remote_prefill_tokens == 0
