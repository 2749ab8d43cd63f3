"""Tensor and pipeline parallel together (shared/parallel/grid.py): the tiny checkpoint (2
layers, 4 heads, 2 KV heads) on TP=2 x PP=2, four ranks: two stages of two tensor-parallel
ranks each. Greedy output equals transformers token for token through chunked prefill and a
prefix-cache hit; a disaggregated request between a single-process engine and the grid equals
the colocated output both ways, each rank getting exactly its heads of its layers.

Four processes on a 2-core machine: one torch thread each, few tokens."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from splitserve.engine.config import ParallelConfig
from splitserve.engine.llm import LLM
from splitserve.engine.parallel.grid import GridLayout
from splitserve.engine.parallel.group import ParallelError
from splitserve.engine.parallel.layout import TensorParallelLayout
from splitserve.engine.parallel.pipeline import PipelineLayout
from splitserve.engine.sampling_params import SamplingParams
from tests.hf_reference import greedy_references
from tests.test_disaggregation_engine import disaggregated

KV_BYTES = 8 * 2**20
ONE_THREAD = {"num_threads": 1, "adaptive_threads": False}
GRID = {"tensor_parallel_size": 2, "pipeline_parallel_size": 2}
MAX_TOKENS = 8
EOS_TOKEN_ID = 2  # the tiny checkpoint's
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
TEXTS = [
    "The lighthouse keeper climbed the stairs every evening and trimmed the wick, then",
    "List three colours:",
]


@pytest.fixture(scope="module")
def single(tiny_hf_checkpoint):
    llm = LLM(tiny_hf_checkpoint, kv_cache_bytes=KV_BYTES, block_size=4, **ONE_THREAD)
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def grid(tiny_hf_checkpoint):
    # Chunks of 8 tokens in blocks of 4: the long prompt takes several steps beside decodes.
    llm = LLM(
        tiny_hf_checkpoint,
        kv_cache_bytes=KV_BYTES,
        block_size=4,
        max_num_batched_tokens=8,
        **GRID,
        **ONE_THREAD,
    )
    yield llm
    llm.close()


@pytest.fixture(scope="module")
def references(tiny_hf_checkpoint, single) -> list[tuple[list[int], list[int]]]:
    """(prompt, transformers' greedy tokens up to EOS) per text."""
    prompts = [single.tokenizer.encode(text) for text in TEXTS]
    tokens = greedy_references(tiny_hf_checkpoint, prompts, MAX_TOKENS, EOS_TOKEN_ID)
    return list(zip(prompts, tokens, strict=True))


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [r.outputs[0].token_ids for r in llm.generate(prompts, GREEDY)]


def test_tp2_pp2_greedy_equals_transformers_with_chunked_prefill_and_a_prefix_hit(
    grid, references
):
    prompts = [prompt for prompt, _ in references]
    assert _greedy(grid, prompts) == [tokens for _, tokens in references]
    hits = grid.stats().prefix_cache_hit_tokens
    assert _greedy(grid, prompts[:1]) == [references[0][1]]  # again, from the prefix cache
    assert grid.stats().prefix_cache_hit_tokens > hits


def test_each_rank_holds_its_stage_layers_and_its_heads(grid):
    layout = grid.engine.parallel.layout
    assert isinstance(layout, GridLayout) and layout.world_size == 4
    model = grid.engine.runner.model  # rank 0: stage 0's one layer, 2 of the 4 query heads
    assert (len(model.layers), model.arch.num_heads, model.arch.num_kv_heads) == (1, 2, 1)
    assert grid.engine.runner.kv_cache.shape[0] == 1 and grid.engine.runner.kv_cache.shape[4] == 1
    # The stage's all-reduces run on a group of its two ranks, not the pod's four.
    stage_comm = model.layers[0].self_attn.tensor_parallel
    assert stage_comm is not grid.engine.parallel.comm and stage_comm.world_size == 2
    ranks = [layout.of_rank(r) for r in range(4)]
    assert [(r.pipeline.stage, r.tensor.rank) for r in ranks] == [(0, 0), (0, 1), (1, 0), (1, 1)]


@pytest.mark.parametrize(("prefill_pod", "decode_pod"), [("single", "grid"), ("grid", "single")])
def test_disaggregated_between_tp1_and_tp2_pp2_equals_colocated(
    single, grid, prefill_pod, decode_pod
):
    pods = {"single": single, "grid": grid}
    prefill, decode = pods[prefill_pod], pods[decode_pod]
    for i, text in enumerate(TEXTS):
        prompt = single.tokenizer.encode(text)
        expected = single.generate([prompt], GREEDY)[0].outputs[0].token_ids
        rid = f"{prefill_pod}->{decode_pod}-{i}"
        plan, final = disaggregated(prefill.engine, decode.engine, rid, prompt, GREEDY)
        # The model's layers and KV heads on the wire, not a rank's.
        assert (plan.page_shape[1], plan.page_shape[4]) == (2, 2)
        assert final.token_ids == expected
    for pod in (prefill, decode):
        assert pod.stats().num_kv_blocks_free == pod.stats().num_kv_blocks_total


@pytest.mark.slow  # four more processes; the fast suite is near its limit
def test_tp2_pp2_greedy_equals_tp1_under_preemption(tiny_hf_checkpoint, single):
    # Three requests of 20-22 tokens that need 15 blocks of 4 together with their outputs.
    prompts = [[17 + i] * (20 + i) for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    expected = [r.outputs[0].token_ids for r in single.generate(prompts, params)]
    llm = LLM(
        tiny_hf_checkpoint,
        kv_cache_bytes=KV_BYTES,
        block_size=4,
        num_blocks_override=12,
        enable_prefix_caching=False,
        **GRID,
        **ONE_THREAD,
    )
    try:
        assert [r.outputs[0].token_ids for r in llm.generate(prompts, params)] == expected
        assert llm.engine.stats().num_preemptions > 0, "the pool was meant to be too small"
    finally:
        llm.close()


@pytest.mark.slow  # starts and kills a four-process grid
def test_a_killed_rank_of_the_last_stage_fails_the_step(tiny_hf_checkpoint):
    """Rank 3 (stage 1, tp rank 1) never talks to rank 0 but through broadcasts: its death
    still fails rank 0's step (its stage peer's all-reduce fails, then rank 0's receive)."""
    llm = LLM(tiny_hf_checkpoint, kv_cache_bytes=KV_BYTES, **GRID, **ONE_THREAD)
    try:
        worker = llm.engine.parallel.processes[2]  # ranks 1..3
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(10)
        start = time.monotonic()
        with pytest.raises(ParallelError, match="rank 3 .*died"):
            llm.generate([[5, 6, 7]], GREEDY)
        assert time.monotonic() - start < 20
    finally:
        llm.close()


@pytest.mark.slow  # two more four-process grids
def test_int8_pages_cross_into_and_out_of_the_grid(tiny_hf_checkpoint):
    """kv_cache_dtype int8: each row's codes and scale are cut with their head."""
    options = {"kv_cache_bytes": KV_BYTES, "kv_cache_dtype": "int8", **ONE_THREAD}
    single = LLM(tiny_hf_checkpoint, **options)
    grid = LLM(tiny_hf_checkpoint, **GRID, **options)
    try:
        prompt = single.tokenizer.encode(TEXTS[0])
        expected = single.generate([prompt], GREEDY)[0].outputs[0].token_ids
        for prefill, decode, name in ((single, grid, "1-grid"), (grid, single, "grid-1")):
            plan, got = disaggregated(prefill.engine, decode.engine, name, prompt, GREEDY)
            assert plan.dtype == torch.int8 and plan.page_shape[1:] == (2, 2, 16, 2, 16 + 2)
            assert got.token_ids == expected, name
    finally:
        grid.close()
        single.close()


@pytest.mark.parametrize(("num_kv_heads", "tp_size", "pp_size"), [(2, 2, 2), (1, 2, 3), (4, 2, 2)])
def test_pages_cut_per_rank_by_layers_then_heads_join_back(num_kv_heads, tp_size, pp_size):
    num_layers = 2 * pp_size
    pipeline = PipelineLayout(pp_size, 0, num_layers, tp_size)
    layout = GridLayout(TensorParallelLayout(tp_size, 0, 8, num_kv_heads, 8, 24), pipeline)
    pages = torch.randn(3, num_layers, 2, 4, num_kv_heads, 8)
    parts = layout.split_pages(pages)
    assert len(parts) == tp_size * pp_size
    for rank, part in enumerate(parts):
        rank_layout = layout.of_rank(rank)
        layers = list(pipeline.layers_of(rank // tp_size))
        heads = list(rank_layout.tensor.kv_heads)
        assert torch.equal(part, pages[:, layers][..., heads, :])  # exactly its heads and layers
    assert torch.equal(layout.join_pages(parts), pages)


def test_the_config_accepts_tp_with_pp_and_counts_the_grid():
    assert ParallelConfig(tensor_parallel_size=2, pipeline_parallel_size=3).world_size == 6


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"tensor_parallel_size": 3, "pipeline_parallel_size": 2}, "tensor_parallel_size 3"),
        ({"tensor_parallel_size": 2, "pipeline_parallel_size": 3}, "pipeline_parallel_size 3"),
    ],
)
def test_grid_sizes_that_do_not_split_the_model_are_refused(tiny_hf_checkpoint, options, message):
    with pytest.raises(ValueError, match=message):
        LLM(tiny_hf_checkpoint, kv_cache_bytes=KV_BYTES, **options)


def test_expert_parallel_with_stages_stays_refused():
    with pytest.raises(ValueError, match="pipeline_parallel_size 2"):
        ParallelConfig(**GRID, enable_expert_parallel=True)


def test_mixture_of_experts_with_stages_stays_refused(make_tiny_moe_checkpoint):
    with pytest.raises(ValueError, match="pipeline_parallel_size 2 does not support"):
        LLM(make_tiny_moe_checkpoint("mixtral"), kv_cache_bytes=KV_BYTES, **GRID)
