"""A system under test on this machine, started the way users start it: `splitserve up`'s own
plan (splitserve.launcher.plan) run by its own supervisor, with engine processes pinned to cores
(`make bench-serve` and `splitserve plan validate` each name theirs). The gateway (and the
client) stay unpinned: they are the same code whichever way the pods are laid out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field, replace

from splitserve.common.channels import sync_channel
from splitserve.common.ports import free_port
from splitserve.common.supervisor import (
    ProcessGroupError,
    ProcessSpec,
    RestartPolicy,
    Supervisor,
)
from splitserve.launcher import Plan, add_up_flags, plan
from splitserve.loadgen.pin import wrap
from splitserve.v1 import worker_pb2, worker_pb2_grpc

HOST = "127.0.0.1"
# A child can die before it runs (SIGABRT between fork and exec: grpc's fork handlers in a
# parent that already holds channels, grpc/grpc#43055); one more try gets past it.
STARTUP_ATTEMPTS = 2


@dataclass(frozen=True)
class SystemSetup:
    name: str  # for the report, such as "disaggregated" or "colocated"
    up_flags: list[str]  # `splitserve up` flags (ports are added when it starts)
    cpus: dict[str, set[int]] = field(default_factory=dict)  # process name -> pinned CPUs
    description: str = ""
    redis_url: str | None = None  # the registry and prefix index every process uses, if any
    env: dict[str, str] = field(default_factory=dict)  # added to every process's environment


def usable_cores() -> tuple[int, int]:
    """The first two CPUs this process may run on: one per engine process when split."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise ValueError(f"needs 2 CPUs to split between prefill and decode, has {cpus}")
    return cpus[0], cpus[1]


def _plan(setup: SystemSetup) -> Plan:
    parser = argparse.ArgumentParser()
    add_up_flags(parser)
    ports = ["--port", str(free_port()), "--grpc-port", str(free_port())]
    ports += ["--decode-port", str(free_port()), "--prefill-port", str(free_port())]
    args = parser.parse_args([*setup.up_flags, "--host", HOST, *ports])
    the_plan = plan(args, redis_url=setup.redis_url)
    specs = [_pinned(spec, setup.cpus) for spec in the_plan.specs]
    if setup.env:
        specs = [replace(spec, env={**spec.env, **setup.env}) for spec in specs]
    return replace(the_plan, specs=specs)


def _pinned(spec: ProcessSpec, cpus: dict[str, set[int]]) -> ProcessSpec:
    if spec.name not in cpus:
        return spec
    return replace(spec, argv=wrap(cpus[spec.name], spec.argv))


class RunningStack:
    """One system, up and routing, for the length of a `with` block; every process it started
    is stopped on the way out, however the block ends."""

    def __init__(self, setup: SystemSetup, startup_timeout: float = 300.0) -> None:
        self.setup = setup
        self.plan = _plan(setup)
        self._startup_timeout = startup_timeout
        self._supervisor = Supervisor()
        self._pids: list[int] = []

    @property
    def base_url(self) -> str:
        return self.plan.http_url

    def __enter__(self) -> RunningStack:
        for attempt in range(1, STARTUP_ATTEMPTS + 1):
            try:
                self._start()
                return self
            except ProcessGroupError as error:
                self._supervisor.stop()
                if attempt == STARTUP_ATTEMPTS:
                    raise
                print(f"[{self.setup.name}] {error}; starting again", file=sys.stderr, flush=True)
            except BaseException:
                self._supervisor.stop()
                raise
        raise AssertionError("unreachable: the last attempt returns or raises")

    def _start(self) -> None:
        self._pids = [self._supervisor.start(spec).pid for spec in self.plan.specs]
        self._supervisor.wait_healthy(self._startup_timeout)
        self._wait_routing()

    def __exit__(self, *exc: object) -> None:
        self._supervisor.stop()

    def pids(self) -> list[int]:
        """The processes of the stack (the pinning wrapper execs, so these are the pods')."""
        return list(self._pids)

    def check_alive(self) -> None:
        self._supervisor.check_alive()

    def process(self, name: str):
        """The running process of `name` ("decode-0", "gateway", ...); a restart replaces it."""
        return self._supervisor.process(name)

    def restart_exited(self, policy: RestartPolicy) -> list[str]:
        """Restarts processes that exited, as `splitserve up` does; what happened, a line each."""
        return self._supervisor.restart_exited(policy)

    def model_name(self) -> str:
        return _get_json(f"{self.base_url}/v1/models")["data"][0]["id"]

    def _wait_routing(self) -> None:
        """Until the gateway's own poll has seen every pod (it routes to none before)."""
        pods = {_grpc_address(spec) for spec in self.plan.specs if spec.name != "gateway"}
        deadline = time.monotonic() + 30.0
        while True:
            workers = _get_json(f"{self.base_url}/health").get("workers", {})
            seen = {address for pool in workers.values() for address, ok in pool.items() if ok}
            if seen >= pods:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the gateway never saw every pod: {sorted(pods - seen)}")
            time.sleep(0.1)

    def wait_idle(self, timeout_s: float) -> bool:
        """Until every pod has nothing running or waiting (requests cancelled at a run's end
        must not load the next run); False if they were still busy after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            stats = self.pod_stats().values()
            if all(s.num_running == 0 and s.num_waiting == 0 for s in stats):
                return True
            time.sleep(0.2)
        return False

    def pod_stats(self) -> dict[str, worker_pb2.WorkerStats]:
        """name -> stats of each engine process."""
        stats = {}
        for spec in self.plan.specs:
            stub_class: type[worker_pb2_grpc.PrefillWorkerStub | worker_pb2_grpc.DecodeWorkerStub]
            if spec.name.startswith("prefill-"):
                stub_class = worker_pb2_grpc.PrefillWorkerStub
            elif spec.name.startswith("decode-"):
                stub_class = worker_pb2_grpc.DecodeWorkerStub
            else:
                continue
            with sync_channel(_grpc_address(spec)) as channel:
                stub = stub_class(channel)
                stats[spec.name] = stub.GetStats(worker_pb2.StatsRequest(), timeout=5)
        return stats


def _grpc_address(spec: ProcessSpec) -> str:
    """An engine pod's or the gateway's gRPC address (the launcher health-checks each over
    gRPC)."""
    assert spec.health.grpc_address is not None, f"{spec.name} has no gRPC health check"
    return spec.health.grpc_address


def _get_json(url: str) -> dict:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return json.load(response)
    except urllib.error.HTTPError as error:  # /health answers 503 with a body until routing
        return json.load(error)
