"""Tensor parallelism inside one engine (shared/parallel/): greedy output equals TP=1 token for
token, through chunked prefill, prefix caching and preemption; a dead rank fails the step.

Ranks are real processes on a gloo group over loopback, one torch thread each."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from splitserve.engine.llm import LLM
from splitserve.engine.parallel.group import ParallelError
from splitserve.engine.sampling_params import SamplingParams

KV_BYTES = 8 * 2**20
GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
ONE_THREAD = {"num_threads": 1, "adaptive_threads": False}


@pytest.fixture(scope="module")
def tiny_gqa_checkpoint(make_tiny_hf_checkpoint) -> str:
    """4 query heads, 1 KV head: TP=2 replicates the KV head on both ranks."""
    return make_tiny_hf_checkpoint(num_key_value_heads=1)


def _prompts(llm: LLM) -> list[list[int]]:
    texts = [
        "The quick brown fox jumps over the lazy dog, again and again, until",
        "Once upon a time",
        "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20,",
    ]
    return [llm.tokenizer.encode(text) for text in texts]


def _tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [r.outputs[0].token_ids for r in llm.generate(prompts, GREEDY)]


@pytest.fixture(scope="module")
def tp1(tiny_gqa_checkpoint) -> LLM:
    return LLM(tiny_gqa_checkpoint, kv_cache_bytes=KV_BYTES, **ONE_THREAD)


def test_tp2_greedy_equals_tp1_with_chunked_prefill_and_prefix_hits(tiny_gqa_checkpoint, tp1):
    prompts = _prompts(tp1)
    expected = _tokens(tp1, prompts)
    llm = LLM(
        tiny_gqa_checkpoint,
        kv_cache_bytes=KV_BYTES,
        tensor_parallel_size=2,
        block_size=4,
        max_num_batched_tokens=8,  # every prompt is prefilled in several chunks
        **ONE_THREAD,
    )
    try:
        assert _tokens(llm, prompts) == expected
        hits_before = llm.engine.stats().prefix_cache_hit_tokens
        assert _tokens(llm, prompts[:1]) == expected[:1]  # the same prompt again: cached
        assert llm.engine.stats().prefix_cache_hit_tokens > hits_before
    finally:
        llm.close()


def test_tp2_greedy_equals_tp1_under_preemption(tiny_gqa_checkpoint, tp1):
    prompts = [[17 + i] * (30 + i) for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    expected = [r.outputs[0].token_ids for r in tp1.generate(prompts, params)]
    llm = LLM(
        tiny_gqa_checkpoint,
        kv_cache_bytes=KV_BYTES,
        tensor_parallel_size=2,
        num_blocks_override=12,  # the four requests need 20 blocks of 16 tokens together
        enable_prefix_caching=False,
        **ONE_THREAD,
    )
    try:
        assert [r.outputs[0].token_ids for r in llm.generate(prompts, params)] == expected
        assert llm.engine.stats().num_preemptions > 0, "the pool was meant to be too small"
    finally:
        llm.close()


def test_a_killed_rank_fails_the_step_instead_of_hanging(tiny_gqa_checkpoint):
    llm = LLM(tiny_gqa_checkpoint, kv_cache_bytes=KV_BYTES, tensor_parallel_size=2, **ONE_THREAD)
    try:
        (worker,) = llm.engine.parallel.processes
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(10)
        start = time.monotonic()
        with pytest.raises(ParallelError, match="rank 1 .*died"):
            llm.generate(_prompts(llm)[:1], GREEDY)
        assert time.monotonic() - start < 10
        with pytest.raises(ParallelError):  # and every later step too, at once
            llm.generate(_prompts(llm)[:1], GREEDY)
    finally:
        llm.close()


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"tensor_parallel_size": 3}, "tensor_parallel_size 3 must divide the model's 4 attention"),
        ({"tensor_parallel_size": 0}, "tensor_parallel_size must be an integer >= 1, got 0"),
        (
            {"tensor_parallel_size": 2, "speculative_method": "self"}
            | {"speculative_draft_layers": 1},
            "'self' does not support tensor_parallel_size 2",
        ),
    ],
)
def test_sizes_that_do_not_split_the_model_are_rejected(tiny_gqa_checkpoint, options, message):
    with pytest.raises(ValueError, match=message):
        LLM(tiny_gqa_checkpoint, kv_cache_bytes=KV_BYTES, **options)


def test_tp2_greedy_equals_tp1_with_ngram_speculation(tiny_gqa_checkpoint, tp1):
    """Verification chunks (several logits rows per request) go through the same broadcast."""
    prompts = [[5, 6, 7, 8] * 6, [9, 10, 11] * 7]
    expected = _tokens(tp1, prompts)
    llm = LLM(
        tiny_gqa_checkpoint,
        kv_cache_bytes=KV_BYTES,
        tensor_parallel_size=2,
        speculative_method="ngram",
        speculative_adaptive=False,
        **ONE_THREAD,
    )
    try:
        assert _tokens(llm, prompts) == expected
        assert llm.engine.stats().num_spec_proposed_tokens > 0
    finally:
        llm.close()


@pytest.mark.slow
def test_tp3_smollm2_greedy_equals_tp1():
    """SmolLM2-135M: 9 heads and 3 KV heads, one KV head per rank."""
    tp1 = LLM(kv_cache_bytes=KV_BYTES, **ONE_THREAD)
    prompts = _prompts(tp1)[:2]
    expected = _tokens(tp1, prompts)
    llm = LLM(
        kv_cache_bytes=KV_BYTES, tensor_parallel_size=3, max_num_batched_tokens=16, **ONE_THREAD
    )
    try:
        assert _tokens(llm, prompts) == expected
    finally:
        llm.close()


def test_a_step_packs_into_one_tensor_and_back():
    from splitserve.engine.parallel.step_tensors import ChunkView, pack_chunks, unpack_chunks

    chunks = [
        ChunkView(7, 1, 1, [42], [3, 9]),
        ChunkView(0, 5, 1, [1, 2, 3, 4, 5], [4, 8, 2]),
        ChunkView(16, 3, 3, [6, 7, 8], [1]),  # a verification chunk: 3 logits rows
    ]
    payload = pack_chunks(chunks)
    assert payload.dtype == torch.int64 and payload.dim() == 1
    assert unpack_chunks(payload, len(chunks)) == chunks
