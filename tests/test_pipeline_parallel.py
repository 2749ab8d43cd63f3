"""Pipeline parallelism inside one engine (shared/parallel/pipeline.py): the tiny model's two
layers on two ranks; greedy output equals PP=1 token for token, through chunked prefill,
prefix caching and preemption."""

from __future__ import annotations

import pytest

from splitserve.engine.llm import LLM
from splitserve.engine.sampling_params import SamplingParams

KV_BYTES = 8 * 2**20
ONE_THREAD = {"num_threads": 1, "adaptive_threads": False}
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
# Four requests of 30-33 tokens that need 20 blocks of 16 together.
PROMPTS = [[17 + i] * (30 + i) for i in range(4)]


def _tokens(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [r.outputs[0].token_ids for r in llm.generate(prompts, GREEDY)]


@pytest.fixture(scope="module")
def expected(tiny_hf_checkpoint) -> list[list[int]]:
    return _tokens(LLM(tiny_hf_checkpoint, kv_cache_bytes=KV_BYTES, **ONE_THREAD), PROMPTS)


def test_pp2_greedy_equals_pp1_with_chunked_prefill_and_prefix_hits(tiny_hf_checkpoint, expected):
    llm = LLM(
        tiny_hf_checkpoint,
        kv_cache_bytes=KV_BYTES,
        pipeline_parallel_size=2,
        max_num_batched_tokens=24,  # prompts are prefilled in chunks
        **ONE_THREAD,
    )
    try:
        assert _tokens(llm, PROMPTS) == expected
        assert _tokens(llm, PROMPTS[:1]) == expected[:1]  # the same prompt again: cached
        assert llm.engine.stats().prefix_cache_hit_tokens > 0
    finally:
        llm.close()


def test_pp2_greedy_equals_pp1_under_preemption(tiny_hf_checkpoint, expected):
    llm = LLM(
        tiny_hf_checkpoint,
        kv_cache_bytes=KV_BYTES,
        pipeline_parallel_size=2,
        num_blocks_override=12,
        enable_prefix_caching=False,
        **ONE_THREAD,
    )
    try:
        assert _tokens(llm, PROMPTS) == expected
        assert llm.engine.stats().num_preemptions > 0, "the pool was meant to be too small"
    finally:
        llm.close()


def test_sizes_that_do_not_split_the_model_are_rejected(tiny_hf_checkpoint):
    # With tensor parallel too: tests/test_tensor_pipeline_parallel.py.
    with pytest.raises(ValueError, match="pipeline_parallel_size 3 must divide the model's 2"):
        LLM(tiny_hf_checkpoint, kv_cache_bytes=KV_BYTES, pipeline_parallel_size=3)


def test_a_step_is_cut_into_micro_batches_of_about_equal_tokens():
    from splitserve.engine.parallel.pipeline import split_micro_batches
    from splitserve.engine.parallel.step_tensors import ChunkView

    def chunk(num_tokens: int) -> ChunkView:
        return ChunkView(0, num_tokens, 1, [0] * num_tokens, [0])

    decodes = [chunk(1) for _ in range(4)]
    batches = split_micro_batches([*decodes, chunk(4), chunk(2)], 2)
    assert [[c.num_tokens for c in batch] for batch in batches] == [[1, 1, 1, 1, 4], [2]]
    assert split_micro_batches([chunk(9)], 2) == [[chunk(9)]]  # one chunk stays whole
    assert len(split_micro_batches(decodes, 3)) == 3


@pytest.mark.slow
def test_pp3_smollm2_greedy_equals_pp1():
    """Three stages of SmolLM2's 30 layers: micro-batches pass through a middle stage."""
    prompts = [[17 + i] * (20 + i) for i in range(5)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    reference = LLM(kv_cache_bytes=KV_BYTES, **ONE_THREAD)
    expected = [r.outputs[0].token_ids for r in reference.generate(prompts, params)]
    llm = LLM(kv_cache_bytes=KV_BYTES, pipeline_parallel_size=3, **ONE_THREAD)
    try:
        assert [r.outputs[0].token_ids for r in llm.generate(prompts, params)] == expected
    finally:
        llm.close()
