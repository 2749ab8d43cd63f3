"""The measured cost model of one pod: what a step of a given shape costs on its hardware.

A profile is a JSON file written by `splitserve plan profile` (see `profiler.py`) and read by
the simulator. It keeps the raw measurements, and the model derived from them:

- prefill: step time against the prompt tokens computed in the step, fitted as
  `a + b * tokens + c * attention_work`, where a chunk of `n` tokens starting at position `s`
  does `n * n + 2 * n * s` units of attention work (it attends to its `s` cached tokens and,
  causally, to itself); the fit is non-negative least squares over the measured points;
- decode: step time against batch size and mean context length, interpolated bilinearly on
  the measured grid (and extrapolated linearly past it): on CPUs small batches take a different
  matmul path, so no low-order formula fits the whole range;
- a mixed step (prefill chunks beside decodes, as a colocated pod runs) costs the prefill
  formula over all its tokens plus the decodes' attention beyond the shortest measured context;
- KV transfer: a fixed latency plus bytes over the measured bandwidth.
"""

from __future__ import annotations

import itertools
import json
from bisect import bisect_right
from dataclasses import asdict, dataclass, field

import numpy as np

PROFILE_VERSION = 1


@dataclass(frozen=True)
class PrefillSample:
    num_tokens: int  # prompt tokens computed in the step (one prompt, from position 0)
    seconds: float


@dataclass(frozen=True)
class DecodeGrid:
    """Decode step seconds measured at every (batch size, context length) pair."""

    batch_sizes: list[int]  # increasing
    context_lens: list[int]  # increasing
    seconds: list[list[float]]  # [batch index][context index]

    def __post_init__(self) -> None:
        _check_increasing(self.batch_sizes, "decode.batch_sizes")
        _check_increasing(self.context_lens, "decode.context_lens")
        shape_ok = len(self.seconds) == len(self.batch_sizes) and all(
            len(row) == len(self.context_lens) for row in self.seconds
        )
        if not shape_ok:
            raise ValueError("decode.seconds must be [len(batch_sizes)][len(context_lens)]")
        if any(value <= 0 for row in self.seconds for value in row):
            raise ValueError("decode.seconds must all be > 0")

    def step_s(self, batch_size: float, context_len: float) -> float:
        """Bilinear in (batch, context), linear extrapolation outside the grid."""
        per_batch = [_interpolate(self.context_lens, row, context_len) for row in self.seconds]
        return max(_interpolate(self.batch_sizes, per_batch, batch_size), 1e-9)


@dataclass(frozen=True)
class KVTransferModel:
    bandwidth_bytes_per_s: float
    latency_s: float  # per transfer: the offer/ready/done round trips and the RPC

    def __post_init__(self) -> None:
        if self.bandwidth_bytes_per_s <= 0 or self.latency_s < 0:
            raise ValueError("kv_transfer needs bandwidth_bytes_per_s > 0 and latency_s >= 0")


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
    # the step's tokens over gRPC); 0 for the bare engine that `profile` measures.
    step_overhead_s: float = 0.0
    version: int = PROFILE_VERSION
    # Derived from `prefill` in __post_init__: seconds = a + b * tokens + c * attention work.
    prefill_coefficients: tuple[float, float, float] = field(default=(0.0, 0.0, 0.0))

    def __post_init__(self) -> None:
        if self.version != PROFILE_VERSION:
            raise ValueError(f"profile version must be {PROFILE_VERSION}, got {self.version}")
        if len(self.prefill) < 3:
            raise ValueError("profile.prefill needs at least 3 samples to fit")
        for name in ("block_size", "num_kv_blocks", "max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"profile.{name} must be >= 1, got {getattr(self, name)}")
        if min(self.kv_bytes_per_token, self.request_overhead_s, self.step_overhead_s) < 0:
            raise ValueError(
                "kv_bytes_per_token, request_overhead_s and step_overhead_s must be >= 0"
            )
        object.__setattr__(self, "prefill_coefficients", _fit_prefill(self.prefill))

    # ---- the cost model ------------------------------------------------------------------

    def step_s(self, prefill_chunks: list[tuple[int, int]], num_decodes: int, context_sum: int):
        """Seconds of one engine step computing `prefill_chunks` ((num_tokens, start) each)
        beside `num_decodes` decode tokens whose contexts add up to `context_sum`."""
        if not prefill_chunks:
            if num_decodes == 0:
                return 0.0
            decode_s = self.decode.step_s(num_decodes, context_sum / num_decodes)
            return decode_s + self.step_overhead_s
        a, b, c = self.prefill_coefficients
        num_tokens = sum(n for n, _ in prefill_chunks) + num_decodes
        work = sum(n * n + 2 * n * start for n, start in prefill_chunks)
        seconds = a + b * num_tokens + c * work + self.step_overhead_s
        if num_decodes:
            seconds += self._decode_attention_s(num_decodes, context_sum / num_decodes)
        return seconds

    def prefill_s(self, num_tokens: int, start: int = 0) -> float:
        return self.step_s([(num_tokens, start)], 0, 0)

    def _decode_attention_s(self, batch_size: int, context_len: float) -> float:
        shortest = self.decode.context_lens[0]
        extra = self.decode.step_s(batch_size, context_len)
        return max(extra - self.decode.step_s(batch_size, shortest), 0.0)

    def transfer_s(self, num_tokens: int) -> float:
        num_bytes = num_tokens * self.kv_bytes_per_token
        return self.kv_transfer.latency_s + num_bytes / self.kv_transfer.bandwidth_bytes_per_s

    # ---- JSON ----------------------------------------------------------------------------

    def to_json(self) -> dict:
        body = asdict(self)
        body.pop("prefill_coefficients")
        return body

    @classmethod
    def from_json(cls, body: dict) -> Profile:
        try:
            fields = dict(body)
            fields.pop("prefill_coefficients", None)
            fields["prefill"] = [PrefillSample(**sample) for sample in body["prefill"]]
            fields["decode"] = DecodeGrid(**body["decode"])
            fields["kv_transfer"] = KVTransferModel(**body["kv_transfer"])
            return cls(**fields)
        except (KeyError, TypeError) as error:
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


def _fit_prefill(samples: list[PrefillSample]) -> tuple[float, float, float]:
    tokens = np.array([s.num_tokens for s in samples], dtype=float)
    seconds = np.array([s.seconds for s in samples], dtype=float)
    features = np.stack([np.ones_like(tokens), tokens, tokens * tokens], axis=1)
    # Relative residuals: short prompts matter as much as long ones.
    weights = 1.0 / np.maximum(seconds, 1e-6)
    coefficients = nonnegative_least_squares(features * weights[:, None], seconds * weights)
    a, b, c = (float(value) for value in coefficients)
    return a, b, c


def nonnegative_least_squares(matrix: np.ndarray, target: np.ndarray) -> np.ndarray:
    """argmin ||matrix @ x - target|| over x >= 0, for a few columns (what scipy's `nnls`
    computes, without scipy: it is not a dependency, and the autoscaler loads profiles).

    Exact by enumeration: the optimum is the unconstrained least-squares solution on its own
    support (the columns where it is > 0), so among the 2^n supports the best one whose
    solution comes out non-negative is it. 8 small solves for the prefill fit's 3 columns."""
    num_columns = matrix.shape[1]
    best = np.zeros(num_columns)
    best_residual = float(np.linalg.norm(target))  # the empty support: x = 0
    for support in itertools.product((False, True), repeat=num_columns):
        columns = np.flatnonzero(support)
        if columns.size == 0:
            continue
        solution = np.linalg.lstsq(matrix[:, columns], target, rcond=None)[0]
        if (solution < 0).any():
            continue
        candidate = np.zeros(num_columns)
        candidate[columns] = solution
        residual = float(np.linalg.norm(matrix @ candidate - target))
        if residual < best_residual:
            best, best_residual = candidate, residual
    return best


def _interpolate(xs: list[int], ys: list[float], x: float) -> float:
    """Piecewise linear through (xs, ys); flat below xs[0], linear past xs[-1]."""
    if len(xs) == 1 or x <= xs[0]:
        return ys[0]
    i = min(max(bisect_right(xs, x) - 1, 0), len(xs) - 2)
    x0, x1 = xs[i], xs[i + 1]
    return ys[i] + (ys[i + 1] - ys[i]) * (x - x0) / (x1 - x0)


def _check_increasing(values: list[int], name: str) -> None:
    if not values or any(b <= a for a, b in zip(values, values[1:])):
        raise ValueError(f"{name} must be a non-empty increasing list, got {values}")


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
