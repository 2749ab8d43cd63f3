"""The local stacks the planner measures on this machine: each engine process pinned to its
own core with one torch thread (what a profile measures), started the way `splitserve up` does.
Shared by `plan profile --serving` (the serving path's costs) and `plan validate`.

Where a stack leaves a core to the serving path, the gateway and the measuring client run
there, pinned. Left to the scheduler they sat on the pod's core in some stacks and not
in others (2026-12-03, an EPYC: a colocated pod's token gaps 8-10 ms beyond the bare engine on
its core for a whole stack's life, -2 ms with the gateway and client on the other core), and a
serving-cost fit read 0 or 12 ms a step from one stack to the next. In a cluster the gateway
has cores of its own.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from splitserve.launcher import UP_MAX_REMOTE_PREFILL_TOKENS
from splitserve.loadgen.client import Target, run_sequential
from splitserve.loadgen.stacks import RunningStack, SystemSetup, usable_cores
from splitserve.loadgen.stats import Slo
from splitserve.loadgen.workload import LengthDistribution, WorkloadShape, sequential_workload
from splitserve.planner.measure.pace import PaceCores
from splitserve.planner.simulate.cluster import ClusterConfig

LOOSE_SLO = Slo(ttft_s=1e9, itl_s=1e9)  # the planner's runs compare latencies, not goodput


@dataclass(frozen=True)
class LocalConfig:
    name: str
    up_flags: tuple[str, ...]
    pins: tuple[str, ...]  # process names pinned to core 0, core 1 (in that order)
    num_prefill: int
    num_decode: int
    # The core (0 or 1, as in `pins`) the gateway and the measuring client share; None:
    # the pods take both cores, and the scheduler places the rest.
    serving_core: int | None = None


# One pod: the other core is the serving path's.
COLOCATED_1 = LocalConfig(
    "colocated-1", ("--colocated", "--decode", "1"), ("decode-0",), 0, 1, serving_core=1
)
COLOCATED_2 = LocalConfig(
    "colocated-2", ("--colocated", "--decode", "2"), ("decode-0", "decode-1"), 0, 2
)
# The serving path beside the prefill pod, idle between prompts, not on the decode pod whose
# every token it streams.
ONE_P_ONE_D = LocalConfig(
    "1P+1D", ("--prefill", "1", "--decode", "1"), ("prefill-0", "decode-0"), 1, 1, serving_core=0
)
CONFIGS = (COLOCATED_1, COLOCATED_2, ONE_P_ONE_D)
# The stack each topology's serving costs are measured on: the smallest of its kind.
TOPOLOGY_CONFIGS = {"colocated": COLOCATED_1, "disaggregated": ONE_P_ONE_D}


def simulated_cluster(config: LocalConfig) -> ClusterConfig:
    """What the simulator runs for `config`: its pods, all on this machine (they slow each
    other by the profile's neighbor slowdowns), and the conditional-disaggregation limit
    `splitserve up` gives a decode pod beside a prefill pod."""
    limit = UP_MAX_REMOTE_PREFILL_TOKENS if config.num_prefill else 0
    num_pods = config.num_prefill + config.num_decode
    return ClusterConfig(
        config.num_prefill,
        config.num_decode,
        max_remote_prefill_tokens=limit,
        pods_per_host=num_pods,  # every pod on this machine, one core each
    )


@contextmanager
def running_stack(
    config: LocalConfig, step_log_prefix: str | None = None
) -> Iterator[RunningStack]:
    """`config` up, pinned and single-threaded, for the length of the `with` block; this
    process (the client) on the serving core while it lasts. With `step_log_prefix`, each
    engine logs its steps to `<prefix>.<pid>.jsonl` (engine/step_log.py)."""
    cores = usable_cores()
    pins = {name: {core} for name, core in zip(config.pins, cores)}
    flags = [*config.up_flags, "--num-threads", "1"]
    setup = SystemSetup(config.name, flags, pins, config.name, env=_step_log_env(step_log_prefix))
    serving = None if config.serving_core is None else {cores[config.serving_core]}
    with _this_process_on(serving), RunningStack(setup) as stack:
        # Started from here, the processes not pinned to a pod's core (the gateway) inherit
        # the serving core.
        yield stack


def _step_log_env(prefix: str | None) -> dict[str, str]:
    if prefix is None:
        return {}
    # lazy: the step log's module is the engine's (torch); the planner's others load without
    from splitserve.engine.step_log import ENV_VAR

    return {ENV_VAR: prefix}


@contextmanager
def _this_process_on(cpus: set[int] | None) -> Iterator[None]:
    if cpus is None:
        yield
        return
    affinity = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, affinity)


def pace_cores(config: LocalConfig, stack: RunningStack) -> PaceCores:
    """The cores `stack`'s pods run on: the one that prefills `config`'s prompts (its prefill
    pod, or its first decode pod when colocated) and its first decode pod."""
    prefiller = "prefill-0" if config.num_prefill else "decode-0"
    return PaceCores(prefill=_core_of(stack, prefiller), decode=_core_of(stack, "decode-0"))


def _core_of(stack: RunningStack, name: str) -> int:
    return min(os.sched_getaffinity(stack.process(name).pid))


def completions_target(stack):
    return Target(f"{stack.base_url}/v1/completions", stack.model_name())


def warm_up(target, seed: int | str) -> None:
    """Two requests one at a time: the first calls of a stack pay one-off costs."""
    shape = WorkloadShape(LengthDistribution(64, 256), LengthDistribution(8, 8))
    asyncio.run(run_sequential(target, sequential_workload(f"{seed}/warm-up", 2, shape)))
