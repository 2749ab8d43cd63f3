"""Free TCP ports for the processes we start ourselves (test stacks, benchmarks, load
generators, a local Redis).

A port found free is only free until something binds it, and the process it is handed to binds
it a second or more later, after its imports. Two ways that goes wrong:
- the kernel hands out the same number twice to port-0 binds made close together (it picks at
  random from the ephemeral range), and two of our children then bind one port;
- another process (a second pytest worker doing the same) draws the number in between.
Our gRPC servers refuse a taken port (see grpc_server.SERVER_OPTIONS), so either way a child
exits at start instead of serving. So this process never hands out a number twice while it may
still be in use, and a pytest worker can draw from a range of its own (`use_port_range`), below
the kernel's ephemeral range, which no port-0 bind and no outgoing connection lands in.
"""

from __future__ import annotations

import collections
import random
import socket
import threading

# Port-0 draws remembered so none is handed out twice; far more than one run starts at once.
RECENT_DRAWS_KEPT = 4096
# Port-0 draws tried for one new number: Linux hands binds the ~14k odd ports of its ephemeral
# range, so repeats are rare; a range narrowed to about RECENT_DRAWS_KEPT would repeat forever.
MAX_KERNEL_DRAWS = 64


class _PortPicker:
    """Hands out ports, from the kernel (port 0) or from a range; thread-safe. The `_from_*`
    methods run with `_lock` held."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._recent: collections.deque[int] = collections.deque(maxlen=RECENT_DRAWS_KEPT)
        self._range: range | None = None
        self._cursor = 0

    def use_range(self, ports: range) -> None:
        with self._lock:
            self._range = ports
            self._cursor = random.randrange(len(ports))  # a rerun starts elsewhere

    def pick(self, host: str) -> int:
        with self._lock:
            if self._range is None:
                return self._from_kernel(host)
            return self._from_range(host, self._range)

    def _from_kernel(self, host: str) -> int:
        for _ in range(MAX_KERNEL_DRAWS):
            port = _bind_and_release(host, 0)
            if port not in self._recent:
                self._recent.append(port)
                return port
        raise OSError(f"{MAX_KERNEL_DRAWS} port-0 binds gave only ports handed out recently")

    def _from_range(self, host: str, ports: range) -> int:
        # In order from a random start: a number comes round again only after every other one
        # of the range, by when whoever it went to is listening on it (and it is skipped) or gone.
        for _ in range(len(ports)):
            port = ports[self._cursor]
            self._cursor = (self._cursor + 1) % len(ports)
            if _is_bindable(host, port):
                return port
        raise OSError(f"no free port in {ports.start}-{ports.stop - 1}")


def _bind_and_release(host: str, port: int) -> int:
    with socket.socket() as sock:
        sock.bind((host, port))
        return sock.getsockname()[1]


def _is_bindable(host: str, port: int) -> bool:
    try:
        _bind_and_release(host, port)
    except OSError:
        return False
    return True


_picker = _PortPicker()


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now, and that this process has not handed out recently."""
    return _picker.pick(host)


def use_port_range(ports: range) -> None:
    """From now on, draw this process's ports from `ports` (for one of several pytest workers:
    give each its own range)."""
    _picker.use_range(ports)
