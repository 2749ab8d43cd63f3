"""Structured outputs and logit_bias in the engine, on the shipped model.

Greedy constrained output equals transformers' greedy decoding under the same grammar (an
independent llguidance matcher masking its logits) token for token; sampled output always
matches its schema; the grammar composes with n-gram speculation, n > 1 and preemption; bad
constraints are refused before anything is queued.
"""

from __future__ import annotations

import json
import re

import jsonschema
import llguidance
import pytest
import torch
from llguidance.torch import fill_next_token_bitmask
from transformers import LogitsProcessor

from splitserve import LLM, SamplingParams
from splitserve.engine.structured_output.grammar import grammar_for
from splitserve.engine.structured_output.spec import StructuredOutput
from tests.hf_reference import transformers_greedy

MAX_TOKENS = 96

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
    },
    "required": ["name", "age", "role"],
    "additionalProperties": False,
}
ORDER = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 99999},
        "items": {
            "type": "array",
            "minItems": 1,
            "maxItems": 3,
            "items": {
                "type": "object",
                "properties": {
                    "sku": {"type": "string", "pattern": "^[A-Z]{3}[0-9]{2}$"},
                    "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                },
                "required": ["sku", "qty"],
                "additionalProperties": False,
            },
        },
        "paid": {"type": "boolean"},
    },
    "required": ["id", "items", "paid"],
    "additionalProperties": False,
}
POINT_LIST = {
    "type": "array",
    "minItems": 2,
    "maxItems": 2,
    "items": {
        "type": "object",
        "properties": {
            "x": {"type": "integer", "minimum": -10, "maximum": 10},
            "y": {"type": "integer", "minimum": -99, "maximum": 99},
        },
        "required": ["x", "y"],
        "additionalProperties": False,
    },
}
# Every value is bounded, so a sampled answer always ends within MAX_TOKENS.
SCHEMAS = [PERSON, ORDER, POINT_LIST]
QUESTION = "Answer in JSON: describe one record."


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(kv_cache_bytes=128 * 2**20)


@pytest.fixture(scope="module")
def spec_llm() -> LLM:
    return LLM(kv_cache_bytes=128 * 2**20, speculative_method="ngram", num_speculative_tokens=4)


def _chat_prompt(llm: LLM, content: str) -> list[int]:
    text = llm.tokenizer.apply_chat_template([{"role": "user", "content": content}])
    return llm.tokenizer.encode(text, add_special_tokens=False)


def _greedy(output: StructuredOutput | None, **extra) -> SamplingParams:
    return SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, structured_output=output, **extra
    )


class _GrammarMask(LogitsProcessor):
    """transformers' side of the comparison: masks each step's logits with its own matcher."""

    def __init__(self, llm: LLM, output: StructuredOutput, prompt_len: int) -> None:
        tokenizer = llguidance.LLTokenizer(
            llm.tokenizer.to_json(), n_vocab=llm.engine.architecture.vocab_size, eos_token=[2]
        )
        self.matcher = llguidance.LLMatcher(tokenizer, grammar_for(output))
        self.prompt_len = prompt_len

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if input_ids.shape[1] > self.prompt_len:
            assert self.matcher.consume_token(int(input_ids[0, -1]))
        words = torch.zeros(1, (scores.shape[1] + 31) // 32, dtype=torch.int32)
        fill_next_token_bitmask(self.matcher, words)
        allowed = ((words.unsqueeze(-1) >> torch.arange(32)) & 1).flatten(1)[:, : scores.shape[1]]
        return scores.masked_fill(allowed == 0, float("-inf"))


def _json_of(completion) -> object:
    assert completion.finish_reason == "stop", completion.text
    return json.loads(completion.text)


# One schema in make test; the two longer outputs in make test-slow (~8 s each).
@pytest.mark.parametrize(
    "schema",
    [
        pytest.param(SCHEMAS[0], id="person", marks=pytest.mark.slow),
        pytest.param(SCHEMAS[1], id="order", marks=pytest.mark.slow),
        pytest.param(SCHEMAS[2], id="points"),
    ],
)
def test_greedy_json_matches_transformers_under_the_same_grammar(llm, hf_reference_model, schema):
    output = StructuredOutput.json_schema(schema)
    prompt = _chat_prompt(llm, QUESTION)
    result = llm.generate([prompt], _greedy(output))[0].outputs[0]
    mask = _GrammarMask(llm, output, len(prompt))
    reference = transformers_greedy(hf_reference_model, prompt, MAX_TOKENS, [mask])
    assert result.token_ids == reference
    jsonschema.validate(_json_of(result), schema)


def test_logit_bias_matches_transformers_with_the_same_bias(llm, hf_reference_model):
    prompt = llm.tokenizer.encode("The capital of France is")
    london = llm.tokenizer.encode(" London", add_special_tokens=False)[0]
    paris = llm.tokenizer.encode(" Paris", add_special_tokens=False)[0]
    bias = {london: 5.0, paris: -100.0}

    class Bias(LogitsProcessor):
        def __call__(self, input_ids, scores):
            for token_id, value in bias.items():
                scores[:, token_id] += value
            return scores

    result = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, logit_bias=bias))
    tokens = result[0].outputs[0].token_ids
    assert paris not in tokens
    reference = transformers_greedy(hf_reference_model, prompt, 12, [Bias()])
    assert tokens == reference
    unbiased = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=12))
    assert unbiased[0].outputs[0].token_ids != tokens  # the bias changed the answer


@pytest.mark.slow
def test_sampled_json_always_matches_its_schema(llm):
    prompts = [_chat_prompt(llm, f"{QUESTION} Record number {i}.") for i in range(100)]
    params = [
        SamplingParams(
            temperature=1.0,
            top_p=0.95,
            seed=seed,
            max_tokens=MAX_TOKENS,
            structured_output=StructuredOutput.json_schema(SCHEMAS[seed % len(SCHEMAS)]),
        )
        for seed in range(100)
    ]
    results = llm.generate(prompts, params)
    texts = set()
    for seed, result in enumerate(results):
        completion = result.outputs[0]
        jsonschema.validate(_json_of(completion), SCHEMAS[seed % len(SCHEMAS)])
        texts.add(completion.text)
    assert len(texts) > 50  # sampled, not one answer repeated


def test_n_sequences_each_follow_the_grammar(llm):
    params = SamplingParams(
        n=3, temperature=1.0, seed=11, max_tokens=MAX_TOKENS,
        structured_output=StructuredOutput.json_schema(PERSON),
    )
    completions = llm.generate([_chat_prompt(llm, QUESTION)], params)[0].outputs
    assert len(completions) == 3
    for completion in completions:
        jsonschema.validate(_json_of(completion), PERSON)
    assert len({c.text for c in completions}) > 1


@pytest.mark.parametrize(
    ("output", "check"),
    [
        (StructuredOutput("regex", r"[A-Z][a-z]{2,8} \d{4}"),
         lambda text: re.fullmatch(r"[A-Z][a-z]{2,8} \d{4}", text)),
        (StructuredOutput.choice(["red", "green", "blue"]),
         lambda text: text in ("red", "green", "blue")),
        (StructuredOutput("grammar", 'root ::= "yes" | "no" | "maybe, " [0-9]'),
         lambda text: re.fullmatch(r"yes|no|maybe, [0-9]", text)),
        (StructuredOutput("grammar", 'start: "(" NUM ("+" NUM)* ")"\nNUM: /[0-9]{1,2}/'),
         lambda text: re.fullmatch(r"\(\d{1,2}(\+\d{1,2})*\)", text)),
        (StructuredOutput("json_object"), lambda text: isinstance(json.loads(text), dict)),
    ],
    ids=["regex", "choice", "gbnf", "lark", "json_object"],
)
def test_regex_choice_grammar_and_json_object(llm, output, check):
    prompt = _chat_prompt(llm, "Give a short answer.")
    for params in (_greedy(output), SamplingParams(temperature=0.8, seed=5, max_tokens=MAX_TOKENS,
                                                   structured_output=output)):
        completion = llm.generate([prompt], params)[0].outputs[0]
        assert completion.finish_reason == "stop", completion.text
        assert check(completion.text), completion.text


@pytest.mark.slow
def test_speculation_gives_the_same_greedy_json(llm, spec_llm):
    prompts = [_chat_prompt(llm, f"{QUESTION} Variant {i}.") for i in range(len(SCHEMAS))]
    params = [_greedy(StructuredOutput.json_schema(schema)) for schema in SCHEMAS]
    plain = [r.outputs[0].token_ids for r in llm.generate(prompts, params)]
    before = spec_llm.stats().num_spec_proposed_tokens
    speculated = spec_llm.generate(prompts, params)
    assert [r.outputs[0].token_ids for r in speculated] == plain
    assert spec_llm.stats().num_spec_proposed_tokens > before  # drafts were checked
    sampled = SamplingParams(temperature=0.7, seed=3, max_tokens=MAX_TOKENS,
                             structured_output=StructuredOutput.json_schema(ORDER))
    jsonschema.validate(_json_of(spec_llm.generate([prompts[1]], sampled)[0].outputs[0]), ORDER)


@pytest.mark.slow
def test_preempted_requests_keep_their_grammar(llm):
    small = LLM(kv_cache_bytes=24 * 2**20, max_num_seqs=8)  # room for ~3 of the 8
    prompts = [_chat_prompt(llm, f"{QUESTION} Case {i}, " + "in detail " * 20) for i in range(8)]
    params = [_greedy(StructuredOutput.json_schema(SCHEMAS[i % 3])) for i in range(8)]
    expected = [r.outputs[0].token_ids for r in llm.generate(prompts, params)]
    results = small.generate(prompts, params)
    assert small.stats().num_preemptions > 0
    assert [r.outputs[0].token_ids for r in results] == expected
    assert small.stats().num_kv_blocks_free == small.stats().num_kv_blocks_total


def test_a_complete_grammar_ends_the_output_before_min_tokens(llm):
    params = _greedy(StructuredOutput.choice(["ok"]), min_tokens=5)
    completion = llm.generate([_chat_prompt(llm, "Say ok.")], params)[0].outputs[0]
    assert (completion.text, completion.finish_reason) == ("ok", "stop")


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (SamplingParams(structured_output=StructuredOutput("json", '{"type": "strin"}')),
         "structured_output json is invalid"),
        (SamplingParams(structured_output=StructuredOutput.json_schema({"not": {}})),
         "Unimplemented keys"),
        (SamplingParams(structured_output=StructuredOutput("regex", "[a-")),
         "structured_output regex is invalid"),
        (SamplingParams(structured_output=StructuredOutput("grammar", "start: nothing")),
         "structured_output grammar is invalid"),
        (SamplingParams(logit_bias={10**6: 1.0}), "logit_bias token ids must be below"),
    ],
)
def test_bad_constraints_are_refused_before_queueing(llm, params, message):
    with pytest.raises(ValueError, match=message):
        llm.generate(["hello"], params)
    assert not llm.engine.has_unfinished_requests()


def test_a_constraint_compiles_once(llm):
    output = StructuredOutput.json_schema(ORDER)
    assert llm.engine.grammars.compile(output) is llm.engine.grammars.compile(output)


def test_the_grammar_tokenizer_is_built_once_at_the_first_constraint(llm):
    """A pod that never sees a constraint never holds llguidance's view of the vocabulary
    (about 36 MiB for SmolLM2's); the first constraints build it once, whichever threads ask."""
    import concurrent.futures

    from splitserve.engine.structured_output.matcher import GrammarCompiler

    calls = []

    def tokenizer_json() -> str:
        calls.append(1)
        return llm.tokenizer.to_json()

    compiler = GrammarCompiler(tokenizer_json, llm.engine.architecture.vocab_size, [2])
    try:
        assert calls == []
        outputs = [StructuredOutput.json_schema(PERSON), StructuredOutput.json_schema(ORDER)]
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            list(pool.map(compiler.new_sequence, outputs))
        assert calls == [1]
    finally:
        compiler.shutdown()
