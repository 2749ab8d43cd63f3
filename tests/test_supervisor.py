"""The process supervisor: children die with a killed supervisor, and stop() leaves none."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from services.common.supervisor import HealthCheck, ProcessSpec, Supervisor
from tests.process_util import is_running, wait_until_gone

_SUPERVISOR_SCRIPT = textwrap.dedent(
    """
    import sys, time
    from services.common.supervisor import HealthCheck, ProcessSpec, Supervisor
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
