"""Starting real service processes for end-to-end tests, and talking to them.

`start_stack` launches prefill pods, decode pods and a gateway through the same supervisor
`splitserve up` uses (each in its own process group, killed as a group when the test module
ends).
"""

from __future__ import annotations

import contextlib
import json
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

import torch

from splitserve.common.channels import sync_channel
from splitserve.common.ports import free_port
from splitserve.common.supervisor import HealthCheck, ProcessSpec, Supervisor
from splitserve.v1 import worker_pb2, worker_pb2_grpc

MODEL_NAME = "SmolLM2-135M-Instruct.Q4_1"  # what the services call the shipped model
KV_CACHE_BYTES = "128MiB"
STARTUP_TIMEOUT_SECONDS = 120.0


def is_port_open(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


@dataclass
class Stack:
    supervisor: Supervisor
    http_port: int
    grpc_port: int
    decode_addresses: list[str]
    prefill_addresses: list[str] = field(default_factory=list)
    # name ("decode-0", "prefill-0", "gateway") -> its process, e.g. to kill one
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    started: bool = field(default=False)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc_address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def wait_healthy(self) -> Stack:
        """Every process healthy, and the gateway routing to every pod (it learns of a pod
        that turned healthy on its next poll)."""
        if not self.started:
            self.supervisor.wait_healthy(STARTUP_TIMEOUT_SECONDS)
            deadline = time.monotonic() + 10.0
            while not self._gateway_sees_every_pod():
                assert time.monotonic() < deadline, "the gateway never saw every pod available"
                time.sleep(0.1)
            self.started = True
        return self

    def _gateway_sees_every_pod(self) -> bool:
        workers = get_json(f"{self.base_url}/health").body.get("workers", {})
        seen = {address for pool in workers.values() for address, ok in pool.items() if ok}
        return seen == {*self.decode_addresses, *self.prefill_addresses}

    def stop(self) -> None:
        self.supervisor.stop()


def start_stack(
    num_decode: int = 1,
    num_prefill: int = 0,
    transport: str = "tcp",
    decode_flags: Sequence[str] = (),
    prefill_flags: Sequence[str] = (),
    gateway_flags: Sequence[str] = (),
) -> Stack:
    """Starts prefill pod(s), decode pod(s) and a gateway on free ports; returns at once (see
    wait_healthy). Every pod speaks `transport` and runs one torch thread."""
    supervisor = Supervisor()
    try:
        stack = Stack(supervisor, free_port(), free_port(), [])
        pod_flags = ["--kv-cache-bytes", KV_CACHE_BYTES, "--num-threads", "1"]
        pod_flags += ["--kv-transport", transport, "--log-level", "warning"]
        for i in range(num_prefill):
            address = _start_pod(stack, "prefill", i, [*pod_flags, *prefill_flags])
            stack.prefill_addresses.append(address)
        for i in range(num_decode):
            address = _start_pod(stack, "decode", i, [*pod_flags, *decode_flags])
            stack.decode_addresses.append(address)
        _start_gateway(stack, gateway_flags)
        return stack
    except BaseException:
        supervisor.stop()
        raise


def _start_pod(stack: Stack, role: str, index: int, flags: list[str]) -> str:
    address = f"127.0.0.1:{free_port()}"
    name = f"{role}-{index}"
    argv = [sys.executable, "-m", f"services.{role}", "--host", "127.0.0.1"]
    argv += ["--port", address.rsplit(":", 1)[1], "--worker-id", name, *flags]
    service = f"splitserve.v1.{role.capitalize()}Worker"
    health = HealthCheck(grpc_address=address, grpc_service=service)
    stack.processes[name] = stack.supervisor.start(ProcessSpec(name, argv, health))
    return address


def _start_gateway(stack: Stack, flags: Sequence[str] = ()) -> None:
    stack.processes["gateway"] = start_gateway(
        stack, "gateway", stack.http_port, stack.grpc_port, flags
    )


def start_gateway(
    stack: Stack, name: str, http_port: int, grpc_port: int, flags: Sequence[str] = ()
) -> subprocess.Popen:
    """A gateway over the stack's pods (the stack's own, or a replica beside it)."""
    argv = [sys.executable, "-m", "splitserve.gateway", "--host", "127.0.0.1"]
    argv += ["--port", str(http_port), "--grpc-port", str(grpc_port)]
    argv += ["--log-level", "warning", *flags]
    for address in stack.decode_addresses:
        argv += ["--decode", address]
    for address in stack.prefill_addresses:
        argv += ["--prefill", address]
    health = HealthCheck(
        grpc_address=f"127.0.0.1:{grpc_port}",
        grpc_service="splitserve.v1.Generation",
        http_url=f"http://127.0.0.1:{http_port}/health",
    )
    return stack.supervisor.start(ProcessSpec(name, argv, health))


def decode_stats(address: str) -> worker_pb2.WorkerStats:
    return pod_stats(address, "decode")


def prefill_stats(address: str) -> worker_pb2.WorkerStats:
    return pod_stats(address, "prefill")


def pod_stats(address: str, role: str = "decode") -> worker_pb2.WorkerStats:
    stub_class = (
        worker_pb2_grpc.DecodeWorkerStub if role == "decode" else worker_pb2_grpc.PrefillWorkerStub
    )
    with sync_channel(address) as channel:
        return stub_class(channel).GetStats(worker_pb2.StatsRequest(), timeout=5)


def wait_until_idle(
    address: str, timeout: float = 15.0, role: str = "decode"
) -> worker_pb2.WorkerStats:
    """Polls a pod until nothing runs or waits and every KV block is free again; returns the
    last stats either way (the caller asserts on them)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = pod_stats(address, role)
        idle = stats.num_running == 0 and stats.num_waiting == 0
        if idle and stats.kv_blocks_free == stats.kv_blocks_total:
            return stats
        if time.monotonic() > deadline:
            return stats
        time.sleep(0.1)


@dataclass
class HttpResult:
    status: int
    body: dict


def post_raw(url: str, data: bytes, content_type: str = "application/json") -> HttpResult:
    """POSTs bytes as they are (the openai client cannot send malformed JSON)."""
    request = urllib.request.Request(url, data=data, headers={"Content-Type": content_type})
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return HttpResult(response.status, json.load(response))
    except urllib.error.HTTPError as error:
        return HttpResult(error.code, json.load(error))


def get_json(url: str) -> HttpResult:
    try:
        with urllib.request.urlopen(url, timeout=10) as response:
            return HttpResult(response.status, json.load(response))
    except urllib.error.HTTPError as error:
        return HttpResult(error.code, json.load(error))


@contextlib.contextmanager
def single_threaded_reference(kv_cache_bytes: int) -> Iterator:
    """The offline engine with one torch thread, as the test stacks' pods run: the reference
    their outputs are compared with. The caller's thread count comes back afterwards."""
    from splitserve import LLM

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield LLM(kv_cache_bytes=kv_cache_bytes)
    finally:
        torch.set_num_threads(previous)
