"""KV pages between pods of different tensor-parallel layouts: a prefill engine and a decode
engine in one process (as tests/test_disaggregation_engine.py), one of them TP=2. Pages travel
in the model's layout; each TP rank gets exactly its heads, so the output equals one TP=1
engine doing both."""

from __future__ import annotations

import pytest
import torch

from shared.llm import LLM
from shared.parallel.layout import TensorParallelLayout
from shared.parallel.pages import join_heads, split_heads
from shared.sampling_params import SamplingParams
from tests.test_disaggregation_engine import disaggregated

KV_BYTES = 8 * 2**20
ONE_THREAD = {"num_threads": 1, "adaptive_threads": False}
PARAMS = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
TEXTS = ["The lighthouse keeper climbed the stairs every evening and", "List three colours:"]


@pytest.fixture(scope="module")
def pods(tiny_hf_checkpoint):
    """A TP=1 and a TP=2 engine of the tiny model (4 heads, 2 KV heads: one per rank), and a
    TP=1 reference; block_size 4 so prompts span several blocks."""
    options = {"kv_cache_bytes": KV_BYTES, "block_size": 4, **ONE_THREAD}
    tp1, reference = LLM(tiny_hf_checkpoint, **options), LLM(tiny_hf_checkpoint, **options)
    tp2 = LLM(tiny_hf_checkpoint, tensor_parallel_size=2, **options)
    yield reference, tp1, tp2
    tp2.close()


@pytest.mark.parametrize("direction", ["P1->D2", "P2->D1"])
def test_disaggregated_across_layouts_equals_colocated(pods, direction):
    reference, tp1, tp2 = pods
    prefill, decode = (tp1, tp2) if direction == "P1->D2" else (tp2, tp1)
    for i, text in enumerate(TEXTS):
        prompt = reference.tokenizer.encode(text)
        expected = reference.generate([prompt], PARAMS)[0].outputs[0].token_ids
        rid = f"{direction}-{i}"
        plan, final = disaggregated(prefill.engine, decode.engine, rid, prompt, PARAMS)
        assert plan.page_shape[4] == 2  # the model's KV heads on the wire, not a rank's
        assert final.token_ids == expected
    for pod in (prefill, decode):
        assert pod.stats().num_kv_blocks_free == pod.stats().num_kv_blocks_total


@pytest.mark.parametrize(("num_kv_heads", "tp_size"), [(2, 2), (4, 2), (1, 2), (3, 3), (2, 4)])
def test_heads_cut_per_rank_join_back_to_the_same_pages(num_kv_heads, tp_size):
    layout = TensorParallelLayout(tp_size, 0, 12, num_kv_heads, 8, 24)
    pages = torch.randn(3, 2, 2, 4, num_kv_heads, 8)
    parts = split_heads(pages, layout)
    for rank, part in enumerate(parts):
        heads = list(layout.kv_heads_of(rank))
        assert torch.equal(part, pages[..., heads, :])  # each rank exactly its heads
    assert torch.equal(join_heads(parts, layout), pages)
