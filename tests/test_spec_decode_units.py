"""Speculative decoding parts on their own: n-gram lookup, greedy acceptance, rejection
sampling's output distribution (chi-square against the exact target), the adaptive k policy
and the option validation."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine.config import EngineConfig
from splitserve.engine.request import Request
from splitserve.engine.sampler import SamplingRow
from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.spec_decode.adaptive import SpeculationPolicy
from splitserve.engine.spec_decode.ngram import propose_ngram
from splitserve.engine.spec_decode.rejection import Verification, accept_greedy, verify

# ---- n-gram ----------------------------------------------------------------------------------


def test_ngram_proposes_what_followed_the_latest_match():
    tokens = [1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 8, 6, 1, 2, 3]
    # "1 2 3" occurred twice before; the latest (followed by 7 8 6) wins.
    assert propose_ngram(tokens, 3) == [7, 8, 6]
    assert propose_ngram(tokens, 1) == [7]


def test_ngram_prefers_the_longest_suffix():
    # The bigram "5 6" last occurred before 0, but the 3-gram "4 5 6" only before 7.
    tokens = [4, 5, 6, 7, 1, 5, 6, 0, 2, 4, 5, 6]
    assert propose_ngram(tokens, 2) == [7, 1]


def test_ngram_without_a_repeat_proposes_nothing():
    assert propose_ngram([1, 2, 3, 4, 5], 4) == []
    assert propose_ngram([1, 1], 4) == []  # unigrams are below the minimum n
    assert propose_ngram([1, 2, 1, 2], 0) == []


def test_ngram_stops_at_the_end_of_the_context():
    assert propose_ngram([1, 2, 3, 1, 2], 5) == [3, 1, 2]


# ---- greedy acceptance -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("drafts", "targets", "expected"),
    [
        ([5, 6, 7], [5, 6, 7, 8], [5, 6, 7, 8]),  # all accepted + bonus
        ([5, 6, 7], [5, 9, 7, 8], [5, 9]),  # first mismatch replaced, run ends
        ([5, 6, 7], [4, 6, 7, 8], [4]),
    ],
)
def test_greedy_accepts_the_longest_agreeing_prefix(drafts, targets, expected):
    assert accept_greedy(drafts, targets) == expected


# ---- rejection sampling ----------------------------------------------------------------------

VOCAB = 12


def _row(params: SamplingParams, generator: torch.Generator) -> SamplingRow:
    return SamplingRow(params, generator, [0], [])


def _chi_square_p_value(counts: torch.Tensor, expected: torch.Tensor) -> float:
    """P(statistic >= observed) under the null, pooling categories expected below 5."""
    keep = expected >= 5
    observed = torch.cat([counts[keep], counts[~keep].sum().unsqueeze(0)])
    wanted = torch.cat([expected[keep], expected[~keep].sum().unsqueeze(0)])
    if wanted[-1] < 5:  # pooled tail still too small: fold it into the largest category
        observed, wanted = observed[:-1].clone(), wanted[:-1].clone()
        observed[wanted.argmax()] += counts[~keep].sum()
        wanted[wanted.argmax()] += expected[~keep].sum()
    statistic = ((observed - wanted) ** 2 / wanted).sum()
    dof = torch.tensor(float(len(wanted) - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(dof / 2, statistic.double() / 2))


def _peaked_logits(num_rows: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, VOCAB, generator=generator) * 2.0


def _target_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    from splitserve.engine.sampler import sampling_distribution

    rows = [_row(params, torch.Generator()) for _ in range(logits.shape[0])]
    return sampling_distribution(logits, rows)


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=6, top_p=0.9),
    ],
    ids=["t1", "t0.7-topk6-topp0.9"],
)
@pytest.mark.parametrize("proposer", ["draft_model", "point_mass"])
def test_rejection_sampling_emits_the_target_distribution(params, proposer):
    """Over many seeds, the first emitted token follows p_0 and, after an accepted first
    draft, the second follows p_1: whatever q proposed."""
    num_trials = 4000
    k = 2
    target_logits = _peaked_logits(k + 1, seed=1)
    p = _target_probs(target_logits, params)
    # A draft distribution deliberately different from p (another random model).
    q = _target_probs(_peaked_logits(k, seed=2), params)
    first = torch.zeros(VOCAB)
    second = torch.zeros(VOCAB)
    fixed_first_draft = int(p[0].argmax())  # a good guess, so p_1 gets tested too
    # Trials go through `verify` in batches, as the engine verifies its rows: each has its own
    # generator, so a trial's tokens do not depend on the batch it is in.
    trials_per_call = 500
    for start in range(0, num_trials, trials_per_call):
        batch = []
        for seed in range(start, min(start + trials_per_call, num_trials)):
            generator = torch.Generator().manual_seed(seed)
            if proposer == "draft_model":
                drafts = [int(torch.multinomial(q[j], 1, generator=generator)) for j in range(k)]
                draft_probs = q
            else:  # an n-gram-like proposer: always the same guess
                drafts, draft_probs = [fixed_first_draft, int(p[1].argmax())], None
            rows = [_row(params, generator) for _ in range(k + 1)]
            batch.append(Verification(drafts, draft_probs, rows, generator))
        logits = target_logits.repeat(len(batch), 1)
        for item, emitted in zip(batch, verify(logits, batch)):
            first[emitted[0]] += 1
            if item.draft_token_ids[0] == emitted[0] and len(emitted) > 1:
                second[emitted[1]] += 1
    assert _chi_square_p_value(first, p[0] * num_trials) > 1e-3
    assert second.sum() > 400, "the first draft should be accepted often enough to test p_1"
    assert _chi_square_p_value(second, p[1] * second.sum()) > 1e-3


def test_rejection_sampling_test_would_notice_a_wrong_distribution():
    """The same statistic rejects draws from q where p was due (the test has power)."""
    params = SamplingParams(temperature=1.0)
    p = _target_probs(_peaked_logits(1, seed=1), params)[0]
    q = _target_probs(_peaked_logits(1, seed=2), params)[0]
    generator = torch.Generator().manual_seed(0)
    draws = torch.multinomial(q, 6000, replacement=True, generator=generator)
    counts = torch.bincount(draws, minlength=VOCAB).float()
    assert _chi_square_p_value(counts, p * 6000) < 1e-6


def test_greedy_rows_ignore_the_draft_distribution():
    logits = _peaked_logits(3, seed=3)
    targets = logits.argmax(dim=-1).tolist()
    params = SamplingParams(temperature=0.0, repetition_penalty=1.0)
    rows = [_row(params, torch.Generator()) for _ in range(3)]
    drafts = [targets[0], (targets[1] + 1) % VOCAB]
    q = torch.full((2, VOCAB), 1.0 / VOCAB)
    (emitted,) = verify(logits, [Verification(drafts, q, rows, None)])
    assert emitted == [targets[0], targets[1]]


# ---- adaptive k and the batch switch ---------------------------------------------------------


def _request() -> Request:
    return Request("r", [1, 2, 3], SamplingParams())


def test_k_shrinks_with_acceptance_then_pauses_and_probes():
    policy = SpeculationPolicy(max_draft_tokens=5, max_batch_size=4, min_marginal_acceptance=0.2)
    request = _request()
    assert policy.num_draft_tokens(request) == 5  # no history: optimistic
    for _ in range(10):
        policy.record(request, 5, 5)
    assert policy.num_draft_tokens(request) == 5
    for _ in range(10):
        policy.record(request, 5, 1)  # alpha drifts towards 1/2
    assert 1 <= policy.num_draft_tokens(request) < 5
    for _ in range(20):
        policy.record(request, 2, 0)
    ks = [policy.num_draft_tokens(request) for _ in range(9)]
    assert ks[:8] == [0] * 8, "paused while acceptance is hopeless"
    assert ks[8] == 1, "then one probe with k = 1"
    assert policy.stats.num_verify_steps == 40
    assert policy.stats.num_proposed_tokens == 10 * 5 + 10 * 5 + 20 * 2
    assert policy.stats.num_accepted_tokens == 50 + 10


def test_fixed_k_when_not_adaptive():
    policy = SpeculationPolicy(max_draft_tokens=3, max_batch_size=4, adaptive=False)
    request = _request()
    for _ in range(10):
        policy.record(request, 3, 0)
    assert policy.num_draft_tokens(request) == 3


def _policy_with_costs(costs: dict[int, float], max_draft_tokens: int = 8):
    policy = SpeculationPolicy(max_draft_tokens=max_draft_tokens, max_batch_size=64)
    for rows, seconds in costs.items():
        policy.observe_step(rows, seconds)
    return policy


def _request_with_alpha(policy: SpeculationPolicy, accepted: int, proposed: int) -> Request:
    request = _request()
    for _ in range(30):  # long enough for the moving estimate to settle on accepted/judged
        policy.record(request, proposed, accepted)
    return request


def test_cost_aware_k_takes_the_cheap_batch_shape():
    # A CPU-like curve: 1 row is a memory-bound GEMV; 2-7 rows cost twice as much, and 8 rows
    # no more than 2; 9 rows are dear again.
    costs = {1: 1.0, 2: 2.0, 3: 2.0, 4: 2.0, 5: 2.0, 6: 2.0, 7: 2.0, 8: 2.0, 9: 3.0}
    policy = _policy_with_costs(costs)
    request = _request_with_alpha(policy, accepted=9, proposed=10)  # alpha = 9/10
    plan = policy.plan_step(num_decoding=1)
    assert policy.num_draft_tokens(request, plan) == 7  # 8 rows: the most tokens per second
    assert plan.num_rows == 8
    alpha = request.spec_state.acceptance_rate
    assert alpha == pytest.approx(0.9, abs=1e-3)
    assert plan.expected_tokens == pytest.approx(1 + sum(alpha**j for j in range(1, 8)))


def test_linear_costs_make_speculation_lose_and_pause():
    policy = _policy_with_costs({rows: float(rows) for rows in range(1, 20)})
    request = _request_with_alpha(policy, accepted=8, proposed=10)  # alpha < 1: never pays
    plan = policy.plan_step(num_decoding=1)
    assert policy.num_draft_tokens(request, plan) == 0
    assert plan.num_rows == 1
    assert request.spec_state.num_paused_steps == 1


def test_big_batch_gets_no_drafts_where_one_request_would():
    # Flat up to 8 rows, then linear: one request may use the spare rows, 16 may not.
    costs = {rows: 1.0 for rows in range(1, 9)} | {rows: rows / 8 for rows in range(9, 40)}
    policy = _policy_with_costs(costs)
    request = _request_with_alpha(policy, accepted=8, proposed=10)
    assert policy.num_draft_tokens(request, policy.plan_step(1)) == 7
    request = _request_with_alpha(policy, accepted=8, proposed=10)
    assert policy.num_draft_tokens(request, policy.plan_step(16)) == 0


def test_new_requests_start_from_the_pooled_acceptance():
    costs = {1: 1.0, 2: 1.5, 3: 1.7, 4: 1.7, 5: 2.0, 6: 2.0, 7: 2.0, 8: 2.0, 9: 2.5}
    hopeless = _policy_with_costs(costs)
    for _ in range(5):
        _request_with_alpha(hopeless, accepted=0, proposed=8)  # drafts keep failing
    assert hopeless.num_draft_tokens(_request(), hopeless.plan_step(1)) == 0
    promising = _policy_with_costs(costs)
    for _ in range(5):
        _request_with_alpha(promising, accepted=8, proposed=8)
    assert promising.num_draft_tokens(_request(), promising.plan_step(1)) >= 7


def test_failed_probes_double_the_pause():
    policy = _policy_with_costs({rows: float(rows) for rows in range(1, 20)})
    request = _request_with_alpha(policy, accepted=0, proposed=4)
    pauses = []
    for _ in range(3):
        ks = []
        while not ks or ks[-1] != 1:  # zeros until the probe
            ks.append(policy.num_draft_tokens(request, policy.plan_step(1)))
        pauses.append(len(ks) - 1)
        policy.record(request, 1, 0)  # the probe fails
    assert pauses == [8, 16, 32]


def test_step_cost_model_prices_unmeasured_rows_optimistically():
    from splitserve.engine.spec_decode.step_cost import OPTIMISTIC_ROW_COST, StepCostModel

    model = StepCostModel()
    assert model.cost(1) == 1.0 and model.cost(3) == pytest.approx(1 + 2 * OPTIMISTIC_ROW_COST)
    model.observe(1, 0.030)
    model.observe(8, 0.060)
    assert model.cost(1) == 0.030
    assert model.cost(2) == pytest.approx(0.030 * (1 + OPTIMISTIC_ROW_COST))  # below the line
    assert model.cost(16) == pytest.approx(0.060 * (1 + 8 * OPTIMISTIC_ROW_COST))
    model.observe(8, 0.070)
    assert model.cost(8) == pytest.approx(0.8 * 0.060 + 0.2 * 0.070)  # a moving average
    assert not model.is_measured(4) and model.is_measured(8)


def test_batch_switch():
    policy = SpeculationPolicy(max_draft_tokens=3, max_batch_size=4)
    assert policy.is_active(4) and not policy.is_active(5)


# ---- options ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "name"),
    [
        ({"speculative_method": "medusa"}, "speculative_method"),
        ({"speculative_method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
        ({"speculative_method": "ngram", "num_speculative_tokens": 2.0}, "num_speculative_tokens"),
        ({"speculative_method": "draft"}, "speculative_draft_model"),
        (
            {"speculative_method": "ngram", "speculative_draft_model": "x"},
            "speculative_draft_model",
        ),
        ({"speculative_method": "self"}, "speculative_draft_layers"),
        ({"speculative_method": "self", "speculative_draft_layers": 0}, "speculative_draft_layers"),
        ({"speculative_draft_layers": 3}, "speculative_draft_layers"),
        ({"speculative_max_batch_size": -1}, "speculative_max_batch_size"),
    ],
)
def test_bad_speculative_options_are_named(options, name):
    with pytest.raises(ValueError, match=name):
        EngineConfig.from_options(**options)


# ---- pod flags and stats ---------------------------------------------------------------------


def test_pod_flags_map_to_engine_options():
    import argparse

    from splitserve.pod.flags import add_engine_flags, engine_options

    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    args = parser.parse_args(
        ["--speculative-method", "self", "--num-speculative-tokens", "6"]
        + ["--speculative-draft-layers", "10"]
    )
    config = EngineConfig.from_options(**engine_options(args))
    assert config.speculative.speculative_method == "self"
    assert config.speculative.num_speculative_tokens == 6
    assert config.speculative.speculative_draft_layers == 10
    default = EngineConfig.from_options(**engine_options(parser.parse_args([])))
    assert not default.speculative.is_enabled


def test_worker_stats_carry_the_speculation_counters():
    from splitserve.engine.core import EngineStats
    from splitserve.pod.server import PodIdentity, PodStats, pod_stats_to_proto

    engine = EngineStats(1, 0, 10, 9, 0, 0, 0, 40, 30, 12)
    identity = PodIdentity("w", "decode", "m", "tcp")
    proto = pod_stats_to_proto(PodStats(identity, engine, 2048, 16, 49152))
    assert (proto.spec_proposed_tokens, proto.spec_accepted_tokens) == (40, 30)
    assert proto.spec_verify_steps == 12
    assert engine.spec_acceptance_rate == 0.75 and engine.spec_mean_accepted_length == 2.5


def test_inter_token_latency_is_one_sample_per_step():
    from splitserve.engine.outputs import RequestTimings

    # Tokens 2-4 came from one verification step: one gap to it, one gap after it.
    timings = RequestTimings(0.0, 1.0, [1.0, 1.5, 1.5, 1.5, 2.25])
    assert timings.inter_token_latencies == [0.5, 0.75]
