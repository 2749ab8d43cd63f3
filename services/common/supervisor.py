"""Starting, health-checking and stopping a set of service processes on one machine.

Each child runs in its own session (so its own process group): a Ctrl-C in the terminal
reaches only the supervisor, which then stops the children in order, and stopping a child's
group also stops anything it started. On Linux a child also gets SIGTERM if the supervisor
dies without cleaning up (PR_SET_PDEATHSIG, armed by splitserve.common.die_with_parent before it
execs the child's program), so no pod outlives a killed `splitserve up`.

A child that exits is restarted as a kubelet restarts a pod's container (`restart_exited`):
after a back-off that doubles with each restart (RestartPolicy), reset once the child has
stayed up for a while, so a crash loop does not spin while a one-off crash comes back fast.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from splitserve.common.channels import sync_channel
from splitserve.common.tls import TlsFiles

logger = logging.getLogger(__name__)

STOP_GRACE_SECONDS = 10.0


@dataclass(frozen=True)
class HealthCheck:
    """What "healthy" means for one process: every check given must pass."""

    grpc_address: str | None = None  # host:port of a grpc.health.v1 server
    grpc_service: str = ""  # the service name to ask about ("" = the whole server)
    http_url: str | None = None  # answers 200 when ready
    tls: TlsFiles | None = None  # dial grpc_address over TLS with these files


@dataclass(frozen=True)
class ProcessSpec:
    name: str  # e.g. "decode-0", for messages
    argv: list[str]
    health: HealthCheck
    env: dict[str, str] = field(default_factory=dict)  # added to the supervisor's environment


@dataclass(frozen=True)
class RestartPolicy:
    initial_backoff_s: float = 1.0
    max_backoff_s: float = 30.0
    # Up this long without exiting: the next exit counts as the first again.
    reset_after_s: float = 60.0

    def backoff(self, num_restarts: int) -> float:
        return min(self.initial_backoff_s * 2**num_restarts, self.max_backoff_s)


@dataclass
class _Child:
    spec: ProcessSpec
    process: subprocess.Popen
    channel: grpc.Channel | None = None
    healthy: bool = False
    last_problem: str = "not checked yet"  # why the last health check failed, for the timeout
    started_at: float = field(default_factory=time.monotonic)
    num_restarts: int = 0  # since the last reset (RestartPolicy.reset_after_s)
    restart_at: float | None = None  # set when its exit was seen: when to start it again


class ProcessGroupError(RuntimeError):
    """A child exited on its own, or did not become healthy in time."""


class Supervisor:
    """Owns its children: `stop()` (also run by `with`) leaves none behind."""

    def __init__(self) -> None:
        self._children: list[_Child] = []

    def __enter__(self) -> Supervisor:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    @property
    def names(self) -> list[str]:
        return [child.spec.name for child in self._children]

    def start(self, spec: ProcessSpec) -> subprocess.Popen:
        process = self._popen(spec)
        child = _Child(spec, process)
        if spec.health.grpc_address is not None:
            child.channel = sync_channel(spec.health.grpc_address, spec.health.tls)
        self._children.append(child)
        return process

    @staticmethod
    def _popen(spec: ProcessSpec) -> subprocess.Popen:
        return subprocess.Popen(
            dying_with_us(spec.argv),
            env={**os.environ, **spec.env},
            start_new_session=True,
        )

    def wait_healthy(
        self,
        timeout: float,
        on_progress: Callable[[float, dict[str, bool]], None] | None = None,
        interval: float = 0.25,
    ) -> None:
        """Blocks until every child is healthy; raises ProcessGroupError if one exits or the
        timeout passes. `on_progress(elapsed, {name: healthy})` is called after each round."""
        start = time.monotonic()
        while True:
            self.check_alive()
            for child in self._children:
                if not child.healthy:
                    problem = _health_problem(child)
                    child.healthy = problem is None
                    child.last_problem = problem or ""
            elapsed = time.monotonic() - start
            status = {child.spec.name: child.healthy for child in self._children}
            if on_progress is not None:
                on_progress(elapsed, status)
            if all(status.values()):
                return
            if elapsed > timeout:
                waiting = [
                    f"{child.spec.name} ({child.last_problem})"
                    for child in self._children
                    if not child.healthy
                ]
                raise ProcessGroupError(f"not healthy after {timeout:.0f} s: {', '.join(waiting)}")
            time.sleep(interval)

    def restart_exited(self, policy: RestartPolicy, now: float | None = None) -> list[str]:
        """Restarts children that exited, each once its back-off has passed; returns what
        happened (a line per exit seen and per restart) for the caller to print."""
        now = time.monotonic() if now is None else now
        events = []
        for child in self._children:
            code = child.process.poll()
            if code is None:
                if now - child.started_at >= policy.reset_after_s:
                    child.num_restarts = 0
                continue
            if child.restart_at is None:
                child.restart_at = now + policy.backoff(child.num_restarts)
                events.append(
                    f"{child.spec.name} exited with status {code}; restarting in "
                    f"{child.restart_at - now:.0f} s"
                )
            elif now >= child.restart_at:
                self._restart(child, now)
                events.append(f"{child.spec.name} restarted (restart {child.num_restarts})")
        return events

    def _restart(self, child: _Child, now: float) -> None:
        _signal_group(child.process, signal.SIGKILL)  # anything the dead child left behind
        child.process = self._popen(child.spec)
        child.healthy = False
        child.started_at = now
        child.num_restarts += 1
        child.restart_at = None

    def process(self, name: str) -> subprocess.Popen:
        """The running process of child `name` (a restart replaces it)."""
        for child in self._children:
            if child.spec.name == name:
                return child.process
        raise KeyError(name)

    def check_alive(self) -> None:
        for child in self._children:
            code = child.process.poll()
            if code is not None:
                raise ProcessGroupError(f"{child.spec.name} exited with status {code}")

    def stop(self) -> None:
        """Stops the children one by one, last started first (the gateway before the pods it
        talks to, so it never sees them vanish): SIGTERM to the child's process group, then
        SIGKILL to whatever is left of the group after the grace period."""
        for child in reversed(self._children):
            _signal_group(child.process, signal.SIGTERM)
            try:
                child.process.wait(timeout=STOP_GRACE_SECONDS)
            except subprocess.TimeoutExpired:
                logger.warning("%s did not stop in time; killing it", child.spec.name)
            _signal_group(child.process, signal.SIGKILL)  # also anything the child started
            child.process.wait()
            if child.channel is not None:
                child.channel.close()
        self._children.clear()


def dying_with_us(argv: list[str]) -> list[str]:
    """`argv` behind the wrapper that arms PR_SET_PDEATHSIG (Linux only) and execs it."""
    if sys.platform != "linux":
        return list(argv)
    wrapper = [sys.executable, "-m", "splitserve.common.die_with_parent", str(os.getpid())]
    return wrapper + list(argv)


def _signal_group(process: subprocess.Popen, sig: signal.Signals) -> None:
    # The child leads its own session, so its pid is its process group id.
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(process.pid, sig)


def _health_problem(child: _Child) -> str | None:
    """None when every check of the child passes, else what the first failing one saw (a
    refused connection, NOT_SERVING, a service the server does not know...)."""
    health = child.spec.health
    if child.channel is not None:
        problem = _grpc_problem(child.channel, health.grpc_service)
        if problem is not None:
            return problem
    return None if health.http_url is None else _http_problem(health.http_url)


def _grpc_problem(channel: grpc.Channel, service: str) -> str | None:
    stub = health_pb2_grpc.HealthStub(channel)
    try:
        response = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=1.0)
    except grpc.RpcError as error:
        return f"gRPC health: {error.code().name} {error.details()}"
    if response.status == health_pb2.HealthCheckResponse.SERVING:
        return None
    return f"gRPC health: {health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)}"


def _http_problem(url: str) -> str | None:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as response:
            return None if response.status == 200 else f"HTTP {response.status}"
    except urllib.error.HTTPError as error:
        return f"HTTP {error.code}"
    except (urllib.error.URLError, OSError) as error:
        return f"HTTP: {error}"
