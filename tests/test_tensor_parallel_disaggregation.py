"""KV pages between pods of different parallel layouts: a prefill engine and a decode engine
in one process (as tests/test_disaggregation_engine.py), one of them TP=2 or PP=2. Pages
travel in the model's layout; each rank gets exactly its heads (TP) or layers (PP), so the
output equals one single-process engine doing both."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine.llm import LLM
from splitserve.engine.parallel.layout import TensorParallelLayout
from splitserve.engine.parallel.pipeline import PipelineLayout
from splitserve.engine.sampling_params import SamplingParams
from tests.test_disaggregation_engine import disaggregated

KV_BYTES = 8 * 2**20
ONE_THREAD = {"num_threads": 1, "adaptive_threads": False}
PARAMS = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
TEXTS = ["The lighthouse keeper climbed the stairs every evening and", "List three colours:"]


@pytest.fixture(scope="module")
def pods(tiny_hf_checkpoint):
    """Engines of the tiny model (2 layers, 4 heads, 2 KV heads: one per TP rank, one layer
    per PP stage) by layout; block_size 4 so prompts span several blocks."""
    options = {"kv_cache_bytes": KV_BYTES, "block_size": 4, **ONE_THREAD}
    engines = {
        "reference": LLM(tiny_hf_checkpoint, **options),
        "single": LLM(tiny_hf_checkpoint, **options),
        "tp2": LLM(tiny_hf_checkpoint, tensor_parallel_size=2, **options),
        "pp2": LLM(tiny_hf_checkpoint, pipeline_parallel_size=2, **options),
    }
    yield engines
    for llm in engines.values():
        llm.close()


@pytest.mark.parametrize(
    ("prefill_pod", "decode_pod"),
    [("single", "tp2"), ("tp2", "single"), ("pp2", "tp2"), ("single", "pp2")],
)
def test_disaggregated_across_layouts_equals_colocated(pods, prefill_pod, decode_pod):
    reference, prefill, decode = pods["reference"], pods[prefill_pod], pods[decode_pod]
    direction = f"{prefill_pod}->{decode_pod}"
    for i, text in enumerate(TEXTS):
        prompt = reference.tokenizer.encode(text)
        expected = reference.generate([prompt], PARAMS)[0].outputs[0].token_ids
        rid = f"{direction}-{i}"
        plan, final = disaggregated(prefill.engine, decode.engine, rid, prompt, PARAMS)
        # The model's layers and KV heads on the wire, not a rank's.
        assert (plan.page_shape[1], plan.page_shape[4]) == (2, 2)
        assert final.token_ids == expected
    for pod in (prefill, decode):
        assert pod.stats().num_kv_blocks_free == pod.stats().num_kv_blocks_total


@pytest.mark.parametrize(("num_kv_heads", "tp_size"), [(2, 2), (4, 2), (1, 2), (3, 3), (2, 4)])
def test_heads_cut_per_rank_join_back_to_the_same_pages(num_kv_heads, tp_size):
    layout = TensorParallelLayout(tp_size, 0, 12, num_kv_heads, 8, 24)
    pages = torch.randn(3, 2, 2, 4, num_kv_heads, 8)
    parts = layout.split_pages(pages)
    for rank, part in enumerate(parts):
        heads = list(layout.kv_heads_of(rank))
        assert torch.equal(part, pages[..., heads, :])  # each rank exactly its heads
    assert torch.equal(layout.join_pages(parts), pages)


def test_layers_cut_per_stage_join_back_to_the_same_pages():
    layout = PipelineLayout(pp_size=3, rank=0, num_layers=6)
    pages = torch.randn(3, 6, 2, 4, 2, 8)
    parts = layout.split_pages(pages)
    assert [torch.equal(part, pages[:, 2 * r : 2 * r + 2]) for r, part in enumerate(parts)] == [
        True
    ] * 3
    assert torch.equal(layout.join_pages(parts), pages)
