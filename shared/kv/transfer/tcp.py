"""KV transport over plain TCP with asyncio, the fallback where UCX is not installed.
Addresses look like `tcp://HOST:PORT`.

Framing: a control message is a 4-byte big-endian length and that many bytes of JSON; a payload
is the raw bytes, sent from and received into the tensors' own memory (`loop.sock_sendall` /
`loop.sock_recv_into` on memoryviews), so the only copies are the kernel's.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import struct

from splitserve.engine.kv.transfer.base import (
    KVReceiver,
    KVSender,
    KVTransport,
    decode_message,
    encode_message,
    parse_address,
    with_timeout,
)
from splitserve.engine.kv.transfer.config import KVTransferConfig
from splitserve.engine.kv.transfer.protocol import (
    Channel,
    ChannelError,
    ChannelReceiver,
    ChannelSender,
)

_LENGTH = struct.Struct("!I")
# Control messages are small JSON; a larger length means the stream is out of step.
_MAX_MESSAGE_BYTES = 16 << 20


class TcpChannel(Channel):
    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        # Control messages are tiny and each one is waited for: do not let Nagle hold them.
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock = sock
        self._aborted = False

    async def send_message(self, message: dict[str, object]) -> None:
        data = encode_message(message)
        await self._send(_LENGTH.pack(len(data)) + data)

    async def recv_message(self) -> dict[str, object]:
        header = bytearray(_LENGTH.size)
        await self._recv_into(memoryview(header))
        (length,) = _LENGTH.unpack(header)
        if length > _MAX_MESSAGE_BYTES:
            raise ChannelError(f"control message of {length} bytes: stream out of step")
        data = bytearray(length)
        await self._recv_into(memoryview(data))
        return decode_message(data)

    async def send_payload(self, data: memoryview) -> None:
        await self._send(data)

    async def recv_payload(self, data: memoryview) -> None:
        await self._recv_into(data)

    async def _send(self, data: bytes | memoryview) -> None:
        try:
            await asyncio.get_running_loop().sock_sendall(self._sock, data)
        except OSError as exc:
            raise ChannelError(f"tcp send failed: {exc}") from exc

    async def _recv_into(self, data: memoryview) -> None:
        loop = asyncio.get_running_loop()
        filled = 0
        while filled < data.nbytes:
            try:
                received = await loop.sock_recv_into(self._sock, data[filled:])
            except OSError as exc:
                raise ChannelError(f"tcp receive failed: {exc}") from exc
            if received == 0:
                reason = "connection aborted" if self._aborted else "peer closed the connection"
                raise ChannelError(f"{reason} after {filled} of {data.nbytes} bytes")
            filled += received

    def abort(self) -> None:
        # shutdown, not close: a pending sock_recv_into then wakes up with end-of-stream and
        # stops, instead of the event loop polling a closed (maybe reused) file descriptor.
        if not self._aborted:
            self._aborted = True
            with contextlib.suppress(OSError):
                self._sock.shutdown(socket.SHUT_RDWR)

    async def close(self) -> None:
        self.abort()
        self._sock.close()


class TcpReceiver(ChannelReceiver):
    def __init__(self, config: KVTransferConfig, host: str, listener: socket.socket) -> None:
        super().__init__(config.offer_wait_s)
        self._listener = listener
        self._address = f"tcp://{host}:{listener.getsockname()[1]}"
        self._accept_task = asyncio.get_running_loop().create_task(self._accept_forever())

    @property
    def address(self) -> str:
        return self._address

    async def _accept_forever(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            sock, _ = await loop.sock_accept(self._listener)
            self._serve(TcpChannel(sock))

    async def close(self) -> None:
        self._accept_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._accept_task
        self._listener.close()
        await self._close_channels()


class TcpSender(ChannelSender):
    def __init__(self, config: KVTransferConfig) -> None:
        super().__init__()
        self._connect_timeout_s = config.connect_timeout_s

    async def _open_channel(self, address: str) -> Channel:
        host, port = parse_address(address, "tcp")
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setblocking(False)
        try:
            await with_timeout(
                asyncio.get_running_loop().sock_connect(sock, (host, port)),
                self._connect_timeout_s,
                f"connecting to {address}",
            )
        except OSError as exc:
            sock.close()
            raise ChannelError(f"cannot connect to {address}: {exc}") from exc
        except BaseException:
            sock.close()
            raise
        return TcpChannel(sock)


class TcpTransport(KVTransport):
    kind = "tcp"

    def __init__(self, config: KVTransferConfig) -> None:
        self._config = config

    async def start_receiver(self, host: str = "127.0.0.1", port: int = 0) -> KVReceiver:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # Bind where peers reach us; "0.0.0.0" is not an address a peer can dial.
        listener.bind((host, port))
        listener.listen(64)
        listener.setblocking(False)
        return TcpReceiver(self._config, host, listener)

    def create_sender(self) -> KVSender:
        return TcpSender(self._config)
