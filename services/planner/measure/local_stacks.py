"""The local stacks the planner measures on this machine: each engine process pinned to its
own core with one torch thread (what a profile measures), started the way `splitserve up` does.
Shared by `plan profile --serving` (the serving path's costs) and `plan validate`."""

from __future__ import annotations

import asyncio
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


COLOCATED_1 = LocalConfig("colocated-1", ("--colocated", "--decode", "1"), ("decode-0",), 0, 1)
COLOCATED_2 = LocalConfig(
    "colocated-2", ("--colocated", "--decode", "2"), ("decode-0", "decode-1"), 0, 2
)
ONE_P_ONE_D = LocalConfig(
    "1P+1D", ("--prefill", "1", "--decode", "1"), ("prefill-0", "decode-0"), 1, 1
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


def running_stack(config: LocalConfig):
    """A `RunningStack` context for `config`, pinned and single-threaded."""
    cores = usable_cores()
    pins = {name: {core} for name, core in zip(config.pins, cores)}
    setup = SystemSetup(config.name, [*config.up_flags, "--num-threads", "1"], pins, config.name)
    return RunningStack(setup)


def pace_cores(config: LocalConfig) -> PaceCores:
    """The cores `running_stack` pins the pod that prefills `config`'s prompts to (its prefill
    pod, or its first decode pod when colocated) and its first decode pod to."""
    cores = dict(zip(config.pins, usable_cores()))
    prefiller = "prefill-0" if config.num_prefill else "decode-0"
    return PaceCores(prefill=cores[prefiller], decode=cores["decode-0"])


def completions_target(stack):
    return Target(f"{stack.base_url}/v1/completions", stack.model_name())


def warm_up(target, seed: int | str) -> None:
    """Two requests one at a time: the first calls of a stack pay one-off costs."""
    shape = WorkloadShape(LengthDistribution(64, 256), LengthDistribution(8, 8))
    asyncio.run(run_sequential(target, sequential_workload(f"{seed}/warm-up", 2, shape)))
