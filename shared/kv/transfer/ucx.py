"""KV transport over UCX (ucxx, asyncio). Addresses look like `ucx://HOST:PORT`.

UCX state is per process: one context and worker, started by the first transport with the
config's options. Endpoints keep UCX's peer-failure error handling, so a receiver that dies
fails the sender's transfer with an error rather than leaving it waiting; the default options
in `config.py` keep shared memory and CMA available to such endpoints on one host.
"""

from __future__ import annotations

import os
import threading

# ucxx sets a UCX_* variable that its UCX build does not read, and UCX then warns about it on
# every start; the switch is read when libucs loads, so it must be set before the import.
os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")

import ucxx  # noqa: E402
from ucxx.exceptions import UCXError  # noqa: E402

from splitserve.engine.kv.transfer.base import (
    KVReceiver,
    KVSender,
    KVTransferError,
    KVTransport,
    decode_message,
    encode_message,
    parse_address,
    with_timeout,
)
from splitserve.engine.kv.transfer.config import KVTransferConfig
from splitserve.engine.kv.transfer.protocol import (  # noqa: E402
    Channel,
    ChannelError,
    ChannelReceiver,
    ChannelSender,
)

_started_with: tuple[str, tuple[tuple[str, str], ...]] | None = None


def _start_ucx(config: KVTransferConfig) -> None:
    """Starts this process's UCX context once; later transports must agree with it.

    Called from coroutines only: ucxx attaches its progress to the running event loop, and all
    UCX work of the process must then run on that one loop.
    """
    global _started_with
    wanted = (config.ucx_progress_mode, tuple(sorted(config.ucx_options.items())))
    if _started_with is None:
        ucxx.init(
            options=dict(config.ucx_options),
            env_takes_precedence=True,
            progress_mode=config.ucx_progress_mode,
            # Without it, an awaited request is polled by yielding to the event loop: that
            # thread spins beside the progress thread doing the copy, which on a small CPU box
            # doubled the time of the control round trips. Only the thread mode supports it.
            enable_python_future=config.ucx_progress_mode.startswith("thread"),
        )
        _stop_notifier_before_exit()
        _started_with = wanted
    elif _started_with != wanted:
        raise KVTransferError(
            f"UCX already started in this process with {_started_with}, cannot use {wanted}"
        )


def _stop_notifier_before_exit() -> None:
    """ucxx's notifier thread is not a daemon and only stops when told to, so the interpreter
    would wait for it forever at exit. Plain `atexit` runs after that wait; this hook (the one
    concurrent.futures uses) runs before it."""
    register = getattr(threading, "_register_atexit", None)
    if register is None:  # pragma: no cover - every CPython since 3.9 has it
        raise KVTransferError("cannot arrange to stop ucxx's notifier thread at exit")
    register(ucxx.stop_notifier_thread)


class UcxChannel(Channel):
    def __init__(self, endpoint: ucxx._lib_async.Endpoint) -> None:
        self._endpoint: ucxx._lib_async.Endpoint | None = endpoint

    def _live(self) -> ucxx._lib_async.Endpoint:
        if self._endpoint is None:
            raise ChannelError("connection aborted")
        return self._endpoint

    # Control messages are active messages: one UCX message each, delivered in a buffer of the
    # right size (a tagged `send_obj` costs two: the length, then the bytes). Payloads are
    # tagged messages, received straight into the destination.

    async def send_message(self, message: dict[str, object]) -> None:
        try:
            await self._live().am_send(bytearray(encode_message(message)))
        except UCXError as exc:
            raise ChannelError(f"ucx send failed: {exc}") from exc

    async def recv_message(self) -> dict[str, object]:
        try:
            data = await self._live().am_recv()
        except UCXError as exc:
            raise ChannelError(f"ucx receive failed: {exc}") from exc
        return decode_message(memoryview(data).tobytes())

    async def send_payload(self, data: memoryview) -> None:
        try:
            await self._live().send(data)
        except UCXError as exc:
            raise ChannelError(f"ucx payload send failed: {exc}") from exc

    async def recv_payload(self, data: memoryview) -> None:
        try:
            await self._live().recv(data)
        except UCXError as exc:
            raise ChannelError(f"ucx payload receive failed: {exc}") from exc

    def abort(self) -> None:
        endpoint, self._endpoint = self._endpoint, None
        if endpoint is not None:
            # Cancels outstanding requests; with receiver-driven (get) rendezvous nothing
            # writes into a destination once they are cancelled.
            endpoint.abort()

    async def close(self) -> None:
        endpoint, self._endpoint = self._endpoint, None
        if endpoint is not None:
            await endpoint.close()


class UcxReceiver(ChannelReceiver):
    def __init__(self, config: KVTransferConfig, host: str, port: int) -> None:
        super().__init__(config.offer_wait_s)
        self._listener = ucxx.create_listener(
            self._on_connect, port=port, endpoint_error_handling=True
        )
        self._address = f"ucx://{host}:{self._listener.port}"

    @property
    def address(self) -> str:
        return self._address

    def _on_connect(self, endpoint: ucxx._lib_async.Endpoint) -> None:
        self._serve(UcxChannel(endpoint))

    async def close(self) -> None:
        self._listener.close()
        await self._close_channels()


class UcxSender(ChannelSender):
    def __init__(self, config: KVTransferConfig) -> None:
        super().__init__()
        self._config = config
        self._connect_timeout_s = config.connect_timeout_s

    async def _open_channel(self, address: str) -> Channel:
        host, port = parse_address(address, "ucx")
        _start_ucx(self._config)
        try:
            endpoint = await with_timeout(
                ucxx.create_endpoint(
                    host,
                    port,
                    endpoint_error_handling=True,
                    connect_timeout=self._connect_timeout_s,
                ),
                self._connect_timeout_s,
                f"connecting to {address}",
            )
        except UCXError as exc:
            raise ChannelError(f"cannot connect to {address}: {exc}") from exc
        return UcxChannel(endpoint)


class UcxTransport(KVTransport):
    kind = "ucx"

    def __init__(self, config: KVTransferConfig) -> None:
        self._config = config

    async def start_receiver(self, host: str = "127.0.0.1", port: int = 0) -> KVReceiver:
        _start_ucx(self._config)
        return UcxReceiver(self._config, host, port)

    def create_sender(self) -> KVSender:
        return UcxSender(self._config)
