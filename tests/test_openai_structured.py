"""Structured outputs through the whole stack, with the official `openai` client: a colocated
decode pod and a prefill + decode pair, both speculating with n-grams.

`client.beta.chat.completions.parse` returns parsed objects for several pydantic models, greedy
and sampled, streamed and not; vLLM's `structured_outputs` extension (regex, choice) works on
both endpoints; 100 seeded sampled requests all validate against their schema.
"""

from __future__ import annotations

import asyncio
import json
import re
from enum import StrEnum

import jsonschema
import pytest
from openai import AsyncOpenAI, OpenAI
from pydantic import BaseModel, Field

from tests.services_util import MODEL_NAME, Stack, start_stack, wait_until_idle

# Minutes of real processes: `make test-slow`.
pytestmark = pytest.mark.slow

SPECULATE = ["--speculative-method", "ngram", "--num-speculative-tokens", "3"]


class Color(StrEnum):
    RED = "red"
    GREEN = "green"
    BLUE = "blue"


class Pet(BaseModel):
    name: str = Field(max_length=10)
    age: int = Field(ge=0, le=30)
    color: Color


class Owner(BaseModel):
    name: str = Field(max_length=12)
    pets: list[Pet] = Field(min_length=1, max_length=2)


class Verdict(BaseModel):
    answer: bool
    confidence: int = Field(ge=0, le=9)


MODELS = [Pet, Owner, Verdict]
QUESTION = "Reply in JSON about a person and their pet."


@pytest.fixture(scope="module")
def stacks():
    started = {}
    try:
        started["colocated"] = start_stack(decode_flags=SPECULATE)
        started["disaggregated"] = start_stack(
            num_prefill=1,
            decode_flags=[*SPECULATE, "--local-prefill-threshold", "8"],
        )
        yield started
    finally:
        for stack in started.values():
            stack.stop()


@pytest.fixture(scope="module", params=["colocated", "disaggregated"])
def stack(request, stacks) -> Stack:
    return stacks[request.param].wait_healthy()


@pytest.fixture(scope="module")
def client(stack: Stack) -> OpenAI:
    return OpenAI(base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=120)


def _messages(extra: str = "") -> list[dict]:
    return [{"role": "user", "content": QUESTION + extra}]


def _assert_idle(stack: Stack) -> None:
    for address in stack.decode_addresses:
        stats = wait_until_idle(address, role="decode")
        assert stats.kv_blocks_free == stats.kv_blocks_total


@pytest.mark.parametrize("model", MODELS, ids=lambda m: m.__name__)
def test_parse_returns_objects_greedy_and_sampled(stack, client, model):
    for sampling in ({"temperature": 0}, {"temperature": 0.9, "seed": 4}):
        completion = client.beta.chat.completions.parse(
            model=MODEL_NAME,
            messages=_messages(),
            response_format=model,
            max_tokens=120,
            **sampling,
        )
        message = completion.choices[0].message
        assert completion.choices[0].finish_reason == "stop", message.content
        assert isinstance(message.parsed, model)
        jsonschema.validate(json.loads(message.content), model.model_json_schema())
    _assert_idle(stack)


def test_streamed_json_equals_the_whole_answer(client):
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "owner", "schema": Owner.model_json_schema(), "strict": True},
    }
    whole = client.chat.completions.create(
        model=MODEL_NAME, messages=_messages(" Stream."), response_format=response_format,
        max_tokens=120, temperature=0,
    )
    chunks = client.chat.completions.create(
        model=MODEL_NAME, messages=_messages(" Stream."), response_format=response_format,
        max_tokens=120, temperature=0, stream=True,
    )
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    Owner.model_validate_json(text)


def test_json_object_mode_returns_an_object(client):
    completion = client.chat.completions.create(
        model=MODEL_NAME, messages=_messages(), response_format={"type": "json_object"},
        max_tokens=60, temperature=0.7, seed=1,
    )
    choice = completion.choices[0]
    if choice.finish_reason == "stop":
        assert isinstance(json.loads(choice.message.content), dict)
    else:  # cut by max_tokens: still the start of an object
        assert choice.message.content.startswith("{")


def test_regex_and_choice_on_both_endpoints(client):
    pattern = r"[A-Z][a-z]{2,7}, \d{2}"
    chat = client.chat.completions.create(
        model=MODEL_NAME, messages=_messages(), max_tokens=20, temperature=0.8, seed=2,
        extra_body={"structured_outputs": {"regex": pattern}},
    )
    assert re.fullmatch(pattern, chat.choices[0].message.content)
    options = ["alpha", "beta", "gamma"]
    completion = client.completions.create(
        model=MODEL_NAME, prompt="Pick one word:", max_tokens=10, temperature=0, n=2,
        extra_body={"structured_outputs": {"choice": options}},
    )
    assert all(choice.text in options for choice in completion.choices)


def test_a_hundred_seeded_sampled_requests_match_their_schema(stack):
    schema = Verdict.model_json_schema()
    response_format = {
        "type": "json_schema",
        "json_schema": {"name": "verdict", "schema": schema, "strict": True},
    }

    async def run() -> list:
        async with AsyncOpenAI(
            base_url=f"{stack.base_url}/v1", api_key="unused", max_retries=0, timeout=300
        ) as client:
            calls = [
                client.chat.completions.create(
                    model=MODEL_NAME, messages=_messages(f" Case {seed}."),
                    response_format=response_format, max_tokens=30, temperature=1.0, seed=seed,
                )
                for seed in range(100)
            ]
            return await asyncio.gather(*calls)

    results = asyncio.run(run())
    for result in results:
        assert result.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(result.choices[0].message.content), schema)
    assert len({r.choices[0].message.content for r in results}) > 5
    _assert_idle(stack)
