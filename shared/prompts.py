"""Normalising what callers pass as prompts, and fanning a request out into n sequences."""

from __future__ import annotations

from dataclasses import dataclass, replace

from shared.sampling_params import SamplingParams
from shared.tokenizer import Tokenizer

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
