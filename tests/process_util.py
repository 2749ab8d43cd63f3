"""Watching processes from tests: is a pid still running, and waiting for it to go."""

from __future__ import annotations

import time


def is_running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def wait_until_gone(pid: int, timeout: float) -> bool:
    """True once `pid` has exited (or is a zombie); False if it still runs after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not is_running(pid):
            return True
        time.sleep(0.05)
    return False
