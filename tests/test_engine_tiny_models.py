"""The engine on tiny random Llama checkpoints (tests/conftest.py builds them in a second).

- Greedy tokens equal transformers' `generate` on the same directory, for checkpoints that
  differ in how they load: untied embeddings with llama3 RoPE scaling, tied embeddings with
  plain RoPE, and bf16 weights sharded over several safetensors files.
- The engine in bfloat16 runs, and its first-step logits stay close to float32's.
- Seeded sampling gives the same tokens when preemption recomputes requests.
- `max_model_len` bounds prompt plus output.
- `AsyncLLM.shutdown` ends open streams instead of leaving them hanging (a lifecycle check that
  needs an engine, not a real model).

torch runs single-threaded (see tests/test_engine_api.py for why).
"""

from __future__ import annotations

import asyncio
import glob
import json
import os
from dataclasses import dataclass

import pytest
import torch
from safetensors import safe_open

from splitserve import LLM, AsyncLLM, SamplingParams

MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
KV_BYTES = 16 * 2**20
EOS_TOKEN_ID = 2  # the tiny checkpoints' config

_STORY = (
    "The lighthouse keeper had lived on the island for thirty years. Every evening he climbed "
    "the spiral stairs, trimmed the wick and watched the beam sweep across the dark water."
)

CHECKPOINTS = {
    "untied-llama3-rope": {},
    "tied-plain-rope": {"tie_word_embeddings": True, "rope_scaling": None},
    "sharded-bf16": {"dtype": "bfloat16", "max_shard_size": "100KB"},
}


@pytest.fixture(params=list(CHECKPOINTS), scope="module")
def checkpoint(request, make_tiny_hf_checkpoint) -> str:
    directory = make_tiny_hf_checkpoint(**CHECKPOINTS[request.param])
    _check_checkpoint_is_what_it_claims(directory, request.param)
    return directory


def _check_checkpoint_is_what_it_claims(directory: str, name: str) -> None:
    with open(os.path.join(directory, "config.json")) as f:
        config = json.load(f)
    files = sorted(glob.glob(os.path.join(directory, "*.safetensors")))
    with safe_open(files[0], "pt") as handle:
        stored_dtype = handle.get_slice(next(iter(handle.keys()))).get_dtype()
    tied = config.get("tie_word_embeddings", False)
    # transformers 5 writes "rope_parameters" (with rope_type "default" when unscaled).
    rope = config.get("rope_scaling") or config.get("rope_parameters") or {}
    scaling = rope.get("rope_type") if rope.get("rope_type") != "default" else None
    expected = {
        "untied-llama3-rope": (False, "llama3", False, "F32"),
        "tied-plain-rope": (True, None, False, "F32"),
        "sharded-bf16": (False, "llama3", True, "BF16"),
    }[name]
    assert (tied, scaling, len(files) > 1, stored_dtype) == expected


def _prompts(llm: LLM) -> list[list[int]]:
    prompts = [
        llm.tokenizer.encode("Hi"),
        llm.tokenizer.encode("def quicksort(items):"),
        llm.tokenizer.encode(_STORY),
        llm.tokenizer.encode(_STORY * 8),
    ]
    block_size = llm.config.cache.block_size
    assert len(prompts[0]) == 1 and len(prompts[2]) > 2 * block_size
    assert len(prompts[3]) > 256, "long enough for llama3 RoPE scaling to show in the logits"
    return prompts


@dataclass
class Reference:
    token_ids: list[int]  # greedy continuation, up to and including EOS
    first_logprobs: torch.Tensor  # [vocab] log_softmax of the logits after the prompt


def _transformers_reference(directory: str, prompts: list[list[int]]) -> list[Reference]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    references = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        with torch.no_grad():
            generated = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=MAX_TOKENS,
                do_sample=False,
                eos_token_id=EOS_TOKEN_ID,
                pad_token_id=EOS_TOKEN_ID,
            )
            logits = model(ids).logits[0, -1]
        tokens = generated[0, len(prompt) :].tolist()
        # After EOS transformers pads; the engine stops.
        if EOS_TOKEN_ID in tokens:
            tokens = tokens[: tokens.index(EOS_TOKEN_ID) + 1]
        references.append(Reference(tokens, torch.log_softmax(logits, dim=-1)))
    return references


def test_greedy_and_logprobs_match_transformers(single_thread, checkpoint):
    """Random tiny models barely use position (attention is near uniform), so greedy tokens
    alone would not notice wrong RoPE scaling; the logprobs do: dropping llama3 scaling moves
    the top 20 by 1.4e-4 after 264 tokens, 7x the tolerance; a correct engine is within 1e-6."""
    llm = LLM(checkpoint, kv_cache_bytes=KV_BYTES)
    prompts = _prompts(llm)
    references = _transformers_reference(checkpoint, prompts)
    results = llm.generate(prompts, GREEDY)
    assert [r.outputs[0].token_ids for r in results] == [ref.token_ids for ref in references]
    first_steps = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1, logprobs=20))
    for result, reference in zip(first_steps, references):
        top = result.outputs[0].logprobs[0].top
        expected = reference.first_logprobs
        for token_id, value in top:
            assert value == pytest.approx(expected[token_id].item(), abs=2e-5)
        # ...and they are the 20 most likely (ids compared as values: near-ties may swap).
        assert top[0][0] == int(expected.argmax())
        assert top[-1][1] >= expected.topk(21).values[-1].item() - 2e-5


def test_bfloat16_first_step_logits_are_close_to_float32(single_thread, tiny_hf_checkpoint):
    """Logprobs are logits shifted by one constant per row, so the top-20 logprobs carry the
    top-20 logits: their values, and their gaps to the top one (the logit gaps)."""
    float32 = LLM(tiny_hf_checkpoint, kv_cache_bytes=KV_BYTES)
    bfloat16 = LLM(tiny_hf_checkpoint, kv_cache_bytes=KV_BYTES, dtype="bfloat16")
    assert bfloat16.engine.runner.kv_cache.dtype == torch.bfloat16
    prompts = _prompts(float32)
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=20)
    reference = float32.generate(prompts, params)
    results = bfloat16.generate(prompts, params)
    for result, expected in zip(results, reference):
        output = result.outputs[0]
        assert output.finish_reason == "length" and len(output.token_ids) == MAX_TOKENS
        top = dict(output.logprobs[0].top)
        top_expected = dict(expected.outputs[0].logprobs[0].top)
        common = top.keys() & top_expected.keys()
        assert len(common) >= 15, "near-ties may swap the tail of the top 20, not most of it"
        best = expected.outputs[0].logprobs[0].top[0][0]
        assert best in common
        for token_id in common:
            assert top[token_id] == pytest.approx(top_expected[token_id], rel=5e-2)
            gap = top[token_id] - top[best]
            assert gap == pytest.approx(top_expected[token_id] - top_expected[best], abs=2e-2)


def seeded_runs_roomy_and_cramped(
    checkpoint: str, logprobs: int | None = None, **cramped_options: object
) -> tuple[list, list, LLM]:
    """Four seeded requests (40 tokens each) on a roomy pool and on a 12-block pool that must
    preempt: (roomy results, cramped results, the cramped engine)."""
    prompts = [[17 + i] * (30 + i) for i in range(4)]
    params = [
        SamplingParams(
            temperature=1.0, seed=10 + i, max_tokens=40, ignore_eos=True, logprobs=logprobs
        )
        for i in range(4)
    ]
    roomy = LLM(checkpoint, kv_cache_bytes=KV_BYTES, enable_prefix_caching=False)
    cramped = LLM(
        checkpoint,
        kv_cache_bytes=KV_BYTES,
        num_blocks_override=12,
        enable_prefix_caching=False,
        **cramped_options,
    )
    return roomy.generate(prompts, params), cramped.generate(prompts, params), cramped


def test_seeded_sampling_survives_preemption(single_thread, tiny_hf_checkpoint):
    """A preempted request is recomputed, not resampled: its seeded draws continue where they
    stopped, so a pool too small for the batch changes nothing but the schedule."""
    expected, results, cramped = seeded_runs_roomy_and_cramped(tiny_hf_checkpoint, logprobs=1)
    assert cramped.stats().num_preemptions > 0, "the pool was meant to be too small"
    assert sum(result.outputs[0].num_preemptions for result in results) > 0
    for result, reference in zip(results, expected):
        output = result.outputs[0]
        assert output.token_ids == reference.outputs[0].token_ids
        assert [entry.token_id for entry in output.logprobs] == output.token_ids
    stats = cramped.stats()
    assert (stats.num_running, stats.num_waiting, stats.num_kv_blocks_free) == (0, 0, 12)


# ---- the context limit --------------------------------------------------------------------


@pytest.fixture(scope="module")
def short_context(single_thread, tiny_hf_checkpoint) -> LLM:
    return LLM(tiny_hf_checkpoint, kv_cache_bytes=KV_BYTES, max_model_len=64)


def test_prompt_filling_the_context_is_rejected(short_context):
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    before = short_context.generate([[17] * 63], params)[0].outputs[0]
    with pytest.raises(ValueError, match="max_model_len"):
        short_context.generate([[17] * 64], params)
    stats = short_context.stats()
    assert stats.num_kv_blocks_free == stats.num_kv_blocks_total
    after = short_context.generate([[17] * 63], params)[0].outputs[0]
    assert after.token_ids == before.token_ids


@pytest.mark.parametrize("prompt_len, num_outputs", [(63, 1), (60, 4), (20, 10)])
def test_output_stops_at_the_context_length(short_context, prompt_len, num_outputs):
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    output = short_context.generate([[17] * prompt_len], params)[0].outputs[0]
    assert len(output.token_ids) == num_outputs
    assert output.finish_reason == "length"


# ---- AsyncLLM lifecycle -------------------------------------------------------------------


def test_async_shutdown_ends_open_streams_and_refuses_new_ones(single_thread, tiny_hf_checkpoint):
    llm = AsyncLLM(tiny_hf_checkpoint, kv_cache_bytes=KV_BYTES)
    endless = SamplingParams(temperature=0.0, max_tokens=20_000, ignore_eos=True)

    async def main():
        stream = llm.generate([17, 18, 19], endless)
        first = await stream.__anext__()
        assert not first.finished
        llm.shutdown()
        with pytest.raises(RuntimeError, match="shut down"):
            async for _ in stream:
                pass
        with pytest.raises(RuntimeError, match="shut down"):
            await llm.generate([17, 18], GREEDY).__anext__()

    asyncio.run(asyncio.wait_for(main(), timeout=60))
    assert not llm.engine.has_unfinished_requests()
