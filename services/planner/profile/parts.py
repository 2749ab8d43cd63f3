"""The measured pieces a planner profile is made of (see `cost_model.py` for how they combine).

Each is a small frozen record that checks itself, so a hand-edited or truncated profile file
fails at load with the field's name rather than deep inside a simulation.
"""

from __future__ import annotations

import itertools
from bisect import bisect_right
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

TOPOLOGIES = ("colocated", "disaggregated")


def topology_of(num_prefill: int) -> str:
    """The topology whose serving costs a cluster of `num_prefill` prefill pods runs with."""
    return TOPOLOGIES[0] if num_prefill == 0 else TOPOLOGIES[1]


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
        _check_grid(self.batch_sizes, self.context_lens, self.seconds, "decode", "context_lens")

    def step_s(self, batch_size: float, context_len: float) -> float:
        """Bilinear in (batch, context), linear extrapolation outside the grid."""
        return max(
            bilinear(self.batch_sizes, self.context_lens, self.seconds, batch_size, context_len),
            1e-9,
        )


@dataclass(frozen=True)
class MixedGrid:
    """Steps that compute one fresh prefill chunk of C tokens beside B decodes at one context
    length, as a colocated pod runs them: seconds measured at every (B, C) pair.

    Measured because such a step costs more than its prefill and its decodes measured apart
    add up to (the last validation missed a colocated ITL p90 by a third for that reason)."""

    batch_sizes: list[int]  # decodes in the step, increasing
    chunk_lens: list[int]  # prefill tokens in the step, increasing
    context_len: int  # of the decodes
    seconds: list[list[float]]  # [batch index][chunk index]

    def __post_init__(self) -> None:
        _check_grid(self.batch_sizes, self.chunk_lens, self.seconds, "mixed", "chunk_lens")
        if self.context_len < 1:
            raise ValueError(f"mixed.context_len must be >= 1, got {self.context_len}")


@dataclass(frozen=True)
class KVTransferModel:
    bandwidth_bytes_per_s: float
    latency_s: float  # per transfer: the offer/ready/done round trips and the RPC

    def __post_init__(self) -> None:
        if self.bandwidth_bytes_per_s <= 0 or self.latency_s < 0:
            raise ValueError("kv_transfer needs bandwidth_bytes_per_s > 0 and latency_s >= 0")


@dataclass(frozen=True)
class TierLoadModel:
    """How fast the KV offload tiers give blocks back (`measure/tiers.py`)."""

    host_bytes_per_s: float
    disk_bytes_per_s: float

    def __post_init__(self) -> None:
        if self.host_bytes_per_s <= 0 or self.disk_bytes_per_s <= 0:
            raise ValueError("tier_loads needs host_bytes_per_s and disk_bytes_per_s > 0")

    def bytes_per_s(self, tier: str) -> float:
        return self.host_bytes_per_s if tier == "host" else self.disk_bytes_per_s


@dataclass(frozen=True)
class ServingCosts:
    """What the serving path adds to the bare engine, measured on a running stack of one
    topology (`profiler_serving.py`): a cost per engine step, one per request streamed in the
    step (its gRPC message, the gateway's SSE event, on the same core as the engine), and one
    per request before its first token (HTTP, routing, the RPC hops before a remote prefill)."""

    step_s: float = 0.0
    row_s: float = 0.0
    request_s: float = 0.0
    # Per prompt token, before the first token (on a disaggregated stack the pages' way from
    # the prefill pod into the decode pod's cache grows with the prompt).
    token_s: float = 0.0
    # How a request's inter-token gaps on the stack spread around their median: equally likely
    # deviations (seconds; `spread_quantiles`). The profile's steps are medians, so without
    # them every simulated gap of a steady decode is the same and the simulated ITL p90 sits
    # on the p50, where the measured one is 15-40% above it. Empty: none measured.
    itl_spread_s: tuple[float, ...] = ()
    # The running stack's engine steps against the profile's (<= 1): below 1 when the stack
    # ran a lone request's steps faster than the profile measured them minutes before (the
    # machine drifts; the costs above can only add time, so without this a profile taken in a
    # slow half minute would stay slow). The topology's steps are taken this much shorter.
    engine_scale: float = 1.0

    def __post_init__(self) -> None:
        if min(self.step_s, self.row_s, self.request_s, self.token_s) < 0:
            raise ValueError("serving costs must be >= 0 seconds")
        if not MIN_ENGINE_SCALE <= self.engine_scale <= 1:
            raise ValueError(
                f"engine_scale must be in [{MIN_ENGINE_SCALE}, 1], got {self.engine_scale}"
            )
        object.__setattr__(self, "itl_spread_s", tuple(float(s) for s in self.itl_spread_s))

    def scaled(self, factor: float) -> ServingCosts:
        """Every time in these costs multiplied by `factor` (the planner's margin); the engine
        scale is a ratio of times and stays."""
        return ServingCosts(
            self.step_s * factor,
            self.row_s * factor,
            self.request_s * factor,
            self.token_s * factor,
            tuple(deviation * factor for deviation in self.itl_spread_s),
            self.engine_scale,
        )

    def describe(self) -> str:
        line = (
            f"serving costs {self.step_s * 1e3:.1f} ms per step + {self.row_s * 1e3:.2f} ms "
            f"per row, {self.request_s * 1e3:.0f} ms per request + {self.token_s * 1e3:.3f} ms "
            "per prompt token"
        )
        if self.itl_spread_s:
            low, high = self.itl_spread_s[0], self.itl_spread_s[-1]
            line += f"; token gaps {low * 1e3:+.1f} to {high * 1e3:+.1f} ms around the step"
        if self.engine_scale < 1:
            line += f"; engine steps x{self.engine_scale:.3f}"
        return line


# The most a running stack's steps may correct a profile downwards: past it, the profile is
# not of this machine as it runs (measure again rather than trust a correction).
MIN_ENGINE_SCALE = 0.8
SPREAD_QUANTILES = 20  # equally likely deviations kept of a measured gap spread


def spread_quantiles(deviations: list[float]) -> tuple[float, ...]:
    """SPREAD_QUANTILES deviations, one per equal-probability slice of `deviations` (the middle
    of each), so drawing one uniformly follows the measured distribution."""
    if not deviations:
        return ()
    levels = (np.arange(SPREAD_QUANTILES) + 0.5) / SPREAD_QUANTILES
    return tuple(float(q) for q in np.quantile(np.asarray(deviations, dtype=float), levels))


@dataclass(frozen=True)
class NeighborSlowdown:
    """How much longer a step takes while another pod on the same machine runs one, by the
    kinds of the two steps, as a fraction of the step alone (`measure/neighbor.py`). Pods on
    one machine share its memory bandwidth and last-level cache: on the 2-core VM of the
    validation a batch-2 decode step took 0-48% longer beside another decode in 2-second
    windows (it comes and goes; the mean of run 10's five rounds was 25%), about 5-10% beside
    a prefill, and a prefill 0-6% longer beside either. GPU pods on their own devices share
    neither; the simulator applies these only to pods it puts on one host."""

    decode_beside_decode: float = 0.0
    decode_beside_prefill: float = 0.0
    prefill_beside_decode: float = 0.0
    prefill_beside_prefill: float = 0.0

    def __post_init__(self) -> None:
        if min(asdict(self).values()) < 0:
            raise ValueError("neighbor slowdowns must be >= 0")

    def factor(self, kind: str, neighbor_kinds: list[str]) -> float:
        """What a `kind` step's time is multiplied by while steps of `neighbor_kinds` run
        beside it on the same machine (each neighbor adds its share)."""
        return 1.0 + sum(getattr(self, f"{kind}_beside_{other}") for other in neighbor_kinds)


@dataclass(frozen=True)
class EngineSetup:
    """The engine options a profile was measured with: they change step costs and KV capacity,
    so a profile describes one setup, and the planner counts devices by its layout."""

    quantization: str = "none"
    kv_cache_dtype: str = "auto"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    num_threads: int = 1

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "num_threads"):
            if getattr(self, name) < 1:
                raise ValueError(f"engine.{name} must be >= 1, got {getattr(self, name)}")

    @property
    def devices_per_pod(self) -> int:
        """Ranks a pod runs: GPUs on a GPU node, cores' worth of workers on the CPU."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def describe(self) -> str:
        layout = f"TP={self.tensor_parallel_size} PP={self.pipeline_parallel_size}"
        return f"weights {self.quantization}, KV {self.kv_cache_dtype}, {layout}"


# ---- numeric helpers ------------------------------------------------------------------------


def interpolate(xs: Sequence[int], ys: Sequence[float], x: float) -> float:
    """Piecewise linear through (xs, ys); flat below xs[0], linear past xs[-1]."""
    i, weight = _segment(xs, x)
    if weight == 0.0:
        return ys[i]
    return ys[i] + (ys[i + 1] - ys[i]) * weight


def _segment(xs: Sequence[int], x: float) -> tuple[int, float]:
    """(i, w): `interpolate` at x is ys[i] + (ys[i + 1] - ys[i]) * w (w = 0: ys[i] alone)."""
    if len(xs) == 1 or x <= xs[0]:
        return 0, 0.0
    i = min(max(bisect_right(xs, x) - 1, 0), len(xs) - 2)
    return i, (x - xs[i]) / (xs[i + 1] - xs[i])


def bilinear(
    xs: Sequence[int], ys: Sequence[int], values: Sequence[Sequence[float]], x: float, y: float
) -> float:
    """`values[i][j]` at (xs[i], ys[j]), interpolated as `interpolate` does on each axis:
    along y on the (at most two) rows the x segment uses, then along x. The simulator asks
    this for every step it runs, so the other rows are left alone."""
    i, weight = _segment(xs, x)
    low = interpolate(ys, values[i], y)
    if weight == 0.0:
        return low
    return low + (interpolate(ys, values[i + 1], y) - low) * weight


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


def check_increasing(values: list[int], name: str) -> None:
    if not values or any(b <= a for a, b in zip(values, values[1:])):
        raise ValueError(f"{name} must be a non-empty increasing list, got {values}")


def _check_grid(xs: list[int], ys: list[int], seconds, kind: str, y_name: str) -> None:
    check_increasing(xs, f"{kind}.batch_sizes")
    check_increasing(ys, f"{kind}.{y_name}")
    shape_ok = len(seconds) == len(xs) and all(len(row) == len(ys) for row in seconds)
    if not shape_ok:
        raise ValueError(f"{kind}.seconds must be [len(batch_sizes)][len({y_name})]")
    if any(value <= 0 for row in seconds for value in row):
        raise ValueError(f"{kind}.seconds must all be > 0")
