"""The systems under test: vLLM's CPU server, and `splitserve up` without admission control and
with it under each SLO pair (admission's default SLO is a flag of the stack, so each pair is a
stack of its own). Both sides get the same KV budget, as in benchmarks/tail_latency.py."""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from benchmarks.goodput.figures import SLO_PAIRS, SloPair
from benchmarks.peer.vllm_server import SERVED_NAME, VllmServer
from splitserve.launcher import add_up_flags
from splitserve.loadgen.client import Target
from splitserve.loadgen.stacks import RunningStack, SystemSetup

KV_CACHE_GIB = 2
ADMISSION_FLAGS = ("--admission", "--slo-ttft-ms", "--slo-tpot-ms")
BASELINE = "splitserve"
VLLM = "vllm"
IDLE_TIMEOUT_S = 120.0  # cancelled requests must be gone before the next run starts


@dataclass(frozen=True)
class System:
    name: str
    admission: SloPair | None = None  # admission control's default SLO; None = off
    our_client_too: bool = False  # also measured with our client, which times refusals

    @property
    def measures_saturation(self) -> bool:
        """The systems without admission: a closed loop saturates them, where admission
        would refuse part of it. The baseline's is every system's reference load."""
        return self.admission is None


@dataclass(frozen=True)
class Served:
    base_url: str
    model: str
    wait_idle: Callable[[], None]  # until nothing from an earlier run is left on the system

    @property
    def target(self) -> Target:
        return Target(f"{self.base_url}/v1/completions", self.model)


def admission_available() -> bool:
    """Whether `splitserve up --help` lists the admission flags (the same parser that
    RunningStack hands the flags to, so what it lists is what the stack accepts)."""
    parser = argparse.ArgumentParser(prog="splitserve up")
    add_up_flags(parser)
    text = parser.format_help()
    return all(flag in text for flag in ADMISSION_FLAGS)


def systems_under_test(has_admission: bool) -> list[System]:
    """The baseline first: its saturation is the reference every later load is a multiple of.
    Without the admission flags our client measures the baseline instead, so its columns
    (refusal latency among them) are still filled and the code path still runs."""
    if not has_admission:
        return [System(BASELINE, our_client_too=True), System(VLLM)]
    admitted = [System(f"{BASELINE}+adm {pair.name}", pair, True) for pair in SLO_PAIRS]
    return [System(BASELINE), System(VLLM), *admitted]


def up_flags(system: System) -> list[str]:
    flags = ["--kv-cache-bytes", f"{KV_CACHE_GIB}GiB", "--log-level", "warning"]
    if system.admission is not None:
        flags += ["--admission", "--slo-ttft-ms", str(system.admission.ttft_ms)]
        flags += ["--slo-tpot-ms", str(system.admission.tpot_ms)]
    return flags


@contextlib.contextmanager
def serving(system: System) -> Iterator[Served]:
    """The system, up and answering, while the block runs; stopped however it ends."""
    if system.name == VLLM:
        # vLLM's client waits for every request it sent, so nothing is left between runs.
        with VllmServer(KV_CACHE_GIB) as server:
            yield Served(server.base_url, SERVED_NAME, lambda: None)
        return
    with RunningStack(SystemSetup(system.name, up_flags(system))) as stack:

        def wait_idle() -> None:
            if not stack.wait_idle(IDLE_TIMEOUT_S):
                print(f"  [{system.name}] still busy after {IDLE_TIMEOUT_S:.0f} s", flush=True)

        yield Served(stack.base_url, stack.model_name(), wait_idle)
