"""The seeded open-loop workload: Poisson arrivals, uniform prompt and output lengths.

Prompts are token ids from the ordinary vocabulary, sent as `prompt: [ids]`; every prompt
starts differently, so no request finds another's blocks in a prefix cache and every prefill
is computed in full. Outputs are exact (`ignore_eos`), so both systems do the same work.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

# SmolLM2 keeps its special tokens below 20; ids in this range are ordinary word pieces.
VOCAB_RANGE = (1000, 40000)


@dataclass(frozen=True)
class LengthRange:
    low: int
    high: int  # inclusive

    def __post_init__(self) -> None:
        if not 1 <= self.low <= self.high:
            raise ValueError(f"length range must have 1 <= low <= high, got {self.low}-{self.high}")

    @classmethod
    def parse(cls, text: str, name: str) -> LengthRange:
        """From "64-512" (or "128" for a fixed length)."""
        try:
            parts = [int(part) for part in text.split("-")]
        except ValueError:
            raise ValueError(f"{name} must look like 64-512, got {text!r}") from None
        if len(parts) not in (1, 2):
            raise ValueError(f"{name} must look like 64-512, got {text!r}")
        try:
            return cls(parts[0], parts[-1])
        except ValueError as error:
            raise ValueError(f"{name}: {error}") from None

    def __str__(self) -> str:
        return f"{self.low}-{self.high}"


@dataclass(frozen=True)
class RequestSpec:
    arrival_s: float  # when to send it, in seconds after the run starts
    prompt_token_ids: list[int]
    max_tokens: int  # exactly this many output tokens (ignore_eos)


@dataclass(frozen=True)
class WorkloadShape:
    prompt_lens: LengthRange
    output_lens: LengthRange


def poisson_workload(
    seed: str, rate: float, duration_s: float, max_requests: int, shape: WorkloadShape
) -> list[RequestSpec]:
    """Requests arriving as a Poisson process of `rate` per second from 0 until `duration_s`
    (at least one, at most `max_requests`). The same arguments give the same requests at the
    same times, whichever system is run."""
    if rate <= 0:
        raise ValueError(f"rate must be > 0, got {rate}")
    rng = random.Random(seed)  # a str seed is hashed with SHA-512: stable across processes
    arrival_s = 0.0
    requests = []
    while arrival_s < duration_s and len(requests) < max_requests:
        requests.append(_request(rng, arrival_s, shape))
        arrival_s += rng.expovariate(rate)
    return requests


def sequential_workload(seed: str, num_requests: int, shape: WorkloadShape) -> list[RequestSpec]:
    """Requests for a closed loop of one (each sent when the previous one finished): the
    unloaded baseline, the limit of an open loop as its rate goes to zero."""
    rng = random.Random(seed)
    return [_request(rng, 0.0, shape) for _ in range(num_requests)]


def _request(rng: random.Random, arrival_s: float, shape: WorkloadShape) -> RequestSpec:
    num_prompt = rng.randint(shape.prompt_lens.low, shape.prompt_lens.high)
    prompt = [rng.randrange(*VOCAB_RANGE) for _ in range(num_prompt)]
    max_tokens = rng.randint(shape.output_lens.low, shape.output_lens.high)
    return RequestSpec(arrival_s, prompt, max_tokens)
