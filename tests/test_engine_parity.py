"""Greedy output of the engine equals Hugging Face transformers token for token.

Both load the same GGUF file. The eight parity prompts (benchmarks/parity_prompts.py: different
lengths, one over 600 tokens) go to one engine together, under several configurations: default,
32-token prefill chunks, a KV pool small enough to preempt, and a second pass served from the
prefix cache.
"""

from __future__ import annotations

import pytest
import torch

from benchmarks.parity_prompts import PARITY_MAX_TOKENS, parity_prompts
from splitserve import LLM, SamplingParams
from tests.hf_reference import transformers_greedy

MAX_TOKENS = PARITY_MAX_TOKENS


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(kv_cache_bytes=256 * 2**20, num_threads=torch.get_num_threads())


@pytest.fixture(scope="module")
def prompts(llm: LLM) -> list[list[int]]:
    return parity_prompts(llm.tokenizer)


@pytest.fixture(scope="module")
def reference(hf_reference_model, prompts) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, one at a time (no padding)."""
    return [transformers_greedy(hf_reference_model, prompt, MAX_TOKENS) for prompt in prompts]


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


def _token_ids(results) -> list[list[int]]:
    return [result.outputs[0].token_ids for result in results]


def test_greedy_matches_transformers_in_one_batch(llm, prompts, reference):
    results = llm.generate(prompts, GREEDY)
    assert _token_ids(results) == reference
    assert llm.stats().num_kv_blocks_free == llm.stats().num_kv_blocks_total


def test_second_pass_is_served_from_prefix_cache(llm, prompts, reference):
    llm.generate(prompts, GREEDY)  # makes sure every prompt's blocks are cached
    before = llm.stats().prefix_cache_hit_tokens
    results = llm.generate(prompts, GREEDY)
    assert _token_ids(results) == reference
    hits = [result.outputs[0].num_cached_tokens for result in results]
    long_prompt = max(range(len(prompts)), key=lambda i: len(prompts[i]))
    # All full blocks but the one holding the last prompt token come from the cache.
    assert hits[long_prompt] == (len(prompts[long_prompt]) - 1) // 16 * 16
    assert llm.stats().prefix_cache_hit_tokens - before == sum(hits)


def test_chunked_prefill_of_32_tokens_matches(prompts, reference):
    llm = LLM(
        kv_cache_bytes=256 * 2**20,
        max_num_batched_tokens=64,
        long_prefill_token_threshold=32,
        enable_prefix_caching=False,
    )
    results = llm.generate(prompts, GREEDY)
    assert _token_ids(results) == reference


def test_small_kv_pool_preempts_and_still_matches(prompts, reference):
    # The long prompt alone needs ~41 blocks; 48 cannot hold everyone at once.
    llm = LLM(num_blocks_override=48, kv_cache_bytes=256 * 2**20, enable_prefix_caching=False)
    results = llm.generate(prompts, GREEDY)
    assert llm.stats().num_preemptions > 0, "the pool was meant to be too small"
    assert _token_ids(results) == reference
    assert llm.stats().num_kv_blocks_free == 48
