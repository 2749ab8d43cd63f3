"""The offline API (`LLM.generate` / `LLM.stream`) on the shipped SmolLM2 model.

What a caller can rely on: bad input is a ValueError naming the parameter and leaves the engine
exactly as it was; seeded sampling is reproducible whatever shares the batch; logprobs are the
model's (checked against transformers); stop strings, stop token ids, EOS, ignore_eos and
min_tokens end sequences where they should; a stream closed early frees its blocks.

torch runs single-threaded here: on a 2-core machine shared with other jobs, an intra-op
thread waiting for a descheduled sibling stalls every op (measured under load: SmolLM2 decoding
16x slower with 2 threads than with 1; one tiny attention call 15 ms instead of 6 us).
"""

from __future__ import annotations

import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.engine.sampling_params import MAX_LOGPROBS

GREEDY = SamplingParams(temperature=0.0, max_tokens=4)
STORY_PROMPT = "Once upon a time"
NUM_STORY_TOKENS = 16


@pytest.fixture(scope="module")
def llm(single_thread) -> LLM:
    return LLM(kv_cache_bytes=128 * 2**20)


@pytest.fixture(scope="module")
def baseline(llm: LLM) -> list[int]:
    """The good request every bad-input test re-runs: its tokens must never change."""
    return llm.generate("The quick brown fox", GREEDY)[0].outputs[0].token_ids


@pytest.fixture(scope="module")
def chat_prompt(llm: LLM) -> list[int]:
    """A question SmolLM2 answers in 6 tokens and EOS: 'The answer is 4.'"""
    messages = [{"role": "user", "content": "What is 2+2? Answer with one number."}]
    text = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return llm.tokenizer.encode(text, add_special_tokens=False)


@pytest.fixture(scope="module")
def story(llm: LLM):
    """Greedy continuation of STORY_PROMPT without any stop condition (ends by length)."""
    params = SamplingParams(temperature=0.0, max_tokens=NUM_STORY_TOKENS)
    output = llm.generate(STORY_PROMPT, params)[0].outputs[0]
    assert output.finish_reason == "length"
    return output


def _assert_idle(llm: LLM) -> None:
    stats = llm.stats()
    assert (stats.num_running, stats.num_waiting) == (0, 0)
    assert stats.num_kv_blocks_free == stats.num_kv_blocks_total
    assert not llm.engine.has_unfinished_requests()


def _tokens(results) -> list[list[int]]:
    return [output.token_ids for result in results for output in result.outputs]


# ---- 1. bad input -------------------------------------------------------------------------


def _with_prompts(prompts, params=GREEDY):
    return lambda llm: llm.generate(prompts, params)


# Rejected by SamplingParams itself, before an engine is involved: (fields, pattern).
BAD_PARAMS = {
    "max-tokens-0": ({"max_tokens": 0}, "max_tokens"),
    "max-tokens-negative": ({"max_tokens": -3}, "max_tokens"),
    "temperature": ({"temperature": -0.1}, "temperature"),
    "top-p-0": ({"top_p": 0.0}, "top_p"),
    "top-p-1.5": ({"top_p": 1.5}, "top_p"),
    "top-k": ({"top_k": -1}, "top_k"),
    "n-0": ({"n": 0}, "^n must"),
    "logprobs": ({"logprobs": MAX_LOGPROBS + 1}, "logprobs"),
    "stop-not-str": ({"stop": [5]}, "stop"),
    "stop-empty": ({"stop": [""]}, "stop"),
    "stop-token-ids": ({"stop_token_ids": [-2]}, "stop_token_ids"),
    "seed-str": ({"seed": "7"}, "seed"),
    "seed-float": ({"seed": 1.5}, "seed"),
    "seed-too-big": ({"seed": 2**64}, "seed"),
    "n-float": ({"n": 2.0}, "^n must"),
    "logprobs-float": ({"logprobs": 2.5}, "logprobs"),
    "temperature-nan": ({"temperature": float("nan")}, "temperature"),
    "skip-special-tokens-str": ({"skip_special_tokens": "no"}, "skip_special_tokens"),
}


@pytest.mark.parametrize("fields, pattern", BAD_PARAMS.values(), ids=BAD_PARAMS.keys())
def test_bad_sampling_params_are_named(fields, pattern):
    with pytest.raises(ValueError, match=pattern):
        SamplingParams(**fields)


# Reach the engine, which must reject them: (case id, call with the llm, pattern).
BAD_CALLS = [
    ("empty-string", _with_prompts(""), "prompt"),
    ("empty-prompt-list", _with_prompts([]), "prompts"),
    ("empty-token-list", _with_prompts([[]]), "prompt"),
    ("over-context", _with_prompts([[17] * 8192]), "max_model_len"),
    ("over-kv-cache", _with_prompts([[17] * 3000]), "KV blocks"),
    ("token-id-negative", _with_prompts([[17, -1]]), "prompt_token_ids"),
    ("token-id-vocab-size", _with_prompts([[17, 49152]]), "prompt_token_ids"),
    ("token-id-float", _with_prompts([[17, 2.0]]), "prompt"),
    ("params-type", _with_prompts("Hi", {"temperature": 0}), "params"),
    ("params-count", _with_prompts(["Hi", "Yo"], [GREEDY] * 3), "params"),
    ("priority-type", lambda llm: llm.generate("Hi", GREEDY, priority="high"), "priority"),
    ("stream-empty-prompt", lambda llm: list(llm.stream("", GREEDY)), "prompt"),
]


@pytest.mark.parametrize(
    "call, pattern", [case[1:] for case in BAD_CALLS], ids=[case[0] for case in BAD_CALLS]
)
def test_bad_input_raises_and_engine_keeps_serving(llm, baseline, call, pattern):
    queried = llm.stats().prefix_cache_queried_tokens
    with pytest.raises(ValueError, match=pattern):
        call(llm)
    _assert_idle(llm)
    assert llm.stats().prefix_cache_queried_tokens == queried, "nothing may have been scheduled"
    assert llm.generate("The quick brown fox", GREEDY)[0].outputs[0].token_ids == baseline


def test_unknown_engine_option_is_named():
    with pytest.raises(ValueError, match="kv_cache_megabytes"):
        LLM(kv_cache_megabytes=128)


@pytest.mark.parametrize(
    "prompts, params",
    [
        (["Hello", [17, -1], "Goodbye"], GREEDY),
        (["Hello", "", "Goodbye"], GREEDY),
        (["Hello", "Goodbye"], [GREEDY, {"seed": 1}]),
    ],
    ids=["bad-token-id", "empty-prompt", "bad-params"],
)
def test_one_bad_prompt_in_a_batch_runs_nothing(llm, baseline, prompts, params):
    queried = llm.stats().prefix_cache_queried_tokens
    with pytest.raises(ValueError):
        llm.generate(prompts, params)
    _assert_idle(llm)
    assert llm.stats().prefix_cache_queried_tokens == queried
    assert llm.generate("The quick brown fox", GREEDY)[0].outputs[0].token_ids == baseline


# SamplingParams fails where it is built, with a ValueError rather than a TypeError later.
def test_sampling_params_rejects_non_iterable_stop():
    with pytest.raises(ValueError, match="stop"):
        SamplingParams(stop=5)


def test_sampling_params_rejects_non_iterable_stop_token_ids():
    with pytest.raises(ValueError, match="stop_token_ids"):
        SamplingParams(stop_token_ids=5)


@pytest.mark.parametrize("seed", ["7", 1.5, 2**64])
def test_sampling_params_rejects_bad_seed(seed):
    with pytest.raises(ValueError, match="seed"):
        SamplingParams(seed=seed)


@pytest.mark.parametrize(
    "field, value",
    [
        ("n", 2.0),
        ("max_tokens", 2.5),
        ("top_k", 1.5),
        ("logprobs", 2.5),
        ("temperature", float("nan")),
    ],
)
def test_sampling_params_rejects_non_integer_counts_and_nan(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


# ---- 2. sampling through the engine -------------------------------------------------------

SEEDED = SamplingParams(temperature=0.9, seed=1234, max_tokens=8)


def test_same_seed_same_output_alone_again_and_in_a_batch(llm):
    alone = llm.generate("My favourite food is", SEEDED)[0].outputs[0].token_ids
    again = llm.generate("My favourite food is", SEEDED)[0].outputs[0].token_ids
    batch = llm.generate(
        ["The weather today", "My favourite food is", "def main():"],
        [SamplingParams(temperature=1.0, max_tokens=8), SEEDED, GREEDY],
    )
    assert len(alone) == 8
    assert again == alone
    assert batch[1].outputs[0].token_ids == alone


def test_different_seeds_give_different_outputs(llm):
    results = llm.generate(
        ["My favourite food is"] * 2,
        [SEEDED, SamplingParams(temperature=0.9, seed=4321, max_tokens=8)],
    )
    first, second = _tokens(results)
    assert first != second


def test_top_k_1_is_greedy(llm):
    greedy = llm.generate("The weather today", SamplingParams(temperature=0.0, max_tokens=8))
    top1 = llm.generate("The weather today", SamplingParams(temperature=1.5, top_k=1, max_tokens=8))
    assert _tokens(top1) == _tokens(greedy)


def test_n_3_seeded_child_i_samples_like_seed_plus_i(llm):
    params = SamplingParams(n=3, temperature=0.9, seed=1234, max_tokens=8)
    (result,) = llm.generate("My favourite food is", params)
    assert [output.index for output in result.outputs] == [0, 1, 2]
    singles = llm.generate(
        ["My favourite food is"] * 3,
        [SamplingParams(temperature=0.9, seed=1234 + i, max_tokens=8) for i in range(3)],
    )
    assert _tokens([result]) == _tokens(singles)
    assert len({tuple(tokens) for tokens in _tokens([result])}) == 3, "siblings must differ"
    _assert_idle(llm)


def test_greedy_logprobs_match_transformers(llm, hf_reference_model):
    prompt = llm.tokenizer.encode("The capital of France is")
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=5)
    output = llm.generate([prompt], params)[0].outputs[0]
    assert len(output.logprobs) == len(output.token_ids) == 4
    for token_id, entry in zip(output.token_ids, output.logprobs):
        assert entry.token_id == token_id
        assert entry.rank == 1
        assert len(entry.top) == 5
        assert entry.top[0] == (token_id, entry.logprob)
        values = [value for _, value in entry.top]
        assert values == sorted(values, reverse=True)
    with torch.no_grad():
        logits = hf_reference_model(torch.tensor([prompt])).logits[0, -1]
    reference = torch.log_softmax(logits.float(), dim=-1)
    first = output.logprobs[0]
    assert [token_id for token_id, _ in first.top] == reference.topk(5).indices.tolist()
    for token_id, value in first.top:
        assert value == pytest.approx(reference[token_id].item(), abs=1e-4)


def test_sampled_logprobs_describe_the_sampled_token(llm):
    params = SamplingParams(temperature=1.0, seed=7, max_tokens=6, logprobs=0)
    output = llm.generate("My favourite food is", params)[0].outputs[0]
    assert [entry.token_id for entry in output.logprobs] == output.token_ids
    for entry in output.logprobs:
        assert entry.top == []
        assert entry.rank >= 1
        assert entry.logprob <= 0.0


# ---- 3. how sequences end -----------------------------------------------------------------


def _boundary_spanning_stop(llm: LLM, token_ids: list[int], text: str) -> tuple[str, int]:
    """A 4-character substring of text made of the last 2 characters of token i and the first
    2 of token i+1, whose first occurrence is that one; returns it and i."""
    for i in range(len(token_ids) - 1):
        end = len(llm.tokenizer.decode(token_ids[: i + 1]))
        left = llm.tokenizer.decode([token_ids[i]])
        right = llm.tokenizer.decode([token_ids[i + 1]])
        if len(left) >= 2 and len(right) >= 2:
            stop = text[end - 2 : end + 2]
            if text.find(stop) == end - 2:
                return stop, i
    raise AssertionError(f"no token boundary to stop at in {text!r}")


def test_stop_string_spanning_tokens_cuts_the_text(llm, story):
    stop, i = _boundary_spanning_stop(llm, story.token_ids, story.text)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_STORY_TOKENS, stop=["zzzz", stop])
    output = llm.generate(STORY_PROMPT, params)[0].outputs[0]
    assert output.text == story.text[: story.text.find(stop)]
    assert output.finish_reason == "stop"
    assert output.stop_reason == stop
    # Generation ends with the token that completes the stop string.
    assert output.token_ids == story.token_ids[: i + 2]
    _assert_idle(llm)


def test_streamed_stop_string_never_shows(llm, story):
    stop, _ = _boundary_spanning_stop(llm, story.token_ids, story.text)
    params = SamplingParams(temperature=0.0, max_tokens=NUM_STORY_TOKENS, stop=[stop])
    deltas = list(llm.stream(STORY_PROMPT, params))
    streamed = "".join(delta.text for delta in deltas)
    assert streamed == story.text[: story.text.find(stop)]
    assert [delta.finished for delta in deltas] == [False] * (len(deltas) - 1) + [True]
    assert deltas[-1].final.text == streamed


def test_stop_token_id_ends_the_sequence_without_its_text(llm, story):
    # The first token past the third that did not occur before it.
    ids = story.token_ids
    position = next(i for i in range(3, len(ids)) if ids[i] not in ids[:i])
    stop_id = ids[position]
    params = SamplingParams(temperature=0.0, max_tokens=NUM_STORY_TOKENS, stop_token_ids=[stop_id])
    output = llm.generate(STORY_PROMPT, params)[0].outputs[0]
    assert output.token_ids == story.token_ids[: position + 1]
    assert output.finish_reason == "stop"
    assert output.stop_reason == stop_id
    assert output.text == llm.tokenizer.decode(story.token_ids[:position])


def test_eos_stops_with_no_stop_reason(llm, chat_prompt):
    output = llm.generate([chat_prompt], SamplingParams(temperature=0.0, max_tokens=16))[0]
    (completion,) = output.outputs
    assert completion.text == "The answer is 4."
    assert len(completion.token_ids) == 7
    assert completion.token_ids[-1] in llm.engine.eos_token_ids
    assert (completion.finish_reason, completion.stop_reason) == ("stop", None)


def test_ignore_eos_runs_exactly_max_tokens(llm, chat_prompt):
    natural = llm.generate([chat_prompt], SamplingParams(temperature=0.0, max_tokens=16))
    natural_ids = natural[0].outputs[0].token_ids
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    output = llm.generate([chat_prompt], params)[0].outputs[0]
    assert len(output.token_ids) == 10
    assert output.token_ids[:7] == natural_ids  # the EOS is still sampled, just not obeyed
    assert output.finish_reason == "length"
    assert output.stop_reason is None


def test_min_tokens_holds_eos_back(llm, chat_prompt):
    natural_params = SamplingParams(temperature=0.0, max_tokens=16, logprobs=2)
    natural = llm.generate([chat_prompt], natural_params)[0].outputs[0]
    eos_position = len(natural.token_ids) - 1
    runner_up = natural.logprobs[eos_position].top[1][0]
    params = SamplingParams(temperature=0.0, max_tokens=12, min_tokens=10)
    output = llm.generate([chat_prompt], params)[0].outputs[0]
    eos = set(llm.engine.eos_token_ids)
    # Same tokens up to where EOS came, then the model's second choice instead of EOS.
    assert output.token_ids[:eos_position] == natural.token_ids[:eos_position]
    assert output.token_ids[eos_position] == runner_up
    assert not eos & set(output.token_ids[:10])
    if output.finish_reason == "stop":
        assert 10 < len(output.token_ids) <= 12 and output.token_ids[-1] in eos
    else:
        assert (output.finish_reason, len(output.token_ids)) == ("length", 12)


# ---- 4. streaming, aborts and timings -----------------------------------------------------


def test_stream_deltas_concatenate_to_the_final_text(llm, story):
    params = SamplingParams(temperature=0.0, max_tokens=NUM_STORY_TOKENS)
    deltas = list(llm.stream(STORY_PROMPT, params))
    assert "".join(delta.text for delta in deltas) == story.text
    assert [t for delta in deltas for t in delta.token_ids] == story.token_ids
    final = deltas[-1].final
    assert (final.text, final.token_ids, final.finish_reason) == (
        story.text,
        story.token_ids,
        "length",
    )


def test_stream_closed_early_frees_every_block(llm, baseline):
    params = SamplingParams(temperature=0.0, max_tokens=50)
    seen = 0
    for delta in llm.stream("Tell me a long story:", params):
        seen += len(delta.token_ids)
        if seen == 3:
            break
    _assert_idle(llm)
    assert llm.generate("The quick brown fox", GREEDY)[0].outputs[0].token_ids == baseline


def test_timings(llm):
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    output = llm.generate(["Hello", "Goodbye, my friend"], params)[1].outputs[0]
    timings = output.timings
    assert timings.time_to_first_token > 0
    latencies = timings.inter_token_latencies
    assert len(latencies) == len(output.token_ids) - 1 == 5
    assert all(latency >= 0 for latency in latencies)
    assert timings.finish_time >= timings.token_times[-1] >= timings.first_token_time
