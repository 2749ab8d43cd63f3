"""The measurements in order: each system started once, its saturation (where it has one to
measure) and then every workload at every load, with a progress line per step."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from benchmarks.goodput.clients import (
    Measured,
    Workload,
    our_open_loop,
    vllm_open_loop,
    vllm_saturation,
    warm_up,
)
from benchmarks.goodput.figures import (
    LoadFigures,
    load_seeds,
    num_arrivals,
    offered_rates,
    summarize,
)
from benchmarks.goodput.systems import BASELINE, VLLM, Served, System, serving

VLLM_CLIENT = "vllm's"
OUR_CLIENT = "ours"
# Guesses for the time estimate printed at the start: starting each system, and what one
# `vllm bench serve` spends importing vLLM and sampling its dataset before it sends anything.
START_S = {VLLM: 180.0}
STACK_START_S = 60.0
CLIENT_OVERHEAD_S = 20.0
SATURATION_RUN_S = 60.0


@dataclass(frozen=True)
class Options:
    duration_s: float
    load_factors: list[float]
    workloads: list[Workload]
    saturation_concurrency: int
    saturation_prompts: int
    seed: int  # the same arrivals for every system at one workload and load
    # splitserve's saturation (req/s) given instead of measured, for runs without the baseline
    reference_rate: float | None = None


@dataclass(frozen=True)
class Row:
    system: str
    client: str
    workload: str
    load_factor: float
    figures: LoadFigures
    client_goodput: float | None  # vLLM's client's own loose-pair goodput, as a cross-check


@dataclass
class Results:
    saturation: dict[str, dict[str, float]] = field(default_factory=dict)  # system -> workload
    rows: list[Row] = field(default_factory=list)


def num_steps(systems: list[System], options: Options) -> int:
    total = 0
    for system in systems:
        per_load = 2 if system.our_client_too else 1
        total += len(options.workloads) * (
            system.measures_saturation + per_load * len(options.load_factors)
        )
    return total


def expected_s(systems: list[System], options: Options) -> float:
    """A rough guess: without admission a load of k x saturation for D seconds leaves a
    backlog that drains for about (k - 1) x D more; with admission the excess is refused."""
    total = 0.0
    for system in systems:
        total += START_S.get(system.name, STACK_START_S)
        total += system.measures_saturation * len(options.workloads) * SATURATION_RUN_S
        for factor in options.load_factors:
            drain = 1.1 if system.admission is not None else max(1.0, factor)
            run_s = CLIENT_OVERHEAD_S + options.duration_s * drain
            if system.our_client_too:
                run_s += options.duration_s * (
                    1.1 if system.admission else min(2.0, max(1.0, factor))
                )
            total += run_s * len(options.workloads)
    return total


class Bench:
    def __init__(self, systems: list[System], options: Options) -> None:
        self.systems = systems
        self.options = options
        self.results = Results()
        self._step = 0
        self._num_steps = num_steps(systems, options)
        self._start = time.monotonic()

    def log(self, message: str, step: bool = False) -> None:
        self._step += step
        elapsed = time.monotonic() - self._start
        counter = f" {self._step}/{self._num_steps}" if step else ""
        print(f"[goodput {elapsed / 60:5.1f} min{counter}] {message}", flush=True)

    def run(self) -> Results:
        for system in self.systems:
            self.log(f"starting {system.name}")
            with serving(system) as served:
                warm_up(served.target, self.options.workloads[0], f"warm-{time.time_ns()}")
                for workload in self.options.workloads:
                    self._measure(system, served, workload)
        return self.results

    def _measure(self, system: System, served: Served, workload: Workload) -> None:
        if system.measures_saturation:
            self._saturation(system, served, workload)
        reference = self._reference_rate(workload)
        factors = self.options.load_factors
        for factor, rate, seed in zip(
            factors, offered_rates(reference, factors), load_seeds(self.options.seed, factors)
        ):
            self._load(system, served, workload, factor, rate, seed)

    def _reference_rate(self, workload: Workload) -> float:
        measured = self.results.saturation.get(BASELINE, {}).get(workload.name)
        if measured is not None:
            return measured
        assert self.options.reference_rate is not None, "checked when the options were made"
        return self.options.reference_rate

    def _saturation(self, system: System, served: Served, workload: Workload) -> None:
        o = self.options
        self.log(
            f"{system.name} / {workload.name}: saturation, closed loop of "
            f"{o.saturation_concurrency} streams, {o.saturation_prompts} requests",
            step=True,
        )
        rate = vllm_saturation(
            served.base_url,
            served.model,
            workload,
            o.saturation_concurrency,
            o.saturation_prompts,
            o.seed,
        )
        self.results.saturation.setdefault(system.name, {})[workload.name] = rate
        self.log(f"{system.name} / {workload.name}: saturates at {rate:.2f} req/s")

    def _load(
        self,
        system: System,
        served: Served,
        workload: Workload,
        factor: float,
        rate: float,
        seed: int,
    ) -> None:
        o = self.options
        num_prompts = num_arrivals(rate, o.duration_s)
        where = f"{system.name} / {workload.name} / {factor:g}x = {rate:.2f} req/s"
        self.log(f"{where}: vLLM's client, {num_prompts} requests", step=True)
        measured = vllm_open_loop(served.base_url, served.model, workload, rate, num_prompts, seed)
        self._record(system, VLLM_CLIENT, workload, factor, rate, measured)
        if system.our_client_too:
            self.log(f"{where}: our client, {o.duration_s:.0f} s of arrivals", step=True)
            measured = our_open_loop(
                served.target, workload, rate, o.duration_s, f"goodput-{workload.name}-{seed}"
            )
            served.wait_idle()
            self._record(system, OUR_CLIENT, workload, factor, rate, measured)

    def _record(
        self,
        system: System,
        client: str,
        workload: Workload,
        factor: float,
        rate: float,
        measured: Measured,
    ) -> None:
        figures = summarize(measured.outcomes, measured.duration_s, rate)
        row = Row(system.name, client, workload.name, factor, figures, measured.client_goodput)
        self.results.rows.append(row)
        f = figures
        self.log(
            f"  -> {f.num_completed} done, {f.num_refused} refused, {f.num_failed} failed; "
            f"goodput {f.goodput['loose']:.2f} / {f.goodput['tight']:.2f} req/s (loose/tight)"
        )
