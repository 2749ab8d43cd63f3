"""The scale benchmark's workload: sessions that each start with one of a few shared system
prompts, seeded into the pods' caches before routing starts, then grown one turn per request;
and the oracle, which reads every pod's `SimCache` directly (not the Redis index)."""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass

from benchmarks.scale.cache import SimCache
from splitserve.engine.kv.block_hash import BlockHash, hash_full_blocks

VOCAB = 32000


@dataclass(frozen=True)
class WorkloadSettings:
    num_system_prompts: int = 16
    system_blocks: int = 16  # a system prompt's length, in blocks
    session_blocks: int = 8  # each session's own history past its system prompt, at the start
    turn_tokens: int = 40  # a new user message per request
    block_size: int = 16

    def __post_init__(self) -> None:
        if self.num_system_prompts < 1 or self.system_blocks < 1 or self.turn_tokens < 1:
            raise ValueError("counts must be >= 1")

    @property
    def session_blocks_total(self) -> int:
        return self.system_blocks + self.session_blocks


class Workload:
    """Sessions by index; `session_tokens[i]` grows by a turn each time session i is sent."""

    def __init__(self, settings: WorkloadSettings, seed: int = 0) -> None:
        self.settings = settings
        self.rng = random.Random(seed)
        length = settings.system_blocks * settings.block_size
        self.system_prompts = [self._tokens(length) for _ in range(settings.num_system_prompts)]
        self.session_tokens: list[list[int]] = []

    def _tokens(self, count: int) -> list[int]:
        return [self.rng.randrange(1, VOCAB) for _ in range(count)]

    def new_session(self) -> int:
        system = self.system_prompts[len(self.session_tokens) % len(self.system_prompts)]
        own = self._tokens(self.settings.session_blocks * self.settings.block_size)
        self.session_tokens.append(system + own)
        return len(self.session_tokens) - 1

    def hashes(self, tokens: Sequence[int]) -> list[BlockHash]:
        return hash_full_blocks(tokens, self.settings.block_size, "")

    def next_prompt(self) -> tuple[int, list[int]]:
        """A random session and its next prompt (its history plus a new user message)."""
        session = self.rng.randrange(len(self.session_tokens))
        return session, self.session_tokens[session] + self._tokens(self.settings.turn_tokens)

    def answered(self, session: int, prompt: list[int], output_token_ids: list[int]) -> None:
        self.session_tokens[session] = prompt + output_token_ids


def oracle_cached_blocks(caches: Sequence[SimCache], hashes: Sequence[BlockHash]) -> int:
    """The longest prefix of `hashes` any pod holds: what a router that knew every pod's
    blocks, with no lag, would find."""
    return max((cache.cached_prefix(hashes) for cache in caches), default=0)
