"""Speculative decoding inside the engine: greedy output identical with and without it (every
proposer, mixed batches, chunked prefill, a pool small enough to preempt), stop conditions cut
accepted runs, every block free at the end, and sampled output distributed as the target's.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.parity_prompts import parity_prompts as _prompts
from benchmarks.speculative import SNIPPETS
from splitserve import LLM, SamplingParams

MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)

# The speculative benchmark's first snippet: code a prompt asks to repeat, so drafts hit.
CODE = SNIPPETS[0]


@pytest.fixture(scope="module")
def baseline_llm(single_thread) -> LLM:
    return LLM(kv_cache_bytes=128 * 2**20)


@pytest.fixture(scope="module")
def prompts(baseline_llm: LLM) -> list[list[int]]:
    tokenizer = baseline_llm.tokenizer
    rewrite = [{"role": "user", "content": "Repeat this code exactly:\n" + CODE}]
    text = tokenizer.apply_chat_template(rewrite, add_generation_prompt=True)
    return _prompts(tokenizer) + [tokenizer.encode(text, add_special_tokens=False)]


@pytest.fixture(scope="module")
def reference(baseline_llm: LLM, prompts) -> list[list[int]]:
    return _token_ids(baseline_llm.generate(prompts, GREEDY))


def _token_ids(results) -> list[list[int]]:
    return [result.outputs[0].token_ids for result in results]


def _assert_all_blocks_free(llm: LLM) -> None:
    stats = llm.stats()
    assert stats.num_kv_blocks_free == stats.num_kv_blocks_total


def _assert_speculated(llm: LLM, min_acceptance: float = 0.0) -> None:
    stats = llm.stats()
    assert stats.num_spec_verify_steps > 0
    assert stats.num_spec_proposed_tokens >= stats.num_spec_verify_steps
    assert stats.spec_acceptance_rate >= min_acceptance


# make test stays well under 15 min: ngram under chunking and prefix hits, ~10 s; self-speculation
# and abort stay in make test
@pytest.mark.slow
def test_ngram_greedy_identical_with_chunked_prefill_and_prefix_cache(prompts, reference):
    llm = LLM(
        kv_cache_bytes=128 * 2**20,
        speculative_method="ngram",
        speculative_max_batch_size=16,
        max_num_batched_tokens=64,
        long_prefill_token_threshold=32,
    )
    assert _token_ids(llm.generate(prompts, GREEDY)) == reference
    _assert_speculated(llm, min_acceptance=0.2)
    # Again from the prefix cache: blocks that held rejected drafts must not be reused wrongly.
    assert _token_ids(llm.generate(prompts, GREEDY)) == reference
    assert llm.stats().prefix_cache_hit_tokens > 0
    _assert_all_blocks_free(llm)


@pytest.mark.slow  # ~7 s; the fast suite measured 14:32 on a quiet evening
def test_ngram_greedy_identical_in_a_pool_that_preempts(prompts, reference):
    llm = LLM(
        num_blocks_override=48,
        kv_cache_bytes=128 * 2**20,
        enable_prefix_caching=False,
        speculative_method="ngram",
        speculative_max_batch_size=16,
    )
    assert _token_ids(llm.generate(prompts, GREEDY)) == reference
    assert llm.stats().num_preemptions > 0, "the pool was meant to be too small"
    _assert_speculated(llm)
    _assert_all_blocks_free(llm)


def test_self_speculative_greedy_identical(prompts, reference):
    llm = LLM(
        kv_cache_bytes=128 * 2**20,
        speculative_method="self",
        speculative_draft_layers=12,
        num_speculative_tokens=3,
        speculative_max_batch_size=16,
    )
    assert _token_ids(llm.generate(prompts, GREEDY)) == reference
    _assert_speculated(llm)
    _assert_all_blocks_free(llm)


@pytest.mark.slow  # ~12 s (a SmolLM2 draft); the fast suite measured 14:32 on a quiet evening
def test_draft_model_greedy_identical_when_the_draft_is_the_target(
    prompts, reference, smollm2_gguf_path
):
    llm = LLM(
        num_blocks_override=48,
        kv_cache_bytes=128 * 2**20,
        speculative_method="draft",
        speculative_draft_model=smollm2_gguf_path,
        speculative_max_batch_size=16,
    )
    assert _token_ids(llm.generate(prompts, GREEDY)) == reference
    # The same weights propose what the target picks (bar float round-off between paths).
    _assert_speculated(llm, min_acceptance=0.9)
    _assert_all_blocks_free(llm)


@pytest.mark.slow  # make test stays well under 15 min: a second draft model, ~7 s
def test_random_draft_model_greedy_identical(prompts, reference, tiny_hf_checkpoint):
    llm = LLM(
        kv_cache_bytes=128 * 2**20,
        speculative_method="draft",
        speculative_draft_model=tiny_hf_checkpoint,
        num_speculative_tokens=2,
        speculative_max_batch_size=16,
        speculative_adaptive=False,
    )
    assert _token_ids(llm.generate(prompts[-3:], GREEDY)) == reference[-3:]
    _assert_speculated(llm)
    _assert_all_blocks_free(llm)


@pytest.mark.parametrize(
    "condition", [pytest.param("max_tokens", marks=pytest.mark.slow), "stop_token"]
)
def test_stop_conditions_cut_accepted_runs(baseline_llm, prompts, condition):
    prompt = prompts[-1]  # the code copy: long accepted runs
    params = SamplingParams(temperature=0.0, max_tokens=7, ignore_eos=True)
    if condition == "stop_token":
        # Stop on a token the greedy output reaches part-way through.
        plain = baseline_llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=40))
        stop_token = plain[0].outputs[0].token_ids[13]
        params = SamplingParams(temperature=0.0, max_tokens=40, stop_token_ids=[stop_token])
    expected = baseline_llm.generate([prompt], params)[0].outputs[0]
    llm = LLM(kv_cache_bytes=64 * 2**20, speculative_method="ngram", num_speculative_tokens=6)
    got = llm.generate([prompt], params)[0].outputs[0]
    assert got.token_ids == expected.token_ids
    assert got.text == expected.text and got.finish_reason == expected.finish_reason
    _assert_speculated(llm, min_acceptance=0.3)
    _assert_all_blocks_free(llm)


def test_abort_mid_speculation_frees_every_block(prompts):
    llm = LLM(kv_cache_bytes=64 * 2**20, speculative_method="ngram")
    stream = llm.stream(prompts[-1], SamplingParams(temperature=0.0, max_tokens=60))
    for _, delta in zip(range(8), stream):
        assert not delta.finished
    stream.close()
    _assert_speculated(llm)
    _assert_all_blocks_free(llm)


# ---- distribution ----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def peaked_tiny_checkpoint(tmp_path_factory, hf_reference_tokenizer) -> str:
    """A tiny random Llama whose next-token distributions are peaked (large initial weights),
    so a handful of tokens carry most of the mass and a chi-square test has power."""
    from transformers import LlamaConfig, LlamaForCausalLM

    directory = tmp_path_factory.mktemp("peaked_tiny")
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        initializer_range=0.5,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(1)
    LlamaForCausalLM(config).save_pretrained(str(directory), safe_serialization=True)
    hf_reference_tokenizer.save_pretrained(str(directory))
    return str(directory)


NUM_SEEDS = 500


def _sampled_tokens(llm: LLM) -> tuple[list[int], list[int]]:
    prompt = [10, 11, 12, 13] * 4
    params = [
        SamplingParams(temperature=1.0, max_tokens=4, seed=seed, ignore_eos=True)
        for seed in range(NUM_SEEDS)
    ]
    outputs = [r.outputs[0].token_ids for r in llm.generate([prompt] * NUM_SEEDS, params)]
    # Token 0 comes from the prefill; tokens 1-3 from verification passes.
    return [o[1] for o in outputs], [o[3] for o in outputs]


RARE_TOKEN_BINS = 8


def _homogeneity_p_value(a: list[int], b: list[int]) -> float:
    """Chi-square test that two samples come from one distribution. Rare tokens are pooled in
    bins by token id modulo 8 (any fixed partition keeps the test valid): at the fourth token
    the distribution is broad (400+ distinct tokens in 500 draws), and pooled into one bin
    there could be no category left to compare."""
    tokens = sorted(set(a) | set(b))
    counts = torch.tensor([[a.count(t), b.count(t)] for t in tokens], dtype=torch.float64)
    common = counts.sum(dim=1) >= 10
    rare_bins = torch.zeros(RARE_TOKEN_BINS, 2, dtype=torch.float64)
    for token, row in zip(tokens, counts):
        if row.sum() < 10:
            rare_bins[token % RARE_TOKEN_BINS] += row
    table = torch.cat([counts[common], rare_bins])
    table = table[table.sum(dim=1) > 0]
    expected = table.sum(dim=1, keepdim=True) * table.sum(dim=0, keepdim=True) / table.sum()
    statistic = ((table - expected) ** 2 / expected).sum()
    dof = torch.tensor(float(table.shape[0] - 1), dtype=torch.float64)
    return float(torch.special.gammaincc(dof / 2, statistic / 2))


@pytest.fixture(scope="module")
def plain_samples(peaked_tiny_checkpoint) -> tuple[list[int], list[int]]:
    return _sampled_tokens(LLM(peaked_tiny_checkpoint, kv_cache_bytes=64 * 2**20))


@pytest.mark.slow  # thousands of samples per method: ~15 s on 2 cores
@pytest.mark.parametrize("method", ["self", "draft"])
def test_sampling_follows_the_target_distribution(method, peaked_tiny_checkpoint, plain_samples):
    options = {"speculative_draft_layers": 1}
    if method == "draft":  # the target as its own draft: nearly every draft accepted
        options = {"speculative_draft_model": peaked_tiny_checkpoint}
    llm = LLM(
        peaked_tiny_checkpoint,
        kv_cache_bytes=64 * 2**20,
        speculative_method=method,
        num_speculative_tokens=3,
        speculative_max_batch_size=NUM_SEEDS,
        speculative_adaptive=False,
        **options,
    )
    second, fourth = _sampled_tokens(llm)
    _assert_speculated(llm)
    stats = llm.stats()
    assert 0 < stats.num_spec_accepted_tokens < stats.num_spec_proposed_tokens or method == "draft"
    assert len(set(plain_samples[0])) > 3, "the target should not be near-deterministic"
    assert _homogeneity_p_value(second, plain_samples[0]) > 1e-3
    assert _homogeneity_p_value(fourth, plain_samples[1]) > 1e-3
    _assert_all_blocks_free(llm)


def test_homogeneity_test_has_power(plain_samples):
    shifted = [token + 1 for token in plain_samples[0]]
    assert _homogeneity_p_value(shifted, plain_samples[0]) < 1e-6


@pytest.mark.slow  # make test stays well under 15 min: ~6 s; the stop-token cut stays in make test
def test_a_stop_string_inside_an_accepted_run_cuts_tokens_and_text_alike(baseline_llm, prompts):
    """Verification can accept several tokens past the one that completes a stop string:
    text, token ids and logprobs must all end where the stop string ends, as without
    speculation."""
    rewrite = prompts[-1]
    plain = baseline_llm.generate([rewrite], GREEDY)[0].outputs[0]
    # A stop string from the middle of what the model writes, so it lands inside a long
    # accepted run of copied code.
    stop = plain.text[len(plain.text) // 2 :][:12]
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, stop=[stop], logprobs=1)
    expected = baseline_llm.generate([rewrite], params)[0].outputs[0]
    llm = LLM(
        kv_cache_bytes=128 * 2**20,
        speculative_method="ngram",
        num_speculative_tokens=8,
        speculative_max_batch_size=16,
    )
    got = llm.generate([rewrite], params)[0].outputs[0]
    _assert_speculated(llm, min_acceptance=0.2)
    assert got.finish_reason == expected.finish_reason == "stop"
    assert got.text == expected.text
    assert got.token_ids == expected.token_ids
    assert len(got.logprobs) == len(got.token_ids)
    _assert_all_blocks_free(llm)
