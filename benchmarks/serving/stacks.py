"""The two systems under test, started the way users start them: `splitserve up`'s own plan
(services.launcher.plan) run by its own supervisor, with each engine process pinned to cores.

- disaggregated: 1 prefill process on the first core, 1 decode process on the second, one
  torch thread each;
- colocated (`splitserve up --colocated`): 1 decode process that prefills too, two torch
  threads on both cores.

The gateway (and this client) stay unpinned in both: they are the same code either way.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field, replace

from splitserve.v1 import worker_pb2, worker_pb2_grpc

from benchmarks.serving.pin import wrap
from services.common.channels import sync_channel
from services.common.supervisor import ProcessGroupError, ProcessSpec, Supervisor
from services.launcher import Plan, add_up_flags, plan

HOST = "127.0.0.1"
# A child can die before it runs (SIGABRT between fork and exec: grpc's fork handlers in a
# parent that already holds channels, grpc/grpc#43055); one more try gets past it.
STARTUP_ATTEMPTS = 2


@dataclass(frozen=True)
class SystemSetup:
    name: str  # "disaggregated" or "colocated", for the report
    up_flags: list[str]  # `splitserve up` flags (ports are added when it starts)
    cpus: dict[str, set[int]] = field(default_factory=dict)  # process name -> pinned CPUs
    description: str = ""


def usable_cores() -> tuple[int, int]:
    """The first two CPUs this process may run on: one per engine process when split."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise ValueError(f"bench-serve needs 2 CPUs to split between prefill and decode: {cpus}")
    return cpus[0], cpus[1]


def disaggregated(cores: tuple[int, int], transport: str | None) -> SystemSetup:
    flags = ["--prefill", "1", "--decode", "1", "--num-threads", "1"]
    if transport is not None:
        flags += ["--transport", transport]
    return SystemSetup(
        "disaggregated",
        flags,
        {"prefill-0": {cores[0]}, "decode-0": {cores[1]}},
        f"prefill-0 on CPU {cores[0]}, decode-0 on CPU {cores[1]}, 1 torch thread each",
    )


def colocated(cores: tuple[int, int]) -> SystemSetup:
    return SystemSetup(
        "colocated",
        ["--colocated", "--decode", "1", "--num-threads", "2"],
        {"decode-0": set(cores)},
        f"decode-0 prefills and decodes on CPUs {cores[0]},{cores[1]}, 2 torch threads",
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


def _plan(setup: SystemSetup) -> Plan:
    parser = argparse.ArgumentParser()
    add_up_flags(parser)
    ports = ["--port", str(free_port()), "--grpc-port", str(free_port())]
    ports += ["--decode-port", str(free_port()), "--prefill-port", str(free_port())]
    args = parser.parse_args([*setup.up_flags, "--host", HOST, *ports])
    the_plan = plan(args)
    return replace(the_plan, specs=[_pinned(spec, setup.cpus) for spec in the_plan.specs])


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
                print(f"[bench-serve] {error}; starting again", file=sys.stderr, flush=True)
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

    def model_name(self) -> str:
        return _get_json(f"{self.base_url}/v1/models")["data"][0]["id"]

    def _wait_routing(self) -> None:
        """Until the gateway's own poll has seen every pod (it routes to none before)."""
        pods = {spec.health.grpc_address for spec in self.plan.specs if spec.name != "gateway"}
        deadline = time.monotonic() + 30.0
        while True:
            workers = _get_json(f"{self.base_url}/health").get("workers", {})
            seen = {address for pool in workers.values() for address, ok in pool.items() if ok}
            if seen >= pods:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"the gateway never saw every pod: {sorted(pods - seen)}")
            time.sleep(0.1)

    def pod_stats(self) -> dict[str, worker_pb2.WorkerStats]:
        """name -> stats of each engine process."""
        stats = {}
        for spec in self.plan.specs:
            if spec.name.startswith("prefill-"):
                stub_class = worker_pb2_grpc.PrefillWorkerStub
            elif spec.name.startswith("decode-"):
                stub_class = worker_pb2_grpc.DecodeWorkerStub
            else:
                continue
            with sync_channel(spec.health.grpc_address) as channel:
                stub = stub_class(channel)
                stats[spec.name] = stub.GetStats(worker_pb2.StatsRequest(), timeout=5)
        return stats


def _get_json(url: str) -> dict:
    try:
        with urllib.request.urlopen(url, timeout=5) as response:
            return json.load(response)
    except urllib.error.HTTPError as error:  # /health answers 503 with a body until routing
        return json.load(error)
