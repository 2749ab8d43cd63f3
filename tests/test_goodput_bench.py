"""benchmarks.goodput's arithmetic, without any server: the Poisson arrivals it sends, how
per-request outcomes from either client become goodput, attainment and refusal figures."""

from __future__ import annotations

import math

import pytest

from benchmarks.goodput.clients import FIXED, MIXED, our_outcomes, vllm_outcomes
from benchmarks.goodput.figures import (
    LOOSE,
    TIGHT,
    Outcome,
    load_seeds,
    num_arrivals,
    offered_rates,
    summarize,
)
from benchmarks.goodput.systems import systems_under_test
from splitserve.loadgen.client import RequestResult, RunResult
from splitserve.loadgen.workload import poisson_workload


def good(ttft_s: float, tpot_s: float) -> Outcome:
    return Outcome(200, True, ttft_s, tpot_s)


def refused(status: int, answered_s: float | None = 0.01) -> Outcome:
    return Outcome(status, False, None, None, answered_s)


def test_poisson_arrivals_have_the_asked_rate_and_repeat_by_seed() -> None:
    specs = poisson_workload("goodput-test", 4.0, 500.0, 1_000_000, FIXED.shape)
    arrivals = [spec.arrival_s for spec in specs]
    assert arrivals == sorted(arrivals) and arrivals[0] == 0.0 and arrivals[-1] < 500.0
    # ~2,000 arrivals: the count of a Poisson process has a standard deviation of sqrt(2,000).
    assert abs(len(specs) - 2000) < 4 * math.sqrt(2000)
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    assert sum(gaps) / len(gaps) == pytest.approx(0.25, rel=0.1)
    again = poisson_workload("goodput-test", 4.0, 500.0, 1_000_000, FIXED.shape)
    assert [s.arrival_s for s in again] == arrivals


def test_workload_lengths_are_vllms_random_ranges() -> None:
    assert (FIXED.shape.prompt_lens.low, FIXED.shape.prompt_lens.high) == (256, 256)
    assert (MIXED.shape.prompt_lens.low, MIXED.shape.prompt_lens.high) == (64, 448)
    assert (MIXED.shape.output_lens.low, MIXED.shape.output_lens.high) == (16, 112)
    assert MIXED.vllm_args()[-3:-1] == ["--random-range-ratio", "0.75"]
    specs = poisson_workload("mixed", 50.0, 20.0, 1_000_000, MIXED.shape)
    assert all(64 <= len(s.prompt_token_ids) <= 448 and 16 <= s.max_tokens <= 112 for s in specs)


def test_loads_are_multiples_of_the_reference_and_counts_round() -> None:
    assert offered_rates(2.0, [0.5, 1, 2, 3]) == [1.0, 2.0, 4.0, 6.0]
    with pytest.raises(ValueError):
        offered_rates(0.0, [1.0])
    assert num_arrivals(1.0, 60.0) == 60
    assert num_arrivals(0.01, 10.0) == 1  # at least one request


def test_each_load_has_its_seed_and_a_repeated_load_a_new_one() -> None:
    # Every system gets the same arrivals at a load; a repeat of a load must not send the
    # same prompts again (the prefix cache would serve them).
    seeds = load_seeds(0, [0.5, 2.0, 0.5, 0.5])
    assert seeds[0] == load_seeds(0, [0.5])[0]
    assert len(set(seeds)) == 4
    assert load_seeds(0, [0.5, 2.0, 0.5, 0.5]) == seeds  # the next system's


def test_goodput_counts_requests_meeting_both_slos_per_second() -> None:
    outcomes = [
        good(0.5, 0.05),  # meets both pairs
        good(2.0, 0.05),  # loose only (TTFT over 1 s)
        good(0.5, 0.15),  # loose only (TPOT over 100 ms)
        good(4.0, 0.05),  # neither (TTFT over 3 s)
        Outcome(200, False, 0.3, None),  # accepted, stream broke: never good
        refused(429, 0.004),
        refused(503, 0.020),
        refused(408, 5.0),
        Outcome(None, False, None, None),  # no answer
    ]
    figures = summarize(outcomes, duration_s=2.0, offered_rate=4.5)
    assert figures.num_sent == 9 and figures.num_completed == 4
    assert figures.refused == {408: 1, 429: 1, 503: 1} and figures.num_refused == 3
    assert figures.num_failed == 2
    assert figures.goodput == {"loose": 1.5, "tight": 0.5}
    # Among the 5 accepted (200) requests; refusals do not count against attainment.
    assert figures.attainment == {"loose": 3 / 5, "tight": 1 / 5}
    # Only the at-once refusals are timed; the 408 queue timeout is not one.
    assert figures.refusal_s.p50 == pytest.approx(0.012)
    assert figures.ttft.p50 == pytest.approx(1.25)


def test_slo_bounds_are_inclusive_and_the_pairs_are_the_issues() -> None:
    assert (LOOSE.ttft_ms, LOOSE.tpot_ms, TIGHT.ttft_ms, TIGHT.tpot_ms) == (3000, 200, 1000, 100)
    figures = summarize([good(3.0, 0.2), good(1.0, 0.1)], 1.0, 2.0)
    assert figures.goodput == {"loose": 2.0, "tight": 1.0}


def test_nothing_accepted_gives_nan_attainment_and_no_timed_refusals() -> None:
    figures = summarize([refused(429, None)], 1.0, 1.0)
    assert math.isnan(figures.attainment["loose"]) and math.isnan(figures.refusal_s.p50)
    assert figures.goodput["loose"] == 0.0


def test_vllm_clients_saved_lists_become_outcomes() -> None:
    result = {
        "errors": [
            "",
            "Too Many Requests",
            "Service Unavailable",
            "Never received a valid chunk to calculate TTFT.",
            "Traceback (most recent call last): ...",
        ],
        "ttfts": [0.5, 0.0, 0.0, 0.0, 0.0],
        "latencies": [0.5 + 63 * 0.05, 0.0, 0.0, 0.0, 0.0],
        "output_lens": [64, 0, 0, 0, 0],
    }
    outcomes = vllm_outcomes(result)
    assert outcomes[0].finished and outcomes[0].tpot_s == pytest.approx(0.05)
    assert [o.status for o in outcomes] == [200, 429, 503, 200, None]
    assert not any(o.finished for o in outcomes[1:])
    assert all(o.answered_s is None for o in outcomes)  # vLLM's client does not time them


def test_our_clients_results_become_outcomes_with_refusal_times() -> None:
    ok = RequestResult(256, 3, ttft_s=0.4, itls_s=[0.05, 0.07], num_output_tokens=3)
    ok.latency_s, ok.status, ok.answered_s = 0.52, 200, 0.01
    no = RequestResult(256, 3, error="HTTP 429: busy", status=429, answered_s=0.003)
    outcomes = our_outcomes(RunResult([ok, no], 1.0))
    assert outcomes[0] == Outcome(200, True, 0.4, pytest.approx(0.06), 0.01)
    assert outcomes[1] == Outcome(429, False, None, None, 0.003)


def test_the_baseline_comes_first_and_admission_stacks_only_when_flags_exist() -> None:
    without = systems_under_test(False)
    assert [s.name for s in without] == ["splitserve", "vllm"]
    assert without[0].our_client_too and without[0].measures_saturation
    with_admission = systems_under_test(True)
    assert with_admission[0].name == "splitserve"
    assert [s.admission for s in with_admission[2:]] == [LOOSE, TIGHT]
    assert not any(s.measures_saturation for s in with_admission[2:])


def test_the_flooded_phase_repeats_the_arrivals_with_prompts_the_cache_has_not_seen() -> None:
    from benchmarks.goodput.tenants import fresh_prompts

    specs = poisson_workload("tenants-quiet", 0.5, 60.0, 1_000_000, MIXED.shape)
    again = fresh_prompts(specs, "flooded-quiet")
    assert [(s.arrival_s, len(s.prompt_token_ids), s.max_tokens) for s in again] == [
        (s.arrival_s, len(s.prompt_token_ids), s.max_tokens) for s in specs
    ]
    # No prompt shares even its first 16-token block with the phase before it.
    assert all(a.prompt_token_ids[:16] != b.prompt_token_ids[:16] for a, b in zip(specs, again))
    assert fresh_prompts(specs, "flooded-quiet") == again  # repeatable
