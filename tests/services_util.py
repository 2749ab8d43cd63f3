"""Starting real service processes for end-to-end tests, and talking to them.

`start_stack` launches decode pods and a gateway through the same supervisor `splitserve up`
uses (each in its own process group, killed as a group when the test module ends).
"""

from __future__ import annotations

import json
import socket
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field

from splitserve.v1 import worker_pb2, worker_pb2_grpc

from services.common.channels import sync_channel
from services.common.supervisor import HealthCheck, ProcessSpec, Supervisor

MODEL_NAME = "SmolLM2-135M-Instruct.Q4_1"  # what the services call the shipped model
KV_CACHE_BYTES = "128MiB"
STARTUP_TIMEOUT_SECONDS = 120.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


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
    started: bool = field(default=False)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def grpc_address(self) -> str:
        return f"127.0.0.1:{self.grpc_port}"

    def wait_healthy(self) -> Stack:
        if not self.started:
            self.supervisor.wait_healthy(STARTUP_TIMEOUT_SECONDS)
            self.started = True
        return self

    def stop(self) -> None:
        self.supervisor.stop()


def start_stack(num_decode: int = 1) -> Stack:
    """Starts decode pod(s) and a gateway on free ports; returns at once (see wait_healthy)."""
    supervisor = Supervisor()
    try:
        return _start_stack(supervisor, num_decode)
    except BaseException:
        supervisor.stop()
        raise


def _start_stack(supervisor: Supervisor, num_decode: int) -> Stack:
    decode_addresses = []
    for i in range(num_decode):
        address = f"127.0.0.1:{free_port()}"
        decode_addresses.append(address)
        argv = [sys.executable, "-m", "services.decode", "--host", "127.0.0.1"]
        argv += ["--port", address.rsplit(":", 1)[1], "--worker-id", f"decode-{i}"]
        argv += ["--kv-cache-bytes", KV_CACHE_BYTES, "--num-threads", "1"]
        argv += ["--log-level", "warning"]
        health = HealthCheck(grpc_address=address, grpc_service="splitserve.v1.DecodeWorker")
        supervisor.start(ProcessSpec(f"decode-{i}", argv, health))
    http_port, grpc_port = free_port(), free_port()
    argv = [sys.executable, "-m", "services.gateway", "--host", "127.0.0.1"]
    argv += ["--port", str(http_port), "--grpc-port", str(grpc_port), "--log-level", "warning"]
    for address in decode_addresses:
        argv += ["--decode", address]
    health = HealthCheck(
        grpc_address=f"127.0.0.1:{grpc_port}",
        grpc_service="splitserve.v1.Generation",
        http_url=f"http://127.0.0.1:{http_port}/health",
    )
    supervisor.start(ProcessSpec("gateway", argv, health))
    return Stack(supervisor, http_port, grpc_port, decode_addresses)


def decode_stats(address: str) -> worker_pb2.WorkerStats:
    with sync_channel(address) as channel:
        stub = worker_pb2_grpc.DecodeWorkerStub(channel)
        return stub.GetStats(worker_pb2.StatsRequest(), timeout=5)


def wait_until_idle(address: str, timeout: float = 15.0) -> worker_pb2.WorkerStats:
    """Polls a decode pod until nothing runs or waits and every KV block is free again;
    returns the last stats either way (the caller asserts on them)."""
    deadline = time.monotonic() + timeout
    while True:
        stats = decode_stats(address)
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
