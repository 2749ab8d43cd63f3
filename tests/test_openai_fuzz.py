"""A fuzz run of the HTTP API from its own /openapi.json (schemathesis): every operation gets
requests generated from the schema, valid ones and invalid ones, against a real gateway and
decode pod; none may answer 5xx or break the connection.

Bounded to stay well under a minute: a few examples per operation, and the copy of the schema
the generator reads caps the token counts (max_tokens and friends at most 4, n at most 2), so a
generated request never asks for a long generation on the CPU; it also sets the known-unsupported
fields to null there, or nearly every generated chat body would be a 400 for one of them, and
gives tool calls to assistant messages only (a chat message is one schema for every role).
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING

import pytest

from tests.services_util import Stack, get_json, start_stack

if TYPE_CHECKING:
    from schemathesis import GenerationMode

# Minutes of real processes: `make test-slow`.
pytestmark = pytest.mark.slow

MAX_EXAMPLES = 25  # per operation and generation mode
# Caps written into the generator's copy of the schema: (field -> maximum).
CAPS = {
    "max_tokens": 4,
    "max_completion_tokens": 4,
    "max_output_tokens": 4,
    "min_tokens": 4,
    "n": 2,
    "best_of": 2,
}
# Fields made required in that copy, so no request falls back to "the rest of the context".
REQUIRED = {"ChatBody": "max_completion_tokens", "ResponsesBody": "max_output_tokens"}


@pytest.fixture(scope="module")
def stack():
    stack = start_stack()
    try:
        yield stack.wait_healthy()
    finally:
        stack.stop()


def _bounded(spec: dict) -> dict:
    for name, schema in spec["components"]["schemas"].items():
        properties = schema.get("properties", {})
        for field, cap in CAPS.items():
            if field in properties:
                # An enum, not a range: a generator may write 4 as 4.0, which is refused.
                properties[field] = {"enum": list(range(1, cap + 1))}
        for field, prop in properties.items():
            # A known-unsupported field is a 400 whatever else the body holds (tested in
            # test_openai_api.py): generated at null only, so valid bodies get through.
            if prop.get("description", "").startswith("Not supported"):
                properties[field] = {"type": "null"}
        if name in REQUIRED:
            schema.setdefault("required", []).append(REQUIRED[name])
        if name == "ChatBody":  # both spellings set: neither may be left to the default
            schema["required"].append("max_tokens")
    schemas = spec["components"]["schemas"]
    schemas["ChatMessage"] = _tool_calls_from_assistants_only(schemas["ChatMessage"])
    return spec


def _tool_calls_from_assistants_only(message: dict) -> dict:
    """One variant for the assistant's messages and one, without tool calls, for the rest."""
    assistant, others = copy.deepcopy(message), copy.deepcopy(message)
    roles = message["properties"]["role"]["enum"]
    assistant["properties"]["role"] = {"enum": ["assistant"]}
    others["properties"]["role"] = {"enum": [role for role in roles if role != "assistant"]}
    others["properties"]["tool_calls"] = {"type": "null"}
    return {"oneOf": [assistant, others]}


def test_no_generated_request_gets_a_5xx(stack: Stack):
    # lazy: schemathesis and hypothesis take ~4 s to import, which every pytest worker would
    # pay at collection, make test's included (this file is slow)
    import schemathesis
    from schemathesis import GenerationMode

    spec = _bounded(get_json(f"{stack.base_url}/openapi.json").body)
    schema = schemathesis.openapi.from_dict(spec)
    schema.config.update(base_url=stack.base_url)
    failures: list[str] = []
    statuses: dict[str, set[int]] = {}
    for result in schema.get_all_operations():
        operation = result.ok()
        seen = statuses.setdefault(operation.label, set())
        _fuzz(operation, GenerationMode.POSITIVE, failures, seen)
        if operation.method.upper() == "POST":  # the others have nothing to get wrong
            _fuzz(operation, GenerationMode.NEGATIVE, failures, seen)
    assert not failures, "\n".join(failures[:10])
    # Valid requests did generate (the run is not only refusals).
    for label in ("POST /v1/completions", "POST /v1/chat/completions", "POST /v1/responses"):
        assert 200 in statuses[label], (label, statuses[label])


def _fuzz(operation, mode: GenerationMode, failures: list[str], seen: set[int]) -> None:
    from hypothesis import HealthCheck, given, settings  # lazy: as in the test above

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        database=None,
        derandomize=True,  # the same requests every run: a failure reproduces
        suppress_health_check=list(HealthCheck),
    )
    def run(case) -> None:
        response = case.call(timeout=60)
        seen.add(response.status_code)
        if response.status_code >= 500:
            failures.append(
                f"{operation.label} {mode.value}: {response.status_code} for {case.body!r}: "
                f"{response.text[:300]}"
            )

    run()
