"""Sampler: exact checks on handcrafted logits, and many-draw checks with fixed seeds."""

from __future__ import annotations

import math

import pytest
import torch

from splitserve.engine.sampler import Sampler, SamplingRow, apply_penalties, make_generator
from splitserve.engine.sampling_params import SamplingParams

sampler = Sampler()


def row(params: SamplingParams, prompt=(), output=(), suppressed=(), generator=None):
    if generator is None:
        generator = make_generator(params)
    return SamplingRow(params, generator, list(prompt), list(output), tuple(suppressed))


def draw_many(logits_row: torch.Tensor, params: SamplingParams, num_draws: int, seed: int = 0):
    """num_draws samples of one distribution: one batch of identical rows sharing a generator."""
    generator = torch.Generator().manual_seed(seed)
    rows = [row(params, generator=generator) for _ in range(num_draws)]
    logits = logits_row.unsqueeze(0).expand(num_draws, -1).contiguous()
    return torch.tensor(sampler.sample(logits, rows).sampled_token_ids)


def logits_with_probs(probs: list[float]) -> torch.Tensor:
    return torch.tensor(probs).log()


def test_greedy_is_argmax():
    logits = torch.randn(6, 100, generator=torch.Generator().manual_seed(0))
    greedy = SamplingParams(temperature=0.0)
    out = sampler.sample(logits, [row(greedy) for _ in range(6)])
    assert out.sampled_token_ids == logits.argmax(dim=-1).tolist()
    assert out.logprobs == [None] * 6
    # The full path (logprobs asked for) and a greedy row among random rows agree.
    with_logprobs = SamplingParams(temperature=0.0, logprobs=1)
    rows = [row(with_logprobs), row(SamplingParams(seed=3))] * 3
    out = sampler.sample(logits, rows)
    assert out.sampled_token_ids[::2] == logits.argmax(dim=-1).tolist()[::2]


def test_input_logits_are_not_mutated():
    logits = torch.randn(2, 50, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    params = SamplingParams(top_k=3, top_p=0.5, min_p=0.1, repetition_penalty=2.0, seed=1)
    sampler.sample(logits, [row(params, prompt=[1, 2], output=[3], suppressed=[4])] * 2)
    assert torch.equal(logits, before)


def test_suppressed_tokens_are_never_sampled():
    logits = torch.tensor([5.0, 4.0, 0.0, 0.0])
    greedy = sampler.sample(
        logits.unsqueeze(0), [row(SamplingParams(temperature=0.0), suppressed=[0])]
    )
    assert greedy.sampled_token_ids == [1]
    drawn = draw_many(logits, SamplingParams(temperature=2.0), 3000)
    assert set(drawn.tolist()) == {0, 1, 2, 3}
    params = SamplingParams(temperature=2.0)
    generator = torch.Generator().manual_seed(0)
    rows = [row(params, suppressed=[0, 1, 10**6], generator=generator) for _ in range(3000)]
    drawn = sampler.sample(logits.expand(3000, -1).contiguous(), rows).sampled_token_ids
    assert set(drawn) == {2, 3}  # the out-of-vocabulary id is ignored


@pytest.mark.parametrize(
    "target",
    [
        SamplingParams(temperature=0.9, top_p=0.95, seed=1234),
        # No filters of its own, batched with rows that need the sort and min-p steps.
        SamplingParams(temperature=1.0, seed=77),
    ],
)
def test_same_seed_same_tokens_whatever_the_batch(target):
    vocab = 64
    steps = [torch.randn(vocab, generator=torch.Generator().manual_seed(s)) for s in range(40)]
    others = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.3, top_k=5, seed=9),
        SamplingParams(min_p=0.2),
        SamplingParams(temperature=0.5, top_p=0.3, repetition_penalty=1.5, logprobs=2, seed=4),
    ]

    def run(batch_params: list[SamplingParams], target_index: int) -> list[int]:
        rows = [row(p) for p in batch_params]
        tokens = []
        for logits in steps:
            batch = torch.stack([logits * (i + 1) for i in range(len(rows))])
            batch[target_index] = logits
            tokens.append(sampler.sample(batch, rows).sampled_token_ids[target_index])
        return tokens

    alone = run([target], 0)
    assert alone == run([target], 0)
    assert alone == run([*others, target], 4)
    assert alone == run([others[1], target, others[3]], 1)
    assert alone == run([target, *others[::-1]], 0)
    assert len(set(alone)) > 5  # really sampling, not collapsing to one token


def test_different_seeds_give_different_tokens():
    logits = torch.zeros(100)

    def tokens(seed: int) -> list[int]:
        rows = [row(SamplingParams(seed=seed))]
        return [sampler.sample(logits.unsqueeze(0), rows).sampled_token_ids[0] for _ in range(50)]

    first, second = tokens(1), tokens(2)
    assert first != second
    assert sum(a == b for a, b in zip(first, second)) < 10
    assert tokens(1) == first


def test_unseeded_rows_use_the_global_rng():
    logits = torch.zeros(1, 1000)
    params = SamplingParams()
    torch.manual_seed(5)
    first = [sampler.sample(logits, [row(params)]).sampled_token_ids[0] for _ in range(20)]
    torch.manual_seed(5)
    second = [sampler.sample(logits, [row(params)]).sampled_token_ids[0] for _ in range(20)]
    assert first == second and len(set(first)) > 10


def test_top_k_never_leaves_the_k_largest():
    logits = torch.randn(200, generator=torch.Generator().manual_seed(7))
    top5 = set(logits.topk(5).indices.tolist())
    drawn = draw_many(logits, SamplingParams(temperature=3.0, top_k=5), 5000)
    assert set(drawn.tolist()) == top5


@pytest.mark.parametrize(
    ("top_p", "support"),
    [(0.7, {3, 0}), (0.8, {3, 0, 4}), (0.95, {3, 0, 4, 1}), (0.1, {3}), (1.0, {0, 1, 2, 3, 4})],
)
def test_top_p_keeps_exactly_the_nucleus(top_p, support):
    # Token -> probability: 3: 0.5, 0: 0.25, 4: 0.15, 1: 0.07, 2: 0.03.
    logits = logits_with_probs([0.25, 0.07, 0.03, 0.5, 0.15])
    drawn = draw_many(logits, SamplingParams(top_p=top_p), 6000)
    assert set(drawn.tolist()) == support


def test_top_k_then_top_p_measures_mass_among_survivors():
    # After top_k=2 the survivors are 0.5/0.75 and 0.25/0.75: top_p=0.6 keeps only the first.
    logits = logits_with_probs([0.25, 0.07, 0.03, 0.5, 0.15])
    drawn = draw_many(logits, SamplingParams(top_k=2, top_p=0.6), 2000)
    assert set(drawn.tolist()) == {3}


@pytest.mark.parametrize(("min_p", "support"), [(0.3, {0, 1, 2}), (0.7, {0, 1}), (0.0, None)])
def test_min_p_drops_tokens_below_fraction_of_max(min_p, support):
    probs = [0.4, 0.3, 0.15, 0.1, 0.05]  # min_p=0.3 -> threshold 0.12; 0.7 -> 0.28
    drawn = draw_many(logits_with_probs(probs), SamplingParams(min_p=min_p), 6000)
    assert set(drawn.tolist()) == (support or {0, 1, 2, 3, 4})


def test_repetition_penalty_hf_semantics():
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 3.0]])
    params = SamplingParams(repetition_penalty=2.0)
    # Seen (prompt + output): 0, 1, 2, each once however often it occurs.
    out = apply_penalties(logits, [row(params, prompt=[0, 0], output=[1, 2, 1])])
    assert out.tolist() == [[1.0, -2.0, 0.25, -0.5, 3.0]]


def test_frequency_and_presence_penalties_openai_semantics():
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 3.0]])
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    # Prompt tokens do not count; output: token 1 twice, token 2 once.
    out = apply_penalties(logits, [row(params, prompt=[0, 4], output=[1, 2, 1])])
    expected = [2.0, -1.0 - (0.5 * 2 + 0.25), 0.5 - (0.5 + 0.25), -0.5, 3.0]
    assert out[0].tolist() == expected


def test_all_penalties_compose_in_order():
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 3.0], [1.0, 1.0, 1.0, 1.0, 1.0]])
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=-0.5, presence_penalty=1.0)
    rows = [row(params, prompt=[0], output=[1, 1, 2], suppressed=[4]), row(SamplingParams())]
    out = apply_penalties(logits, rows)
    # Repetition first (on the raw sign), then -(freq * count + presence).
    expected = [1.0, -2.0 - (-1.0 + 1.0), 0.25 - (-0.5 + 1.0), -0.5, -math.inf]
    assert out[0].tolist() == expected
    assert out[1].tolist() == [1.0] * 5  # rows without penalties are untouched


def test_penalties_decide_greedy_choice():
    greedy = SamplingParams(temperature=0.0, repetition_penalty=1.1)
    logits = torch.tensor([[3.0, 2.9], [-1.0, -1.05]])
    rows = [row(greedy, output=[0]), row(greedy, prompt=[0])]
    # 3.0 / 1.1 = 2.73 < 2.9 and -1.0 * 1.1 = -1.1 < -1.05: both flip to token 1.
    assert sampler.sample(logits, rows).sampled_token_ids == [1, 1]


def test_logprobs_are_raw_log_softmax_with_rank_and_sorted_top():
    logits = torch.randn(3, 40, generator=torch.Generator().manual_seed(2))
    rows = [
        row(SamplingParams(temperature=0.0, logprobs=5)),
        row(
            SamplingParams(temperature=0.3, repetition_penalty=3.0, logprobs=3, seed=1),
            prompt=list(range(20)),
        ),
        row(SamplingParams(seed=2)),
    ]
    out = sampler.sample(logits, rows)
    raw = torch.log_softmax(logits, dim=-1)
    assert out.logprobs[2] is None
    for i, num_top in [(0, 5), (1, 3)]:
        lp = out.logprobs[i]
        token = out.sampled_token_ids[i]
        assert lp.token_id == token
        assert lp.logprob == pytest.approx(raw[i, token].item(), abs=1e-6)
        assert lp.rank == 1 + int((raw[i] > raw[i, token]).sum())
        expected_top = raw[i].topk(num_top)
        assert [t for t, _ in lp.top] == expected_top.indices.tolist()
        assert [v for _, v in lp.top] == pytest.approx(expected_top.values.tolist(), abs=1e-6)
        assert [v for _, v in lp.top] == sorted((v for _, v in lp.top), reverse=True)
    assert out.logprobs[0].rank == 1  # greedy takes the most likely token
    assert out.logprobs[0].top[0] == (out.sampled_token_ids[0], out.logprobs[0].logprob)


def test_logprobs_zero_gives_the_sampled_token_only():
    logits = torch.tensor([[0.0, 1.0, 2.0]])
    out = sampler.sample(logits, [row(SamplingParams(temperature=0.0, logprobs=0))])
    lp = out.logprobs[0]
    assert (lp.token_id, lp.rank, lp.top) == (2, 1, [])
    assert lp.logprob == pytest.approx(2.0 - math.log(1 + math.e + math.e**2), abs=1e-6)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_sampling_matches_softmax_frequencies(temperature):
    logits = torch.tensor([1.0, 0.5, 0.0, -0.5, 2.0])
    num_draws = 20_000
    drawn = draw_many(logits, SamplingParams(temperature=temperature), num_draws, seed=11)
    observed = torch.bincount(drawn, minlength=5).double()
    expected = torch.softmax(logits.double() / temperature, dim=0) * num_draws
    chi_square = float(((observed - expected) ** 2 / expected).sum())
    # 4 degrees of freedom: P(chi2 > 18.5) = 0.001 for a correct sampler.
    assert chi_square < 18.5, (observed.tolist(), expected.tolist())


def test_empty_batch():
    out = sampler.sample(torch.empty(0, 10), [])
    assert out.sampled_token_ids == [] and out.logprobs == []


def test_the_draw_never_takes_a_token_without_probability(monkeypatch):
    """Inverse transform over the running sum: a zero-probability token, between others or
    after the last one with mass, is never drawn, even by a uniform whose product with the
    total rounds up to the total itself."""
    from splitserve.engine import sampler as sampler_module

    probs = torch.tensor(
        [[0.0, 0.25, 0.0, 0.0, 0.75, 0.0, 0.0], [0.0, 0.0, 1e-30, 0.0, 0.0, 0.0, 0.0]]
    )
    for uniform in (0.0, 0.25 - 1e-12, 0.25, 0.5, 1.0 - 2**-53, 1.0):
        monkeypatch.setattr(
            sampler_module,
            "_row_uniforms",
            lambda gens, device, u=uniform: torch.full((len(gens),), u, dtype=torch.float64),
        )
        first, second = sampler_module.draw(probs, [None, None]).tolist()
        assert first == (1 if uniform < 0.25 else 4), uniform
        assert second == 2, uniform


def test_a_seeded_draw_takes_one_number_from_its_generator():
    """`advance_generator` skips exactly what a draw takes (a decode pod continuing a prefill
    pod's seeded request relies on it), whatever the vocabulary's size."""
    from splitserve.engine.sampler import advance_generator, draw

    probs = torch.softmax(torch.randn(3, 49152, generator=torch.Generator().manual_seed(0)), -1)
    drawn = torch.Generator().manual_seed(5)
    tokens = [int(draw(probs[i : i + 1], [drawn])[0]) for i in range(3)]
    skipped = torch.Generator().manual_seed(5)
    advance_generator(skipped, 2)
    assert int(draw(probs[2:3], [skipped])[0]) == tokens[2]
    assert torch.equal(drawn.get_state(), skipped.get_state())


def test_a_row_without_mass_still_draws_a_token_in_the_vocabulary():
    """NaN probabilities (logits over a temperature so small that they overflow) or a row of
    zeros find no token by the running sum; the draw still names one the embedding can look
    up, so one bad row cannot fail the step of every row beside it."""
    from splitserve.engine.sampler import draw

    probs = torch.tensor([[float("nan"), 0.5, 0.5], [0.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    tokens = draw(probs, [None, None, None]).tolist()
    assert all(0 <= token < 3 for token in tokens) and tokens[2] == 1
    tiny = SamplingParams(temperature=1e-40)
    out = sampler.sample(torch.tensor([[1.0, 3.0, 2.0]]), [row(tiny)])
    assert 0 <= out.sampled_token_ids[0] < 3
