"""A sequence resumed from its tokens so far (a migration after a pod died) continues exactly as
if nothing had happened: the same tokens (greedy, seeded sampling, penalties, a grammar), the
same logprobs, and text that picks up where the client's left off, stop strings held back
across the cut included.
"""

from __future__ import annotations

import pytest

from splitserve import LLM, SamplingParams
from splitserve.engine.structured_output.spec import StructuredOutput

PROMPT = "Write a short story about a robot who learns to paint, in three sentences."


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(kv_cache_bytes=64 * 2**20)


def _run(llm: LLM, request_id: str, params: SamplingParams, resumed: list[int] = ()) -> list:
    """Every delta of one sequence, driving the engine directly."""
    text = llm.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}])
    prompt = llm.tokenizer.encode(text, add_special_tokens=False)
    llm.engine.add_request(request_id, prompt, params, resumed_output=resumed)
    deltas = []
    while llm.engine.has_unfinished_requests():
        deltas.extend(d for d in llm.engine.step() if d.request_id == request_id)
    return deltas


def _delivered(deltas: list, num_messages: int) -> tuple[list[int], str]:
    """The tokens and text a client had after the first `num_messages` deltas."""
    tokens = [t for d in deltas[:num_messages] for t in d.token_ids]
    return tokens, "".join(d.text for d in deltas[:num_messages])


def _assert_resumes_everywhere(llm: LLM, params: SamplingParams, name: str, cuts) -> None:
    whole = _run(llm, f"{name}-whole", params)
    all_tokens, all_text = _delivered(whole, len(whole))
    assert whole[-1].finished and len(all_tokens) > max(cuts)
    for cut in cuts:
        tokens, text = _delivered(whole, cut)
        rest = _run(llm, f"{name}-{cut}", params, tokens)
        assert [t for d in rest for t in d.token_ids] == all_tokens[len(tokens) :], cut
        assert text + "".join(d.text for d in rest) == all_text, cut
        final = rest[-1].final
        assert final.token_ids == all_tokens  # usage counts every output token
        assert (rest[-1].finish_reason, rest[-1].stop_reason) == (
            whole[-1].finish_reason,
            whole[-1].stop_reason,
        )
        if params.logprobs is not None:
            new = [lp for d in rest for lp in d.logprobs]
            old = [lp for d in whole for lp in d.logprobs][len(tokens) :]
            assert [(lp.token_id, lp.rank) for lp in new] == [(lp.token_id, lp.rank) for lp in old]
            assert [lp.logprob for lp in new] == pytest.approx([lp.logprob for lp in old], abs=1e-4)
    assert llm.engine.kv_manager.num_free_blocks == llm.engine.kv_manager.num_blocks


def test_greedy_with_penalties_and_logprobs_resumes_identically(llm):
    params = SamplingParams(
        temperature=0.0, max_tokens=30, frequency_penalty=0.5, repetition_penalty=1.1, logprobs=2
    )
    _assert_resumes_everywhere(llm, params, "greedy", cuts=[1, 7, 18, 29])


@pytest.mark.slow  # make test stays well under 15 min: ~5 s
def test_a_seeded_sample_continues_its_own_random_stream(llm):
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=30)
    _assert_resumes_everywhere(llm, params, "seeded", cuts=[1, 12, 25])


def test_text_held_back_for_a_stop_string_is_released_by_the_new_pod(llm):
    free = _run(llm, "probe", SamplingParams(temperature=0.0, max_tokens=30))
    text = "".join(d.text for d in free)
    # A stop string whose first half occurs earlier than the whole: that half is held back
    # at the cut, then released (the match fails) by the pod that resumes.
    words = text.split()
    stop = f"{words[3]} NEVER"
    params = SamplingParams(temperature=0.0, max_tokens=30, stop=[stop, words[8]])
    whole = _run(llm, "stop-whole", params)
    held_back = [
        cut
        for cut in range(1, len(whole))
        if len(_delivered(whole, cut)[1])
        < len(llm.tokenizer.decode(_delivered(whole, cut)[0]))
    ]
    assert held_back, "some cut must fall while text is held back"
    _assert_resumes_everywhere(llm, params, "stop", cuts=held_back[:3] + [len(whole) - 1])


def test_a_grammar_continues_from_the_resumed_tokens(llm):
    schema = {
        "type": "object",
        "properties": {"title": {"type": "string", "maxLength": 20}, "year": {"type": "integer"}},
        "required": ["title", "year"],
        "additionalProperties": False,
    }
    params = SamplingParams(
        temperature=0.0, max_tokens=40, structured_output=StructuredOutput.json_schema(schema)
    )
    _assert_resumes_everywhere(llm, params, "json", cuts=[2, 6])


@pytest.mark.parametrize(
    ("resumed", "message"),
    [([5] * 30, "leaves nothing of max_tokens"), ([10**7], "outside")],
)
def test_bad_resumed_output_is_refused(llm, resumed, message):
    with pytest.raises(ValueError, match=message):
        _run(llm, "bad", SamplingParams(max_tokens=30), resumed)
    assert not llm.engine.has_unfinished_requests()
