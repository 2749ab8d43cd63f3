"""Which requests arrive when, in two forms:

- `RequestSpec`, what the client sends to a real gateway: prompt token ids and an exact output
  length, in a seeded Poisson or one-at-a-time workload (`poisson_workload`,
  `sequential_workload`). Prompts are ids from the ordinary vocabulary and every prompt starts
  differently, so no request finds another's blocks in a prefix cache and every prefill is
  computed in full; outputs are exact (`ignore_eos`), so every system does the same work.
- `SimRequest`, what the planner's simulator serves: lengths only, and an optional prefix group
  (requests of one group share their first `prefix_len` prompt tokens), from seeded Poisson
  arrivals (`poisson_requests`) or a JSONL trace, one request a line:

      {"arrival_s": 0.31, "input_len": 412, "output_len": 64, "prefix_group": "sys-a",
       "prefix_len": 256}

  (`prefix_group` and `prefix_len` are optional; arrivals need not be sorted.)

Both draw lengths from one `LengthDistribution`.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from dataclasses import dataclass

# SmolLM2 keeps its special tokens below 20; ids in this range are ordinary word pieces.
VOCAB_RANGE = (1000, 40000)


@dataclass(frozen=True)
class LengthDistribution:
    """Uniform integers in [low, high] ("64-512"), or a fixed length ("128")."""

    low: int
    high: int

    def __post_init__(self) -> None:
        if not 1 <= self.low <= self.high:
            raise ValueError(f"lengths need 1 <= low <= high, got {self.low}-{self.high}")

    @classmethod
    def parse(cls, text: str, name: str) -> LengthDistribution:
        try:
            parts = [int(part) for part in text.split("-")]
            if len(parts) not in (1, 2):
                raise ValueError
            return cls(parts[0], parts[-1])
        except ValueError:
            raise ValueError(f"{name} must look like 64-512 or 128, got {text!r}") from None

    @property
    def mean(self) -> float:
        return (self.low + self.high) / 2

    def draw(self, rng: random.Random) -> int:
        return rng.randint(self.low, self.high)

    def __str__(self) -> str:
        return str(self.low) if self.low == self.high else f"{self.low}-{self.high}"


# ---- what the client sends ------------------------------------------------------------------


@dataclass(frozen=True)
class RequestSpec:
    arrival_s: float  # when to send it, in seconds after the run starts
    prompt_token_ids: list[int]
    max_tokens: int  # exactly this many output tokens (ignore_eos)


@dataclass(frozen=True)
class WorkloadShape:
    prompt_lens: LengthDistribution
    output_lens: LengthDistribution


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
    requests: list[RequestSpec] = []
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
    num_prompt = shape.prompt_lens.draw(rng)
    prompt = [rng.randrange(*VOCAB_RANGE) for _ in range(num_prompt)]
    return RequestSpec(arrival_s, prompt, shape.output_lens.draw(rng))


# ---- what the simulator serves --------------------------------------------------------------


@dataclass(frozen=True)
class SimRequest:
    request_id: int
    arrival_s: float
    input_len: int
    output_len: int  # tokens generated, the first (from prefill) included
    prefix_group: str | None = None
    prefix_len: int = 0  # prompt tokens shared with the rest of `prefix_group`

    def __post_init__(self) -> None:
        if self.arrival_s < 0:
            raise ValueError(f"request {self.request_id}: arrival_s must be >= 0")
        if self.input_len < 1 or self.output_len < 1:
            raise ValueError(f"request {self.request_id}: input_len and output_len must be >= 1")
        if not 0 <= self.prefix_len <= self.input_len:
            raise ValueError(f"request {self.request_id}: prefix_len must be in [0, input_len]")


@dataclass(frozen=True)
class WorkloadSpec:
    """A Poisson workload: `rate` requests/s for `num_requests` requests."""

    rate: float
    num_requests: int
    input_lens: LengthDistribution
    output_lens: LengthDistribution
    # Requests fall into this many prefix groups sharing `prefix_len` tokens (0 = none).
    num_prefix_groups: int = 0
    prefix_len: int = 0

    def __post_init__(self) -> None:
        if self.rate <= 0:
            raise ValueError(f"rate must be > 0, got {self.rate}")
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be >= 1, got {self.num_requests}")
        if self.num_prefix_groups < 0 or self.prefix_len < 0:
            raise ValueError("num_prefix_groups and prefix_len must be >= 0")
        if self.num_prefix_groups and self.prefix_len >= self.input_lens.low:
            raise ValueError("prefix_len must be shorter than the shortest input")


def poisson_requests(spec: WorkloadSpec, seed: int | str = 0) -> list[SimRequest]:
    """The same spec and seed give the same requests (a str seed is hashed stably)."""
    rng = random.Random(seed)
    requests = []
    arrival_s = 0.0
    for request_id in range(spec.num_requests):
        group = None
        if spec.num_prefix_groups:
            group = f"group-{rng.randrange(spec.num_prefix_groups)}"
        requests.append(
            SimRequest(
                request_id,
                arrival_s,
                spec.input_lens.draw(rng),
                spec.output_lens.draw(rng),
                group,
                spec.prefix_len if group else 0,
            )
        )
        arrival_s += rng.expovariate(spec.rate)
    return requests


def load_trace(path: str) -> list[SimRequest]:
    """Requests from a JSONL trace, sorted by arrival; a bad line is a ValueError naming it."""
    requests = []
    try:
        with open(path) as file:
            for line_number, line in enumerate(file, 1):
                if line.strip():
                    requests.append(_trace_request(line, line_number, path))
    except OSError as error:
        raise ValueError(f"--trace: cannot read {path}: {error.strerror}") from None
    if not requests:
        raise ValueError(f"--trace: {path} holds no requests")
    requests.sort(key=lambda request: request.arrival_s)
    return requests


def _trace_request(line: str, line_number: int, path: str) -> SimRequest:
    where = f"--trace {path} line {line_number}"
    try:
        row = json.loads(line)
        group = row.get("prefix_group")
        return SimRequest(
            request_id=line_number,
            arrival_s=float(row["arrival_s"]),
            input_len=int(row["input_len"]),
            output_len=int(row["output_len"]),
            prefix_group=None if group is None else str(group),
            prefix_len=int(row.get("prefix_len", 0)),
        )
    except json.JSONDecodeError as error:
        raise ValueError(f"{where}: not JSON: {error}") from None
    except KeyError as error:
        raise ValueError(f"{where}: missing {error}") from None
    except (TypeError, ValueError, AttributeError) as error:
        raise ValueError(f"{where}: {error}") from None


def write_trace(path: str, requests: list[SimRequest]) -> None:
    with open(path, "w") as file:
        for request in requests:
            row: dict[str, object] = {
                "arrival_s": round(request.arrival_s, 6),
                "input_len": request.input_len,
                "output_len": request.output_len,
            }
            if request.prefix_group is not None:
                row["prefix_group"] = request.prefix_group
                row["prefix_len"] = request.prefix_len
            file.write(json.dumps(row) + "\n")


def as_sim_requests(specs: Sequence[RequestSpec]) -> list[SimRequest]:
    """The same requests (arrival times and lengths) for the simulator."""
    return [
        SimRequest(i, spec.arrival_s, len(spec.prompt_token_ids), spec.max_tokens)
        for i, spec in enumerate(specs)
    ]
