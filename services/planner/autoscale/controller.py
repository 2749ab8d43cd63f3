"""The autoscaler: reads live load, decides prefill and decode replica counts, and patches the
Deployments' scale subresource through the Kubernetes API.

Per role, each reading is a breach, idle, or neither:

    prefill breach: recent TTFT p90 > the TTFT SLO, or more than 1 request waiting per pod
    prefill idle:   TTFT p90 < low_water * SLO (or none measured), nothing waiting
    decode breach:  recent ITL p90 > the ITL SLO, KV use > 90%, or requests waiting
    decode idle:    ITL p90 < low_water * SLO (or none measured), KV use < 50%, nothing waiting

and the planner's model (with a profile and measured arrival rates) says how many pods the
load needs: the fewest with which `recommend`'s test (`sizing.judge`: the measured rate and mean
lengths simulated under several seeds, `attainment` of the requests within both SLOs in
`confidence` of them) passes, the other role kept at its current count. A role scales up
after `breach_readings` breaches in a row (to the model's count if higher, else by one), or
as soon as the model's count exceeds the current one for as many readings; it scales down by
one after `idle_readings` idle readings in a row and only if the model agrees. Any change
waits `cooldown_s` after the last one of that role. The band between low_water and the SLO,
the run lengths and the cooldown are what keep it from flapping.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from splitserve.loadgen.stats import Slo
from splitserve.planner.autoscale.load import LoadSnapshot
from splitserve.planner.profile import Profile
from splitserve.planner.sizing import Target, pods_needed, steady_workload

ROLES = ("prefill", "decode")
MODEL_CACHE_SIZE = 256  # model answers kept, by reading


@dataclass(frozen=True)
class Bounds:
    min_replicas: int
    max_replicas: int

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas:
            raise ValueError(
                f"need 0 <= min <= max replicas, got {self.min_replicas}, {self.max_replicas}"
            )

    def clamp(self, replicas: int) -> int:
        return min(max(replicas, self.min_replicas), self.max_replicas)


@dataclass(frozen=True)
class PolicySettings:
    ttft_slo_s: float
    itl_slo_s: float
    prefill: Bounds
    decode: Bounds
    cooldown_s: float = 120.0
    breach_readings: int = 3
    idle_readings: int = 6
    low_water: float = 0.5  # idle below this fraction of the SLO
    # The model's target, as `plan recommend` takes it.
    attainment: float = 0.9
    confidence: float = 0.8
    num_seeds: int = 3
    # The cluster the model simulates, as recommend's flags: the decode pods' conditional-
    # disaggregation limit and how many pods share a machine.
    max_remote_prefill_tokens: int = 0
    pods_per_host: int = 1

    def __post_init__(self) -> None:
        if self.ttft_slo_s <= 0 or self.itl_slo_s <= 0:
            raise ValueError("--ttft-slo and --itl-slo must be > 0 seconds")
        if self.max_remote_prefill_tokens < 0 or self.pods_per_host < 1:
            raise ValueError("--max-remote-prefill-tokens must be >= 0, --pods-per-host >= 1")
        if self.cooldown_s < 0:
            raise ValueError("--cooldown must be >= 0 seconds")
        if self.breach_readings < 1 or self.idle_readings < 1:
            raise ValueError("breach_readings and idle_readings must be >= 1")
        if not 0 < self.low_water < 1:
            raise ValueError("low_water must be in (0, 1)")
        _ = self.target  # Target checks attainment, confidence and num_seeds

    @property
    def target(self) -> Target:
        return Target(
            Slo(self.ttft_slo_s, self.itl_slo_s), self.attainment, self.confidence, self.num_seeds
        )

    @property
    def cluster_options(self) -> dict[str, int]:
        """What `ClusterConfig` takes beside the pod counts, as recommend passes it."""
        return {
            "max_remote_prefill_tokens": self.max_remote_prefill_tokens,
            "pods_per_host": self.pods_per_host,
        }

    def bounds(self, role: str) -> Bounds:
        return self.prefill if role == "prefill" else self.decode


@dataclass(frozen=True)
class RoleDecision:
    role: str
    current: int
    desired: int
    reason: str

    @property
    def changes(self) -> bool:
        return self.desired != self.current


@dataclass
class _RoleState:
    num_breaches: int = 0  # consecutive
    num_idle: int = 0  # consecutive
    num_model_above: int = 0  # consecutive readings where the model wants more pods
    last_change_s: float = -math.inf


@dataclass
class Autoscaler:
    """Pure policy: `decide` is a function of the readings so far and the clock it is given."""

    settings: PolicySettings
    profile: Profile | None = None
    _states: dict[str, _RoleState] = field(
        default_factory=lambda: {role: _RoleState() for role in ROLES}
    )
    # Model answers by (role, rate, lengths, other counts): a reading like the last one asks
    # the simulator nothing new.
    _sized: dict[tuple, int | None] = field(default_factory=dict)

    def decide(
        self, now_s: float, load: LoadSnapshot, current: dict[str, int]
    ) -> list[RoleDecision]:
        return [self._decide_role(role, now_s, load, current) for role in ROLES]

    def _decide_role(
        self, role: str, now_s: float, load: LoadSnapshot, counts: dict[str, int]
    ) -> RoleDecision:
        current = counts[role]
        state = self._states[role]
        breach, idle = self._signals(role, load)
        state.num_breaches = state.num_breaches + 1 if breach else 0
        state.num_idle = state.num_idle + 1 if idle else 0
        needed = self.model_replicas(role, load, counts)
        above = needed is not None and needed > current
        state.num_model_above = state.num_model_above + 1 if above else 0
        signal = breach or ("idle" if idle else "")
        desired, reason = self._desired(role, current, needed, state, signal)
        desired = self.settings.bounds(role).clamp(desired)
        if desired != current and now_s - state.last_change_s < self.settings.cooldown_s:
            wait = self.settings.cooldown_s - (now_s - state.last_change_s)
            return RoleDecision(role, current, current, f"cooldown ({wait:.0f} s left): {reason}")
        if desired != current:
            state.last_change_s = now_s
            state.num_breaches = state.num_idle = state.num_model_above = 0
        return RoleDecision(role, current, desired, reason)

    def _desired(self, role, current, needed, state: _RoleState, signal: str) -> tuple[int, str]:
        settings = self.settings
        if state.num_breaches >= settings.breach_readings:
            target = max(current + 1, needed or 0)
            return target, f"{signal} for {state.num_breaches} readings"
        if state.num_model_above >= settings.breach_readings:
            return needed, f"model needs {needed} for {state.num_model_above} readings"
        if state.num_idle >= settings.idle_readings and (needed is None or needed < current):
            return current - 1, f"idle for {state.num_idle} readings"
        if current < settings.bounds(role).min_replicas:
            return current, "below --min"  # clamped up by the caller
        return current, signal or "within the SLOs"

    def _signals(self, role: str, load: LoadSnapshot) -> tuple[str, bool]:
        """(why it breaches, or ""; whether it is idle)."""
        s = self.settings
        if role == "prefill":
            pods, latency, slo = load.prefill, load.ttft_s, s.ttft_slo_s
            if latency is not None and latency > slo:
                return f"TTFT p90 {latency:.3f} s > {slo:g} s", False
            if pods.waiting_per_pod > 1:
                return f"{pods.num_waiting} waiting on {pods.num_pods} prefill pods", False
            idle = (latency is None or latency < s.low_water * slo) and pods.num_waiting == 0
            return "", idle
        pods, latency, slo = load.decode, load.itl_s, s.itl_slo_s
        if latency is not None and latency > slo:
            return f"ITL p90 {latency:.3f} s > {slo:g} s", False
        if pods.kv_usage > 0.9:
            return f"KV use {pods.kv_usage:.0%}", False
        if pods.num_waiting > 0:
            return f"{pods.num_waiting} waiting on {pods.num_pods} decode pods", False
        idle = (latency is None or latency < s.low_water * slo) and pods.kv_usage < 0.5
        return "", idle

    def model_replicas(self, role: str, load: LoadSnapshot, current: dict[str, int]) -> int | None:
        """Pods of `role` the measured load needs by the profile (None without a profile, a
        measured rate or its token rates, or when even the role's maximum falls short: the
        breach signals then scale it one pod at a time)."""
        rate = load.request_rate
        if self.profile is None or not rate or rate <= 0:
            return None
        if not load.prompt_tokens_per_s or not load.output_tokens_per_s:
            return None
        workload = steady_workload(
            rate, load.prompt_tokens_per_s / rate, load.output_tokens_per_s / rate
        )
        key = (
            role,
            round(rate, 2),
            workload.input_lens,
            workload.output_lens,
            tuple(current.items()),
        )
        if key not in self._sized:
            if len(self._sized) >= MODEL_CACHE_SIZE:
                self._sized.clear()  # a long run's old readings: not worth keeping
            max_pods = max(self.settings.bounds(role).max_replicas, 1)
            self._sized[key] = pods_needed(
                self.profile,
                workload,
                self.settings.target,
                role,
                current,
                max_pods,
                cluster_options=self.settings.cluster_options,
            )
        return self._sized[key]
