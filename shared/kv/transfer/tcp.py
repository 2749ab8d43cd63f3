"""KV transport over plain TCP with asyncio, the fallback where UCX is not installed.
Addresses look like `tcp://HOST:PORT`. With `KVTransferConfig.auth_secret` both ends prove
the per-deployment secret before any control message (peer_auth.py).

Framing: a control message is a 4-byte big-endian length and that many bytes of JSON; a payload
is the raw bytes, sent from and received into the tensors' own memory (`loop.sock_sendall` /
`loop.sock_recv_into` on memoryviews), so the only copies are the kernel's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
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
from splitserve.engine.kv.transfer.peer_auth import PeerAuthError, check_client, prove_to_server
from splitserve.engine.kv.transfer.protocol import (
    Channel,
    ChannelError,
    ChannelReceiver,
    ChannelSender,
)

logger = logging.getLogger(__name__)

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

    async def send_raw(self, data: bytes) -> None:
        await self._send(data)

    async def recv_exactly(self, num_bytes: int) -> bytes:
        data = bytearray(num_bytes)
        await self._recv_into(memoryview(data))
        return bytes(data)

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
        self._secret = config.auth_secret
        self._auth_timeout_s = config.connect_timeout_s
        self._admitting: set[asyncio.Task[None]] = set()  # connections still proving the secret
        self._listener = listener
        self._address = f"tcp://{host}:{listener.getsockname()[1]}"
        self._accept_task = asyncio.get_running_loop().create_task(self._accept_forever())

    @property
    def address(self) -> str:
        return self._address

    async def _accept_forever(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            sock, peer = await loop.sock_accept(self._listener)
            if self._secret is None:
                self._serve(TcpChannel(sock))
                continue
            task = loop.create_task(self._admit(TcpChannel(sock), peer))
            self._admitting.add(task)
            task.add_done_callback(self._admitting.discard)

    async def _admit(self, channel: TcpChannel, peer: object) -> None:
        """Serves the connection once the peer has proved the secret; closes it otherwise."""
        assert self._secret is not None, "admitting needs a secret"
        try:
            channel.session_key = await asyncio.wait_for(
                check_client(self._secret, channel.send_raw, channel.recv_exactly),
                self._auth_timeout_s,
            )
        except (PeerAuthError, ChannelError, TimeoutError) as error:
            logger.warning("refused a KV connection from %s: %s", peer, error or "timed out")
            await channel.close()
            return
        self._serve(channel)

    async def close(self) -> None:
        self._accept_task.cancel()
        for task in (self._accept_task, *self._admitting):
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._listener.close()
        await self._close_channels()


class TcpSender(ChannelSender):
    def __init__(self, config: KVTransferConfig) -> None:
        super().__init__()
        self._connect_timeout_s = config.connect_timeout_s
        self._secret = config.auth_secret

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
        channel = TcpChannel(sock)
        if self._secret is not None:
            await self._prove(channel, address)
        return channel

    async def _prove(self, channel: TcpChannel, address: str) -> None:
        assert self._secret is not None, "proving needs a secret"
        try:
            session_key = await with_timeout(
                prove_to_server(self._secret, channel.send_raw, channel.recv_exactly),
                self._connect_timeout_s,
                f"authenticating {address}",
            )
            assert isinstance(session_key, bytes), "prove_to_server returns the session key"
            channel.session_key = session_key
        except PeerAuthError as error:
            await channel.close()
            raise ChannelError(f"{address}: {error}") from None
        except ChannelError as error:
            await channel.close()
            raise ChannelError(
                f"{address} refused the connection while authenticating (wrong or missing KV "
                f"secret?): {error}"
            ) from None
        except BaseException:
            await channel.close()
            raise


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
