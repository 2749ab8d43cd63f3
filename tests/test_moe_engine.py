"""The engine on tiny random mixture-of-experts checkpoints (Mixtral and Qwen2-MoE shaped,
tests/conftest.py builds them):

- greedy tokens equal transformers' `generate` on the same directory, and the first step's
  logprobs its logits, for several prompts; also with chunked prefill (16-token budget) and
  with a prefix-cache hit on a repeated prompt;
- the per-expert counters move by exactly the token-expert assignments the steps made, and the
  pods' Prometheus series carries them;
- self-speculative decoding (a one-layer draft) keeps the greedy tokens;
- a disaggregated request (prefill engine exports pages, decode engine takes them) equals the
  colocated one;
- the Triton MoE path (grouped GEMM, in the interpreter) gives the same tokens as the CPU path.

torch runs single-threaded (see tests/test_engine_api.py for why).
"""

from __future__ import annotations

import os

import pytest
import torch
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from splitserve import LLM, SamplingParams
from splitserve.pod.metrics import PREFIX, PodMetrics
from tests.hf_reference import transformers_greedy
from tests.test_disaggregation_engine import disaggregated

FAMILIES = ["mixtral", "qwen2_moe"]
MAX_TOKENS = 10
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
KV_BYTES = 16 * 2**20
EOS_TOKEN_ID = 2
NUM_LAYERS, TOP_K = 2, 2  # the tiny checkpoints' config
_STORY = (
    "The lighthouse keeper had lived on the island for thirty years. Every evening he climbed "
    "the spiral stairs, trimmed the wick and watched the beam sweep across the dark water."
)
TEXTS = ["Hi", "def quicksort(items):", _STORY, _STORY * 3]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def checkpoint(family, make_tiny_moe_checkpoint) -> str:
    return make_tiny_moe_checkpoint(family)


@pytest.fixture(scope="module")
def llm(single_thread, checkpoint) -> LLM:
    return LLM(checkpoint, kv_cache_bytes=KV_BYTES)


@pytest.fixture(scope="module")
def references(checkpoint, llm) -> list[tuple[list[int], list[int], torch.Tensor]]:
    """(prompt, greedy tokens up to EOS, first-step log_softmax) per text, from transformers."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    out = []
    for text in TEXTS:
        prompt = llm.tokenizer.encode(text)
        tokens = transformers_greedy(model, prompt, MAX_TOKENS, eos_token_id=EOS_TOKEN_ID)
        with torch.no_grad():
            logprobs = torch.log_softmax(model(torch.tensor([prompt])).logits[0, -1], dim=-1)
        if EOS_TOKEN_ID in tokens:
            tokens = tokens[: tokens.index(EOS_TOKEN_ID) + 1]
        out.append((prompt, tokens, logprobs))
    return out


def _greedy(llm: LLM, prompts: list[list[int]]) -> list[list[int]]:
    return [r.outputs[0].token_ids for r in llm.generate(prompts, GREEDY)]


def test_architecture_is_the_family(llm, family):
    arch = llm.engine.architecture
    assert (arch.family, arch.moe.num_experts, arch.moe.num_experts_per_tok) == (family, 8, 2)
    assert arch.attention_bias == (family == "qwen2_moe")
    assert (arch.moe.shared_expert_intermediate_size > 0) == (family == "qwen2_moe")


def test_greedy_and_logprobs_match_transformers(llm, references):
    prompts = [prompt for prompt, _, _ in references]
    assert _greedy(llm, prompts) == [tokens for _, tokens, _ in references]
    first = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1, logprobs=10))
    for result, (_, _, expected) in zip(first, references):
        top = result.outputs[0].logprobs[0].top
        assert top[0][0] == int(expected.argmax())
        for token_id, value in top:
            assert value == pytest.approx(expected[token_id].item(), abs=2e-5)


def test_chunked_prefill_matches_transformers(single_thread, checkpoint, references):
    chunked = LLM(checkpoint, kv_cache_bytes=KV_BYTES, max_num_batched_tokens=16)
    prompts = [prompt for prompt, _, _ in references]
    assert max(len(p) for p in prompts) > 3 * 16, "the long prompt must take several chunks"
    assert _greedy(chunked, prompts) == [tokens for _, tokens, _ in references]


def test_self_speculative_decoding_keeps_the_greedy_tokens(single_thread, checkpoint, references):
    """The draft is the first layer (its MoE block included) and the head; verification runs
    1 + k rows per request through every layer."""
    options = {"speculative_method": "self", "speculative_draft_layers": 1}
    speculative = LLM(checkpoint, kv_cache_bytes=KV_BYTES, **options)
    prompts = [prompt for prompt, _, _ in references]
    assert _greedy(speculative, prompts) == [tokens for _, tokens, _ in references]
    assert speculative.stats().num_spec_proposed_tokens > 0


def test_prefix_cache_hit_gives_the_same_tokens(llm, references):
    prompt, tokens, _ = references[-1]
    hits = llm.stats().prefix_cache_hit_tokens
    assert _greedy(llm, [prompt]) == [tokens]
    assert _greedy(llm, [prompt]) == [tokens]
    assert llm.stats().prefix_cache_hit_tokens - hits >= len(prompt) // 2


def test_expert_counters_count_every_assignment(llm):
    """Each computed row (prompt tokens not found in the cache, then each fed-back output
    token) is routed to TOP_K experts in each of NUM_LAYERS layers."""
    prompt = llm.tokenizer.encode("A counted prompt about the sea, the wind and the keeper.")
    before = llm.stats()
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    llm.generate([prompt], params)
    after = llm.stats()
    hits = after.prefix_cache_hit_tokens - before.prefix_cache_hit_tokens
    rows = len(prompt) - hits + params.max_tokens - 1
    moved = [b - a for a, b in zip(before.moe_expert_tokens, after.moe_expert_tokens)]
    assert len(after.moe_expert_tokens) == 8
    assert sum(moved) == rows * TOP_K * NUM_LAYERS
    assert all(count >= 0 for count in moved)
    metrics = PodMetrics("decode", "tiny-moe", llm.stats)
    samples = {
        sample.labels["expert"]: sample.value
        for family in text_string_to_metric_families(generate_latest(metrics.registry).decode())
        for sample in family.samples
        if sample.name == PREFIX + "moe_expert_tokens_total"
    }
    expected = llm.stats().moe_expert_tokens
    assert samples == {str(expert): float(count) for expert, count in enumerate(expected)}


def test_disaggregated_request_equals_colocated(single_thread, checkpoint, llm, references):
    prefill, decode = (LLM(checkpoint, kv_cache_bytes=KV_BYTES) for _ in range(2))
    # The second prompt starts with the first: its pages already cached on the decode engine
    # are not sent (first_block_index > 0), the rest are.
    first_blocks = []
    for i, (prompt, tokens, _) in enumerate(references[2:]):
        plan, final = disaggregated(prefill.engine, decode.engine, f"moe-{i}", prompt, GREEDY)
        first_blocks.append(plan.first_block_index)
        assert final.token_ids == tokens
    assert first_blocks[0] == 0 and first_blocks[1] > 0
    assert decode.stats().num_kv_blocks_free == decode.stats().num_kv_blocks_total


@pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="runs the Triton path in the interpreter"
)
def test_triton_moe_path_gives_the_same_tokens(single_thread, checkpoint, references, monkeypatch):
    monkeypatch.setenv("SPLITSERVE_MOE_BACKEND", "triton")  # chosen at the first forward
    triton_llm = LLM(checkpoint, kv_cache_bytes=KV_BYTES)
    prompts = [prompt for prompt, _, _ in references[:3]]
    assert _greedy(triton_llm, prompts) == [tokens for _, tokens, _ in references[:3]]
