"""The measured cost model of one pod: what a step of a given shape costs on its hardware.

A profile is a JSON file written by `splitserve plan profile` (see `measure/`) and read by
the simulator. It keeps the raw measurements, and the model derived from them:

- prefill: step time against the prompt tokens computed in the step, fitted as
  `a + b * tokens + c * attention_work`, where a chunk of `n` tokens starting at position `s`
  does `n * n + 2 * n * s` units of attention work (it attends to its `s` cached tokens and,
  causally, to itself); the fit is non-negative least squares over the measured points;
- decode: step time against batch size and mean context length, interpolated bilinearly on
  the measured grid (and extrapolated linearly past it): on CPUs small batches take a different
  matmul path, so no low-order formula fits the whole range;
- a mixed step (prefill chunks beside decodes, as a colocated pod runs) costs its prefill by
  the formula plus its decodes by the grid plus the interaction of the two: what a measured
  mixed step (`mixed`, a grid over decodes x chunk tokens) cost beyond that sum, interpolated;
  profiles without `mixed` fall back to the prefill formula over all the step's tokens;
- KV transfer: a fixed latency plus bytes over the measured bandwidth;
- the serving path (`serving`, per topology): costs per step, per streamed row and per
  request that a running stack adds to the bare engine, and the spread of its token gaps,
  measured as part of the profile;
- the engine setup it was measured with (weights, KV dtype, parallel layout);
- KV tier loads (`tier_loads`): bytes per second back from the host and disk tiers;
- steps beside another pod on the same machine (`neighbor`): how much longer they take.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace

import numpy as np

from splitserve.planner.profile.parts import (
    TOPOLOGIES,
    DecodeGrid,
    EngineSetup,
    KVTransferModel,
    MixedGrid,
    NeighborSlowdown,
    PrefillSample,
    ServingCosts,
    TierLoadModel,
    bilinear,
    nonnegative_least_squares,
    topology_of,
)

PROFILE_VERSION = 2
# The planner's default margin on measured times (`with_margin`, `--margin`): two validations
# on this VM found the same machine 8-17% slower during the runs than during the profile.
DEFAULT_MARGIN = 0.10
READABLE_VERSIONS = (1, 2)  # version 1: no mixed steps, serving costs or engine setup


@dataclass(frozen=True)
class Profile:
    """One pod's costs, and the engine limits it was measured with."""

    description: str  # hardware and settings, for people
    prefill: list[PrefillSample]
    decode: DecodeGrid
    kv_transfer: KVTransferModel
    block_size: int
    num_kv_blocks: int  # the KV capacity of one pod
    kv_bytes_per_token: int
    max_num_batched_tokens: int
    max_num_seqs: int = 128
    # Fixed client-visible cost per request (gateway, tokenizer, RPC hops), added to TTFT.
    request_overhead_s: float = 0.0
    # Fixed cost the serving process adds to every engine step (asyncio hand-offs, streaming
    # the step's tokens over gRPC); 0 for the bare engine.
    step_overhead_s: float = 0.0
    # Cost per request a step streams a token for (one gRPC message and one SSE event each).
    row_overhead_s: float = 0.0
    # Cost per prompt token, added to TTFT (the serving path's part that grows with the prompt).
    token_overhead_s: float = 0.0
    # Equally likely deviations of a client-seen token gap from the step that made it
    # (`ServingCosts.itl_spread_s`); empty for the bare engine.
    itl_spread_s: tuple[float, ...] = ()
    mixed: MixedGrid | None = None
    # Topology ("colocated", "disaggregated") -> what its running stack adds; `for_topology`
    # turns one into the overheads above.
    serving: dict[str, ServingCosts] = field(default_factory=dict)
    engine: EngineSetup = field(default_factory=EngineSetup)
    tier_loads: TierLoadModel | None = None  # None: no offload tiers measured
    # Steps beside another pod's on one machine (`--neighbor`); None: not measured.
    neighbor: NeighborSlowdown | None = None
    version: int = PROFILE_VERSION
    # Derived from `prefill` in __post_init__: seconds = a + b * tokens + c * attention work.
    prefill_coefficients: tuple[float, float, float] = field(default=(0.0, 0.0, 0.0))
    # Derived from `mixed`: [batch][chunk] seconds beyond prefill formula + decode grid.
    mixed_interaction: tuple[tuple[float, ...], ...] = field(default=())

    def __post_init__(self) -> None:
        if self.version not in READABLE_VERSIONS:
            raise ValueError(
                f"profile version must be one of {READABLE_VERSIONS}, got {self.version}"
            )
        if len(self.prefill) < 3:
            raise ValueError("profile.prefill needs at least 3 samples to fit")
        for name in ("block_size", "num_kv_blocks", "max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"profile.{name} must be >= 1, got {getattr(self, name)}")
        overheads = (
            self.request_overhead_s,
            self.step_overhead_s,
            self.row_overhead_s,
            self.token_overhead_s,
        )
        if min(self.kv_bytes_per_token, *overheads) < 0:
            raise ValueError("kv_bytes_per_token and the overheads must be >= 0")
        unknown = set(self.serving) - set(TOPOLOGIES)
        if unknown:
            raise ValueError(f"profile.serving: unknown topologies {sorted(unknown)}")
        object.__setattr__(self, "itl_spread_s", tuple(float(s) for s in self.itl_spread_s))
        object.__setattr__(self, "prefill_coefficients", _fit_prefill(self.prefill))
        object.__setattr__(self, "mixed_interaction", self._interaction_grid())

    # ---- the cost model ------------------------------------------------------------------

    def step_s(self, prefill_chunks: list[tuple[int, int]], num_decodes: int, context_sum: int):
        """Seconds of one engine step computing `prefill_chunks` ((num_tokens, start) each)
        beside `num_decodes` decode tokens whose contexts add up to `context_sum`."""
        if not prefill_chunks and num_decodes == 0:
            return 0.0
        num_rows = num_decodes + len(prefill_chunks)
        serving_s = self.step_overhead_s + self.row_overhead_s * num_rows
        if not prefill_chunks:
            return self.decode.step_s(num_decodes, context_sum / num_decodes) + serving_s
        prefill_s = self._prefill_formula_s(prefill_chunks, 0)
        if not num_decodes:
            return prefill_s + serving_s
        context_len = context_sum / num_decodes
        if self.mixed is None:  # a version-1 profile: the prefill formula over every token
            seconds = self._prefill_formula_s(prefill_chunks, num_decodes)
            return seconds + self._decode_attention_s(num_decodes, context_len) + serving_s
        decode_s = self.decode.step_s(num_decodes, context_len)
        num_tokens = sum(n for n, _ in prefill_chunks)
        interaction_s = bilinear(
            self.mixed.batch_sizes,
            self.mixed.chunk_lens,
            self.mixed_interaction,
            num_decodes,
            num_tokens,
        )
        return max(prefill_s + decode_s + interaction_s, prefill_s, decode_s) + serving_s

    def prefill_s(self, num_tokens: int, start: int = 0) -> float:
        return self.step_s([(num_tokens, start)], 0, 0)

    def _prefill_formula_s(self, chunks: list[tuple[int, int]], extra_tokens: int) -> float:
        a, b, c = self.prefill_coefficients
        num_tokens = sum(n for n, _ in chunks) + extra_tokens
        work = sum(n * n + 2 * n * start for n, start in chunks)
        return a + b * num_tokens + c * work

    def _decode_attention_s(self, batch_size: int, context_len: float) -> float:
        shortest = self.decode.context_lens[0]
        extra = self.decode.step_s(batch_size, context_len)
        return max(extra - self.decode.step_s(batch_size, shortest), 0.0)

    def _interaction_grid(self) -> tuple[tuple[float, ...], ...]:
        if self.mixed is None:
            return ()
        mixed = self.mixed
        return tuple(
            tuple(
                seconds
                - self._prefill_formula_s([(chunk, 0)], 0)
                - self.decode.step_s(batch, mixed.context_len)
                for chunk, seconds in zip(mixed.chunk_lens, row)
            )
            for batch, row in zip(mixed.batch_sizes, mixed.seconds)
        )

    def transfer_s(self, num_tokens: int) -> float:
        num_bytes = num_tokens * self.kv_bytes_per_token
        return self.kv_transfer.latency_s + num_bytes / self.kv_transfer.bandwidth_bytes_per_s

    def tier_load_s(self, tier: str, num_tokens: int) -> float:
        """Seconds to bring `num_tokens` of cached KV back from `tier` ("host" or "disk")."""
        if self.tier_loads is None:
            raise ValueError("the profile has no KV tier loads: measure with `plan profile`")
        return num_tokens * self.kv_bytes_per_token / self.tier_loads.bytes_per_s(tier)

    def with_margin(self, margin: float) -> Profile:
        """This profile with every measured time multiplied by (1 + margin): steps, serving
        costs, transfers and tier loads. The planner's deliberate pessimism (`--margin`): a
        profile taken in half a minute reproduces the machine of that half minute, and on a
        shared VM the same machine measured 8-17% slower minutes later (docs/planner.md)."""
        if not 0 <= margin < 10:
            raise ValueError(f"margin must be in [0, 10), got {margin}")
        if margin == 0:
            return self
        factor = 1.0 + margin
        return replace(
            self._with_engine_scale(factor),
            tier_loads=(
                TierLoadModel(
                    self.tier_loads.host_bytes_per_s / factor,
                    self.tier_loads.disk_bytes_per_s / factor,
                )
                if self.tier_loads is not None
                else None
            ),
            serving={name: costs.scaled(factor) for name, costs in self.serving.items()},
            request_overhead_s=self.request_overhead_s * factor,
            token_overhead_s=self.token_overhead_s * factor,
            step_overhead_s=self.step_overhead_s * factor,
            row_overhead_s=self.row_overhead_s * factor,
            itl_spread_s=tuple(deviation * factor for deviation in self.itl_spread_s),
        )

    def _with_engine_scale(self, factor: float) -> Profile:
        """The engine's measured times (steps, KV transfers) multiplied by `factor`."""
        if factor == 1:
            return self
        return replace(
            self,
            prefill=[PrefillSample(s.num_tokens, s.seconds * factor) for s in self.prefill],
            decode=replace(self.decode, seconds=_scaled(self.decode.seconds, factor)),
            mixed=(
                replace(self.mixed, seconds=_scaled(self.mixed.seconds, factor))
                if self.mixed is not None
                else None
            ),
            kv_transfer=KVTransferModel(
                self.kv_transfer.bandwidth_bytes_per_s / factor,
                self.kv_transfer.latency_s * factor,
            ),
        )

    def at_pace(self, prefill_factor: float, decode_factor: float) -> Profile:
        """This profile's steps as the engine ran them at another moment: prefill and mixed
        steps (compute-bound) times `prefill_factor`, decode steps (memory-bound) times
        `decode_factor`; transfers unchanged. A running stack's costs are taken against the
        engine of the same minute (`measure/serving.py`): a shared VM's speed drifts by a tenth
        or more between the profile's steps and the stack's requests."""
        if min(prefill_factor, decode_factor) <= 0:
            raise ValueError("pace factors must be > 0")
        return replace(
            self,
            prefill=[PrefillSample(s.num_tokens, s.seconds * prefill_factor) for s in self.prefill],
            decode=replace(self.decode, seconds=_scaled(self.decode.seconds, decode_factor)),
            mixed=(
                replace(self.mixed, seconds=_scaled(self.mixed.seconds, prefill_factor))
                if self.mixed is not None
                else None
            ),
        )

    def for_topology(self, num_prefill: int) -> Profile:
        """This profile with the serving costs measured for a topology like the cluster's
        (P = 0 colocated, else disaggregated) as its overheads, and its engine times by their
        `engine_scale`; unchanged without them."""
        costs = self.serving.get(topology_of(num_prefill))
        if costs is None:
            return self
        return replace(
            self._with_engine_scale(costs.engine_scale),
            step_overhead_s=costs.step_s,
            row_overhead_s=costs.row_s,
            request_overhead_s=costs.request_s,
            token_overhead_s=costs.token_s,
            itl_spread_s=costs.itl_spread_s,
        )

    # ---- JSON ----------------------------------------------------------------------------

    def to_json(self) -> dict:
        body = asdict(self)
        body.pop("prefill_coefficients")
        body.pop("mixed_interaction")
        return body

    @classmethod
    def from_json(cls, body: dict) -> Profile:
        try:
            fields = dict(body)
            fields.pop("prefill_coefficients", None)
            fields.pop("mixed_interaction", None)
            fields["prefill"] = [PrefillSample(**sample) for sample in body["prefill"]]
            fields["decode"] = DecodeGrid(**body["decode"])
            fields["kv_transfer"] = KVTransferModel(**body["kv_transfer"])
            if body.get("mixed") is not None:
                fields["mixed"] = MixedGrid(**body["mixed"])
            fields["serving"] = {
                name: ServingCosts(**costs) for name, costs in body.get("serving", {}).items()
            }
            fields["engine"] = EngineSetup(**body.get("engine", {}))
            if body.get("tier_loads") is not None:
                fields["tier_loads"] = TierLoadModel(**body["tier_loads"])
            if body.get("neighbor") is not None:
                fields["neighbor"] = NeighborSlowdown(**body["neighbor"])
            return cls(**fields)
        except (KeyError, TypeError, AttributeError) as error:
            raise ValueError(f"not a planner profile: {error}") from None

    def save(self, path: str) -> None:
        with open(path, "w") as file:
            json.dump(self.to_json(), file, indent=2)
            file.write("\n")


def load_profile(path: str) -> Profile:
    try:
        with open(path) as file:
            body = json.load(file)
    except OSError as error:
        raise ValueError(f"--profile: cannot read {path}: {error.strerror}") from None
    except json.JSONDecodeError as error:
        raise ValueError(f"--profile: {path} is not JSON: {error}") from None
    if not isinstance(body, dict):
        raise ValueError(f"--profile: {path} must hold a JSON object")
    return Profile.from_json(body)


def _scaled(grid: list[list[float]], factor: float) -> list[list[float]]:
    return [[value * factor for value in row] for row in grid]


def _fit_prefill(samples: list[PrefillSample]) -> tuple[float, float, float]:
    tokens = np.array([s.num_tokens for s in samples], dtype=float)
    seconds = np.array([s.seconds for s in samples], dtype=float)
    features = np.stack([np.ones_like(tokens), tokens, tokens * tokens], axis=1)
    # Relative residuals: short prompts matter as much as long ones.
    weights = 1.0 / np.maximum(seconds, 1e-6)
    coefficients = nonnegative_least_squares(features * weights[:, None], seconds * weights)
    a, b, c = (float(value) for value in coefficients)
    return a, b, c


def synthetic_profile(
    prefill_fixed_s: float,
    prefill_per_token_s: float = 0.0,
    decode_step_s: float = 0.02,
    decode_per_seq_s: float = 0.0,
    num_kv_blocks: int = 100_000,
    block_size: int = 16,
    max_num_batched_tokens: int = 512,
    kv_bytes_per_token: int = 0,
    transfer_bandwidth: float = 1e12,
    transfer_latency_s: float = 0.0,
) -> Profile:
    """A profile from closed-form costs instead of measurements: prefill of n tokens takes
    `prefill_fixed_s + n * prefill_per_token_s`, a decode step of batch B takes
    `decode_step_s + B * decode_per_seq_s` at any context. For what-if questions and tests."""
    lens = (16, 256, 4096)
    prefill = [PrefillSample(n, prefill_fixed_s + n * prefill_per_token_s) for n in lens]
    batches = [1, 1024]
    decode = DecodeGrid(
        batches,
        [16, 1 << 20],
        [[decode_step_s + b * decode_per_seq_s] * 2 for b in batches],
    )
    return Profile(
        description="synthetic",
        prefill=prefill,
        decode=decode,
        kv_transfer=KVTransferModel(transfer_bandwidth, transfer_latency_s),
        block_size=block_size,
        num_kv_blocks=num_kv_blocks,
        kv_bytes_per_token=kv_bytes_per_token,
        max_num_batched_tokens=max_num_batched_tokens,
    )
