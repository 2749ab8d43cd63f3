"""transformers' greedy decoding of one prompt, the reference the engine is checked against."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

SMOLLM2_EOS = 2


def transformers_greedy(
    model: Any,
    prompt: list[int],
    max_new_tokens: int,
    logits_processors: Sequence[Any] = (),
    eos_token_id: int = SMOLLM2_EOS,
) -> list[int]:
    """The new token ids of `model.generate` on `prompt` alone (no padding), greedy, with any
    `transformers.LogitsProcessor`s applied to each step's scores."""
    from transformers import LogitsProcessorList

    ids = torch.tensor([prompt])
    with torch.no_grad():
        generated = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=eos_token_id,
            pad_token_id=eos_token_id,
            logits_processor=LogitsProcessorList(list(logits_processors)),
        )
    return generated[0, len(prompt) :].tolist()


def greedy_references(
    checkpoint: str, prompts: list[list[int]], max_new_tokens: int, eos_token_id: int
) -> list[list[int]]:
    """transformers' greedy tokens for each prompt of a Hugging Face checkpoint, float32, up to
    and including EOS (after EOS transformers pads; the engine stops)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    out = []
    for prompt in prompts:
        tokens = transformers_greedy(model, prompt, max_new_tokens, eos_token_id=eos_token_id)
        if eos_token_id in tokens:
            tokens = tokens[: tokens.index(eos_token_id) + 1]
        out.append(tokens)
    return out
