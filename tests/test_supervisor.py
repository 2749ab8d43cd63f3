"""The process supervisor: children die with a killed supervisor, stop() leaves none, and a
child that never turns healthy is named with what its checks saw."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from concurrent import futures

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import HealthServicer

from splitserve.common.ports import free_port
from splitserve.common.supervisor import (
    HealthCheck,
    ProcessGroupError,
    ProcessSpec,
    RestartPolicy,
    Supervisor,
)
from tests.process_util import is_running, wait_until_gone

_SUPERVISOR_SCRIPT = textwrap.dedent(
    """
    import sys, time
    from splitserve.common.supervisor import HealthCheck, ProcessSpec, Supervisor
    supervisor = Supervisor()
    process = supervisor.start(ProcessSpec("sleeper", ["sleep", "60"], HealthCheck()))
    print(process.pid, flush=True)
    time.sleep(60)
    """
)


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux only")
def test_child_dies_when_the_supervisor_is_killed():
    supervisor = subprocess.Popen(
        [sys.executable, "-c", _SUPERVISOR_SCRIPT], stdout=subprocess.PIPE, text=True
    )
    try:
        child_pid = int(supervisor.stdout.readline())
        assert is_running(child_pid)
        os.kill(supervisor.pid, signal.SIGKILL)  # no cleanup runs in the supervisor
        supervisor.wait()
        assert wait_until_gone(child_pid, timeout=10.0), "the child outlived its supervisor"
    finally:
        supervisor.kill()


def test_stop_ends_every_child_and_its_group(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    with Supervisor() as supervisor:
        # The shell starts a grandchild in the same process group; stop() must reach it too.
        script = f"sleep 60 & echo $! > {pid_file}; wait"
        shell = supervisor.start(ProcessSpec("shell", ["sh", "-c", script], HealthCheck()))
        deadline = time.monotonic() + 10
        while not pid_file.exists() or not pid_file.read_text().strip():
            assert time.monotonic() < deadline, "the shell never started its grandchild"
            time.sleep(0.05)
        grandchild_pid = int(pid_file.read_text())
        assert is_running(grandchild_pid)
        assert supervisor.names == ["shell"]
    assert shell.poll() is not None
    assert wait_until_gone(grandchild_pid, timeout=5.0)
    assert supervisor.names == []


def test_an_exited_child_restarts_after_a_doubling_back_off():
    policy = RestartPolicy(initial_backoff_s=1.0, max_backoff_s=4.0, reset_after_s=100.0)
    with Supervisor() as supervisor:
        first = supervisor.start(ProcessSpec("crasher", ["sh", "-c", "exit 3"], HealthCheck()))
        first.wait()
        now = time.monotonic()
        assert supervisor.restart_exited(policy, now) == [
            "crasher exited with status 3; restarting in 1 s"
        ]
        assert supervisor.restart_exited(policy, now + 0.5) == []  # still backing off
        assert supervisor.restart_exited(policy, now + 1.0) == ["crasher restarted (restart 1)"]
        second = supervisor.process("crasher")
        assert second.pid != first.pid
        second.wait()
        events = supervisor.restart_exited(policy, now + 1.5)
        assert events == ["crasher exited with status 3; restarting in 2 s"]  # doubled
        supervisor.restart_exited(policy, now + 3.5)
        supervisor.process("crasher").wait()
        events = supervisor.restart_exited(policy, now + 3.6)
        assert events == ["crasher exited with status 3; restarting in 4 s"]
        supervisor.restart_exited(policy, now + 7.6)
        supervisor.process("crasher").wait()
        # Capped at max_backoff_s.
        assert supervisor.restart_exited(policy, now + 7.7) == [
            "crasher exited with status 3; restarting in 4 s"
        ]


def test_a_child_that_stays_up_resets_its_back_off():
    policy = RestartPolicy(initial_backoff_s=1.0, max_backoff_s=30.0, reset_after_s=5.0)
    with Supervisor() as supervisor:
        supervisor.start(ProcessSpec("sleeper", ["sleep", "60"], HealthCheck()))
        child = supervisor._children[0]
        child.num_restarts = 4  # as after a crash loop
        supervisor.restart_exited(policy, child.started_at + 5.0)  # up 5 s: stable again
        assert child.num_restarts == 0
        supervisor.process("sleeper").kill()
        supervisor.process("sleeper").wait()
        events = supervisor.restart_exited(policy, child.started_at + 6.0)
        assert events == ["sleeper exited with status -9; restarting in 1 s"]


@pytest.fixture
def health_server():
    """A gRPC health server in this process where "known.Service" is NOT_SERVING."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    health = HealthServicer()
    health.set("known.Service", health_pb2.HealthCheckResponse.NOT_SERVING)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    port = server.add_insecure_port(f"127.0.0.1:{free_port()}")
    server.start()
    yield f"127.0.0.1:{port}"
    server.stop(0)


@pytest.mark.parametrize(
    ("service", "problem"),
    [("known.Service", "NOT_SERVING"), ("other.Service", "NOT_FOUND")],
)
def test_a_child_that_never_turns_healthy_is_named_with_what_its_checks_saw(
    health_server, service, problem
):
    with Supervisor() as supervisor:
        health = HealthCheck(grpc_address=health_server, grpc_service=service)
        supervisor.start(ProcessSpec("pod-0", ["sleep", "30"], health))
        refused = f"http://127.0.0.1:{free_port()}/health"
        supervisor.start(ProcessSpec("gateway", ["sleep", "30"], HealthCheck(http_url=refused)))
        with pytest.raises(ProcessGroupError) as raised:
            supervisor.wait_healthy(timeout=0.5)
    message = str(raised.value)
    assert f"pod-0 (gRPC health: {problem}" in message
    assert "gateway (HTTP: <urlopen error [Errno 111] Connection refused>)" in message
