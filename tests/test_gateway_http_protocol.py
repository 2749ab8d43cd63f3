"""The gateway's HTTP parser (httptools, services/gateway/http_protocol.py) bounds a request's
head as uvicorn's h11 path does: a head past the bound, whole or trickled, is refused with 400
and the connection closed, while bodies of any size and heads within the bound on a kept-alive
connection pass."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import uvicorn

from splitserve.common.ports import free_port
from splitserve.gateway.http_protocol import MAX_REQUEST_HEAD_BYTES, BoundedHttpToolsProtocol


async def _body_length(scope, receive, send) -> None:
    """Answers with the length of the body it read."""
    size, more = 0, True
    while more:
        message = await receive()
        size += len(message.get("body", b""))
        more = message.get("more_body", False)
    body = str(size).encode()
    headers = [(b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    await send({"type": "http.response.body", "body": body})


@pytest.fixture(scope="module")
def port():
    port = free_port()
    config = uvicorn.Config(
        _body_length, "127.0.0.1", port, http=BoundedHttpToolsProtocol, lifespan="off",
        log_level="error",
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    yield port
    server.should_exit = True
    thread.join(timeout=10)


def _head(padding: int, body_size: int = 0) -> bytes:
    return (
        b"POST / HTTP/1.1\r\nhost: test\r\n"
        + b"x-padding: " + b"a" * padding + b"\r\n"
        + b"content-length: " + str(body_size).encode() + b"\r\n\r\n"
    )


def _read_response(sock: socket.socket) -> bytes:
    """One response of the test app (its body is the last line) or the refusal."""
    data = b""
    while b"\r\n\r\n" not in data or not data.split(b"\r\n\r\n", 1)[1]:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    return data


def _is_closed(sock: socket.socket) -> bool:
    sock.settimeout(5)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True


def test_a_head_past_the_bound_is_refused_and_the_connection_closed(port):
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(_head(MAX_REQUEST_HEAD_BYTES + 1024))  # one read, on loopback
        response = _read_response(sock)
        assert response.startswith(b"HTTP/1.1 400 ")
        assert _is_closed(sock)


def test_a_header_trickled_in_and_never_ended_is_refused_at_the_bound(port):
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(b"POST / HTTP/1.1\r\nhost: test\r\nx-padding: ")
        piece = b"a" * 1000
        refused = False
        # Up to the bound and a piece past it: the server closes only after reading that one.
        for _ in range(MAX_REQUEST_HEAD_BYTES // len(piece) + 1):
            try:
                sock.sendall(piece)
            except (BrokenPipeError, ConnectionResetError):
                refused = True
                break
            time.sleep(0.005)  # separate reads on the server
        assert not refused, "closed before the bound was reached"
        response = _read_response(sock)
        assert response.startswith(b"HTTP/1.1 400 ")
        assert response.endswith(b"Request header fields too large.")
        assert _is_closed(sock)


def test_a_body_far_past_the_bound_is_read_whole(port):
    body_size = 1 << 20
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(_head(100, body_size) + b"b" * body_size)
        response = _read_response(sock)
    assert response.startswith(b"HTTP/1.1 200 ")
    assert response.endswith(str(body_size).encode())


def test_whole_requests_with_bodies_past_the_bound_in_one_read_each_pass(port):
    # A read that ends a head can end the whole request with it: its body is not head bytes.
    body_size = 3 * MAX_REQUEST_HEAD_BYTES
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        for _ in range(2):
            sock.sendall(_head(100, body_size) + b"b" * body_size)
            response = _read_response(sock)
            assert response.startswith(b"HTTP/1.1 200 ")
            assert response.endswith(str(body_size).encode())


def test_heads_within_the_bound_on_one_connection_each_get_their_own_bound(port):
    padding = MAX_REQUEST_HEAD_BYTES * 3 // 4  # two of them together would pass the bound
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        for _ in range(2):
            sock.sendall(_head(padding, 2) + b"ok")
            response = _read_response(sock)
            assert response.startswith(b"HTTP/1.1 200 ") and response.endswith(b"2")
