"""The parity prompts: eight prompts the engine's greedy output is checked on, token for token.

Four chat-templated questions and four raw texts, every length different and one over 600
tokens (past a 512-token partition of the decode kernels and several KV blocks). The parity
test holds the CPU engine to transformers on them (tests/test_engine_parity.py), and the GPU
check holds the CUDA engine to the CPU engine (benchmarks/gpu_engine_check.py).
"""

from __future__ import annotations

from typing import Any

# New tokens per prompt: enough for a greedy divergence to show, few enough for the slow paths.
PARITY_MAX_TOKENS = 20

_STORY = (
    "The lighthouse keeper had lived on the island for thirty years. Every evening he climbed "
    "the spiral stairs, trimmed the wick, polished the great lens and watched the beam sweep "
    "across the dark water. Ships passed in the night, and he wrote each one in his log: the "
    "hour, the direction, the weather, and sometimes a guess at the cargo. "
)

QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about autumn leaves.",
    "Explain recursion to a child in two sentences.",
    "List three prime numbers greater than fifty, please, with a short reason for each.",
]


def parity_prompts(tokenizer: Any) -> list[list[int]]:
    """The eight prompts' token ids, from the engine's tokenizer (`LLM(...).tokenizer`)."""
    chats = [
        tokenizer.encode(
            tokenizer.apply_chat_template([{"role": "user", "content": q}]),
            add_special_tokens=False,
        )
        for q in QUESTIONS
    ]
    raw = [
        tokenizer.encode("def quicksort(items):"),
        tokenizer.encode("Hi"),
        tokenizer.encode(_STORY * 2 + "Summarise the keeper's routine:"),
        tokenizer.encode(_STORY * 9 + "\nQuestion: what did the keeper write in his log?"),
    ]
    prompts = chats + raw
    assert max(len(p) for p in prompts) > 600, "one prompt must be over 600 tokens"
    assert len({len(p) for p in prompts}) == len(prompts), "lengths must differ"
    return prompts
