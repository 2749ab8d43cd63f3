"""The redis-server child that `splitserve up` and tests start: it dies with its starter, even
when the starter is killed without cleaning up."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

from splitserve.common.redis_server import RedisServer
from tests.process_util import wait_until_gone

_STARTER_SCRIPT = textwrap.dedent(
    """
    import time
    from splitserve.common.redis_server import RedisServer
    server = RedisServer().start()
    print(server._process.pid, server.port, flush=True)
    time.sleep(60)
    """
)


def _program(pid: int) -> str:
    with open(f"/proc/{pid}/comm") as comm:
        return comm.read().strip()


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is Linux only")
def test_redis_server_dies_when_its_starter_is_killed():
    starter = subprocess.Popen(
        [sys.executable, "-c", _STARTER_SCRIPT], stdout=subprocess.PIPE, text=True
    )
    try:
        redis_pid = int(starter.stdout.readline().split()[0])
        # The wrapper exec'd in place: the pid the starter holds is redis-server itself.
        assert _program(redis_pid) == "redis-server"
        os.kill(starter.pid, signal.SIGKILL)  # no cleanup runs in the starter
        starter.wait()
        assert wait_until_gone(redis_pid, timeout=10.0), "redis-server outlived its starter"
    finally:
        starter.kill()


def test_restart_keeps_the_port_and_stop_leaves_no_process():
    with RedisServer() as server:
        first_pid, port = server._process.pid, server.port
        server.restart()
        second_pid = server._process.pid
        assert server.port == port and second_pid != first_pid
        assert wait_until_gone(first_pid, timeout=5.0)
        assert _program(second_pid) == "redis-server"
    assert wait_until_gone(second_pid, timeout=5.0)
