"""Normalising what callers pass as prompts, checking them, and fanning a request out into n
sequences. Torch-free: the gateway checks prompts with the engine's own function."""

from __future__ import annotations

from dataclasses import dataclass, replace

from splitserve.engine.sampling_params import SamplingParams
from splitserve.engine.tokenizer import Tokenizer

# Child sequences of an n > 1 request are "<request_id>#<index>".
CHILD_SEPARATOR = "#"


@dataclass(frozen=True)
class PromptInput:
    text: str | None
    token_ids: list[int]


def normalize_prompts(prompts: object, tokenizer: Tokenizer) -> list[PromptInput]:
    """Accepts a string, a list of token ids, or a list of either."""
    if isinstance(prompts, str) or _is_token_list(prompts):
        prompts = [prompts]
    if not isinstance(prompts, list | tuple) or not prompts:
        raise ValueError("prompts must be a string, a list of token ids, or a non-empty list")
    return [_to_input(prompt, tokenizer) for prompt in prompts]


def _is_token_list(value: object) -> bool:
    return isinstance(value, list | tuple) and bool(value) and isinstance(value[0], int)


def _to_input(prompt: object, tokenizer: Tokenizer) -> PromptInput:
    if isinstance(prompt, str):
        return PromptInput(prompt, tokenizer.encode(prompt))
    if isinstance(prompt, list | tuple) and all(isinstance(t, int) for t in prompt):
        return PromptInput(None, list(prompt))
    raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")


class PromptError(ValueError):
    """The prompt itself is unusable (not token ids, empty, ids outside the vocabulary, longer
    than the context, more KV blocks than the cache holds)."""

    def __init__(self, message: str, code: str = "invalid_value") -> None:
        super().__init__(message)
        self.code = code  # OpenAI's error code, e.g. "context_length_exceeded"


def check_prompt(
    prompt_token_ids: object,
    vocab_size: int,
    max_model_len: int,
    block_size: int | None = None,
    num_kv_blocks: int | None = None,
) -> None:
    """Raises PromptError for a prompt no engine of this model can serve. The KV cache's size
    (`block_size`, `num_kv_blocks`) is checked when given: the engine knows it, the gateway
    does not. Read-only."""
    if not isinstance(prompt_token_ids, list | tuple):
        kind = type(prompt_token_ids).__name__
        raise PromptError(f"prompt_token_ids must be a list of token ids, got {kind}")
    if not prompt_token_ids:
        raise PromptError("prompt must not be empty")
    bad = [t for t in prompt_token_ids if not _is_token_id(t, vocab_size)]
    if bad:
        raise PromptError(f"prompt_token_ids contains ids outside [0, {vocab_size}): {bad[:5]}")
    num_tokens = len(prompt_token_ids)
    if num_tokens >= max_model_len:
        raise PromptError(
            f"prompt has {num_tokens} tokens; the context length (max_model_len) is "
            f"{max_model_len}, which must leave room for at least one output token",
            code="context_length_exceeded",
        )
    if block_size is not None and num_kv_blocks is not None:
        num_blocks = -(-(num_tokens + 1) // block_size)  # the prompt and one output token
        if num_blocks > num_kv_blocks:
            raise PromptError(
                f"prompt needs {num_blocks} KV blocks but the cache holds only "
                f"{num_kv_blocks} (see kv_cache_bytes)"
            )


def _is_token_id(value: object, vocab_size: int) -> bool:
    # bool is an int, and 2.0 would index a tensor only after a confusing error inside a step.
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab_size


def child_sequences(request_id: str, params: SamplingParams) -> list[tuple[str, SamplingParams]]:
    """One (sequence id, params) per output sequence; n = 1 keeps the id unchanged.

    Child i of a seeded request gets seed + i, so child 0 samples what the same request with
    n = 1 would, and the siblings differ from each other.
    """
    if params.n == 1:
        return [(request_id, params)]
    children = []
    for index in range(params.n):
        seed = None if params.seed is None else (params.seed + index) % 2**63
        children.append((f"{request_id}{CHILD_SEPARATOR}{index}", replace(params, n=1, seed=seed)))
    return children
