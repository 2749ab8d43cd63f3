"""Ports for the processes we start: never handed out twice while in use, and a port that is
taken is an error at start, not a port silently shared with another server."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys

import pytest

from splitserve.common import ports
from splitserve.common.grpc_server import BindError, start_server
from splitserve.common.ports import _PortPicker, free_port


def test_port_zero_draws_never_repeat_a_number():
    # The kernel draws port-0 binds at random from ~14k numbers: 300 draws repeat about three
    # (measured here), and a stack's five draws repeat one about once in 1,400 stacks.
    picker = _PortPicker()
    ports = [picker.pick("127.0.0.1") for _ in range(300)]
    assert len(set(ports)) == len(ports)


def _free_block(size: int) -> range:
    """`size` consecutive ports nothing listens on, between the pytest workers' ranges and the
    ephemeral range (no outgoing connection takes one meanwhile)."""
    for start in range(32_000, 32_768 - size, size):
        block = range(start, start + size)
        if all(_is_free(port) for port in block):
            return block
    pytest.skip("no block of free ports here")


def _is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_a_range_hands_out_its_free_ports_in_turn_and_skips_a_taken_one():
    block = _free_block(3)
    picker = _PortPicker()
    picker.use_range(block)
    with socket.socket() as held:
        held.bind(("127.0.0.1", block[1]))
        held.listen()
        draws = [picker.pick("127.0.0.1") for _ in range(4)]
    assert set(draws) == {block[0], block[2]}
    assert draws[0] != draws[1] and draws[2] == draws[0]  # round and round, taken one skipped


def test_a_range_with_every_port_taken_is_an_error():
    block = _free_block(2)
    picker = _PortPicker()
    picker.use_range(block)
    with socket.socket() as first, socket.socket() as second:
        first.bind(("127.0.0.1", block[0]))
        second.bind(("127.0.0.1", block[1]))
        with pytest.raises(OSError, match=f"no free port in {block[0]}-{block[1]}"):
            picker.pick("127.0.0.1")


def test_a_second_grpc_server_on_a_taken_port_fails_to_start():
    async def start_two(port: int) -> None:
        first = await start_server("127.0.0.1", port, ["test.Service"], lambda server: None)
        try:
            with pytest.raises(BindError, match=f"cannot bind gRPC port 127.0.0.1:{port}"):
                await start_server("127.0.0.1", port, ["test.Service"], lambda server: None)
        finally:
            await first.stop(0)

    asyncio.run(start_two(free_port()))


def test_a_gateway_told_a_taken_grpc_port_exits_saying_so():
    with socket.socket() as held:
        # What a grpc server listening there sets: without our option the gateway would share it.
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        argv = [sys.executable, "-m", "splitserve.gateway", "--host", "127.0.0.1"]
        argv += ["--port", str(free_port()), "--grpc-port", str(port)]
        argv += ["--decode", f"127.0.0.1:{free_port()}"]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert f"cannot bind gRPC port 127.0.0.1:{port}" in done.stderr
    assert "Traceback" not in done.stderr


def test_a_gateway_that_cannot_bind_grpc_closes_what_it_started(monkeypatch):
    """The gateway's own start, in this process: the pools and the router it started before
    the gRPC bind failed are closed (each close seen once), not left polling."""
    from splitserve.gateway import __main__ as gateway  # lazy: imports the gateway's web stack
    from splitserve.gateway.routing.pods import PodPool  # lazy: as above
    from splitserve.gateway.routing.router import Router  # lazy: as above

    closed: list[str] = []

    def spy(cls: type, name: str) -> None:
        real_close = cls.close

        async def close(self) -> None:
            closed.append(name)
            await real_close(self)

        monkeypatch.setattr(cls, "close", close)

    spy(Router, "router")
    real_pool_close = PodPool.close

    async def close_pool(self) -> None:
        closed.append(f"{self.role} pool")
        await real_pool_close(self)

    monkeypatch.setattr(PodPool, "close", close_pool)
    with socket.socket() as held:
        held.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        args = gateway.build_parser().parse_args(
            ["--host", "127.0.0.1", "--grpc-port", str(port), "--port", str(free_port())]
            + ["--decode", f"127.0.0.1:{free_port()}", "--prefill", f"127.0.0.1:{free_port()}"]
        )
        with pytest.raises(BindError, match=f"127.0.0.1:{port}"):
            asyncio.run(gateway.serve(args))
    # Closed in reverse of their start: the router, then the prefill and the decode pool.
    assert closed == ["router", "prefill pool", "decode pool"]


def test_port_zero_draws_that_only_repeat_end_in_an_error(monkeypatch):
    # A machine whose ephemeral range is down to ports handed out already (some containers
    # narrow it): the kernel's answers stand in as one number.
    picker = _PortPicker()
    monkeypatch.setattr(ports, "_bind_and_release", lambda host, port: 40_001)
    assert picker.pick("127.0.0.1") == 40_001
    with pytest.raises(OSError, match="gave only ports handed out recently"):
        picker.pick("127.0.0.1")
