"""`check_prompt`, the one prompt check the gateway and the engine share: exact error codes,
and the KV cache's size checked only when it is given."""

from __future__ import annotations

import pytest

from splitserve.engine.prompts import PromptError, check_prompt

VOCAB, MAX_LEN = 100, 64


@pytest.mark.parametrize(
    ("prompt", "pattern", "code"),
    [
        ("hi", "^prompt_token_ids must be a list", "invalid_value"),
        ([], "^prompt must not be empty", "invalid_value"),
        ([1, 100], r"^prompt_token_ids contains ids outside \[0, 100\): \[100\]", "invalid_value"),
        ([1, -1], "^prompt_token_ids", "invalid_value"),
        ([1, 2.0], "^prompt_token_ids", "invalid_value"),
        ([1, True], "^prompt_token_ids", "invalid_value"),
        ([1] * MAX_LEN, "max_model_len", "context_length_exceeded"),
    ],
)
def test_bad_prompts_are_named(prompt, pattern, code):
    with pytest.raises(PromptError, match=pattern) as info:
        check_prompt(prompt, VOCAB, MAX_LEN)
    assert info.value.code == code


def test_the_kv_cache_is_checked_only_when_its_size_is_given():
    prompt = [1] * 40  # with one output token: 3 blocks of 16
    check_prompt(prompt, VOCAB, MAX_LEN)
    check_prompt(prompt, VOCAB, MAX_LEN, block_size=16, num_kv_blocks=3)
    with pytest.raises(PromptError, match="^prompt needs 3 KV blocks but the cache holds only 2"):
        check_prompt(prompt, VOCAB, MAX_LEN, block_size=16, num_kv_blocks=2)
    check_prompt([1] * (MAX_LEN - 1), VOCAB, MAX_LEN)  # one token of room is enough
