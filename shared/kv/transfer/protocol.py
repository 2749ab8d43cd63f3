"""The transfer protocol, written once over a `Channel` that each backend implements.

One transfer on one connection, every step awaited before the next:

    sender                                    receiver
    offer {descriptor}          ───────▶      claim the destination posted for request_id
                                ◀───────      ready | reject {error}
    payload (num_bytes)         ───────▶      lands in the destination's memory
    mac {mac}                   ───────▶      (on a connection with a session key only)
                                ◀───────      done {ok, error}   (after the checksum and MAC)

On a connection whose ends proved the deployment's secret (`Channel.session_key`, TCP with
`--kv-secret-file`) every transfer is followed by the MAC of its number on the connection, its
descriptor and its payload (peer_auth.transfer_mac), which the sender computes once the
payload is out; the receiver fails a transfer whose bytes do not match it (or that no MAC
follows), so pages altered on the network never count as received.

The offer goes first so a mismatched or unexpected transfer is refused before any payload
moves, and so the payload never arrives ahead of its destination. Transfers on one connection
are serialised by the sender; concurrency comes from one connection per peer address.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import json
import logging
from dataclasses import dataclass, field

import torch

from splitserve.engine.kv.transfer.base import (
    KVReceiver,
    KVSender,
    KVTransferDescriptor,
    KVTransferError,
    byte_view,
    compute_checksum,
    dtype_name,
)
from splitserve.engine.kv.transfer.peer_auth import macs_equal, transfer_mac

logger = logging.getLogger(__name__)


class ChannelError(KVTransferError):
    """The connection itself failed or was closed; it cannot carry another transfer."""


class Channel(abc.ABC):
    """One connection: ordered control messages and raw payloads. Failures raise ChannelError."""

    # Set by a backend whose peers proved the deployment's secret when it opened (peer_auth):
    # transfers on it are then MACed, each under its number on the connection.
    session_key: bytes | None = None
    _num_offers: int = 0

    def next_offer_number(self) -> int:
        """Numbers the offers on this connection, sent or read, refused ones too: both ends
        count alike."""
        number, self._num_offers = self._num_offers, self._num_offers + 1
        return number

    @abc.abstractmethod
    async def send_message(self, message: dict[str, object]) -> None: ...

    @abc.abstractmethod
    async def recv_message(self) -> dict[str, object]: ...

    @abc.abstractmethod
    async def send_payload(self, data: memoryview) -> None: ...

    @abc.abstractmethod
    async def recv_payload(self, data: memoryview) -> None:
        """Fills all of `data` (the destination's own memory)."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Breaks the connection now: pending operations fail and no byte is written into a
        destination after this returns."""

    async def close(self) -> None:
        self.abort()


# --- sender side -----------------------------------------------------------------------------


async def push_transfer(
    channel: Channel, descriptor: KVTransferDescriptor, data: memoryview
) -> None:
    """Runs one transfer from the sender's side; KVTransferError if the receiver refuses it."""
    sequence = channel.next_offer_number() if channel.session_key is not None else 0
    await channel.send_message({"type": "offer", "descriptor": descriptor.to_json()})
    reply = await channel.recv_message()
    if reply["type"] == "reject":
        raise KVTransferError(
            f"receiver rejected request {descriptor.request_id}: {reply['error']}"
        )
    _expect(reply, "ready")
    await channel.send_payload(data)
    if channel.session_key is not None:
        tag = _mac(channel, sequence, descriptor, data)
        await channel.send_message({"type": "mac", "mac": tag})
    reply = await channel.recv_message()
    _expect(reply, "done")
    if not reply["ok"]:
        raise KVTransferError(f"receiver failed request {descriptor.request_id}: {reply['error']}")


def _mac(
    channel: Channel, sequence: int, descriptor: KVTransferDescriptor, data: memoryview
) -> str:
    """The MAC of offer `sequence` on `channel`. On the event loop itself: Poly1305 holds the
    GIL anyway (a worker thread gained nothing and paid the hand-offs); about 6 ms per 12 MiB
    of pages fresh from the network on the development machine (docs/security.md)."""
    assert channel.session_key is not None, "a MAC needs the connection's session key"
    header = json.dumps(descriptor.to_json(), sort_keys=True, separators=(",", ":")).encode()
    return transfer_mac(channel.session_key, sequence, header, data)


def _expect(message: dict[str, object], kind: str) -> None:
    if message["type"] != kind:
        raise ChannelError(f"protocol error: expected {kind!r}, got {message['type']!r}")


class ChannelSender(KVSender):
    """A KVSender over cached channels; backends supply `_open_channel`."""

    def __init__(self) -> None:
        self._channels: dict[str, Channel] = {}  # address -> open connection
        self._locks: dict[str, asyncio.Lock] = {}  # address -> one transfer at a time

    @abc.abstractmethod
    async def _open_channel(self, address: str) -> Channel: ...

    async def send(
        self,
        address: str,
        descriptor: KVTransferDescriptor,
        buffer: torch.Tensor,
        timeout: float,
    ) -> None:
        data = byte_view(buffer, "buffer")
        if tuple(buffer.shape) != descriptor.shape or dtype_name(buffer.dtype) != descriptor.dtype:
            raise ValueError(
                f"buffer is {tuple(buffer.shape)} {dtype_name(buffer.dtype)} but the descriptor "
                f"says {descriptor.shape} {descriptor.dtype}"
            )
        what = f"sending request {descriptor.request_id} to {address}"
        try:
            await asyncio.wait_for(self._send_serialised(address, descriptor, data), timeout)
        except TimeoutError as exc:
            raise KVTransferError(f"{what}: timed out after {timeout:g} s") from exc
        except ChannelError as exc:
            raise ChannelError(f"{what}: {exc}") from exc

    async def _send_serialised(
        self, address: str, descriptor: KVTransferDescriptor, data: memoryview
    ) -> None:
        async with self._locks.setdefault(address, asyncio.Lock()):
            channel = self._channels.get(address)
            if channel is None:
                channel = self._channels[address] = await self._open_channel(address)
            try:
                await push_transfer(channel, descriptor, data)
            except (ChannelError, asyncio.CancelledError):
                # Broken, or cut off mid-transfer by the timeout and now out of step: never
                # reuse it. (A send still queued on the lock when it times out owns nothing.)
                self._drop(address, channel)
                raise

    def _drop(self, address: str, channel: Channel) -> None:
        if self._channels.get(address) is channel:
            del self._channels[address]
        channel.abort()

    async def close(self) -> None:
        channels, self._channels = list(self._channels.values()), {}
        for channel in channels:
            await channel.close()


# --- receiver side ---------------------------------------------------------------------------


@dataclass
class _PostedReceive:
    destination: torch.Tensor
    done: asyncio.Future[KVTransferDescriptor]
    # Set once an offer claimed this receive; the payload is arriving over it.
    channel: Channel | None = None


@dataclass
class PostedReceives:
    """request_id -> the destination a `receive` posted. Owned by the receiver's event loop."""

    _posted: dict[str, _PostedReceive] = field(default_factory=dict)
    _changed: asyncio.Condition = field(default_factory=asyncio.Condition)

    async def post(self, request_id: str, destination: torch.Tensor) -> _PostedReceive:
        if request_id in self._posted:
            raise ValueError(f"request_id {request_id!r} already has a receive posted")
        entry = _PostedReceive(destination, asyncio.get_running_loop().create_future())
        self._posted[request_id] = entry
        async with self._changed:
            self._changed.notify_all()
        return entry

    def remove(self, request_id: str) -> None:
        self._posted.pop(request_id, None)

    async def claim(
        self, descriptor: KVTransferDescriptor, channel: Channel, wait_s: float
    ) -> _PostedReceive:
        """The posted receive this offer fills, waiting up to `wait_s` for it to be posted."""
        request_id = descriptor.request_id

        def is_posted() -> bool:
            return request_id in self._posted

        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(is_posted), wait_s)
            except TimeoutError:
                raise KVTransferError(f"no receive posted for request {request_id}") from None
        entry = self._posted[request_id]
        if entry.channel is not None:
            raise KVTransferError(f"request {request_id} is already being received")
        try:
            descriptor.check_destination(entry.destination)
        except KVTransferError as exc:
            _settle(entry, exc)
            raise
        entry.channel = channel
        return entry

    def fail_all(self, error: KVTransferError) -> None:
        for entry in self._posted.values():
            _settle(entry, error)
            if entry.channel is not None:
                entry.channel.abort()


def _settle(entry: _PostedReceive, outcome: KVTransferDescriptor | KVTransferError) -> None:
    if entry.done.done():
        return
    if isinstance(outcome, KVTransferError):
        entry.done.set_exception(outcome)
    else:
        entry.done.set_result(outcome)


async def serve_channel(channel: Channel, posted: PostedReceives, offer_wait_s: float) -> None:
    """Answers offers on one connection until the peer goes away."""
    try:
        while True:
            try:
                message = await channel.recv_message()
            except ChannelError as exc:
                logger.debug("kv transfer connection ended: %s", exc)
                return
            _expect(message, "offer")
            await _serve_offer(channel, posted, message, offer_wait_s)
    except ChannelError as exc:
        logger.warning("kv transfer connection failed mid-transfer: %s", exc)
    finally:
        channel.abort()


async def _serve_offer(
    channel: Channel, posted: PostedReceives, offer: dict[str, object], offer_wait_s: float
) -> None:
    sequence = channel.next_offer_number() if channel.session_key is not None else 0
    try:
        descriptor = KVTransferDescriptor.from_json(offer["descriptor"])  # type: ignore[arg-type]
        entry = await posted.claim(descriptor, channel, offer_wait_s)
    except (KVTransferError, ValueError, TypeError) as exc:
        await channel.send_message({"type": "reject", "error": str(exc)})
        return
    await channel.send_message({"type": "ready"})
    try:
        data = byte_view(entry.destination, "destination")
        await channel.recv_payload(data)
        mac = None
        if channel.session_key is not None:
            # Read before any check can fail: the sender sends it whatever the outcome, and
            # a trailer left unread would be taken for the next offer.
            trailer = await channel.recv_message()
            _expect(trailer, "mac")
            mac = trailer.get("mac")
        await _verify_checksum(descriptor, data)
        if channel.session_key is not None:
            await _verify_mac(channel, sequence, descriptor, data, mac)
    except ChannelError as exc:
        _settle(entry, exc)
        raise
    except KVTransferError as exc:
        await _reply_then_settle(channel, entry, exc)
        return
    await _reply_then_settle(channel, entry, descriptor)


async def _reply_then_settle(
    channel: Channel, entry: _PostedReceive, outcome: KVTransferDescriptor | KVTransferError
) -> None:
    """Acknowledges before the waiting `receive` returns, so the sender hears the outcome even
    if the receiving side moves on (or exits) right after. The payload has fully arrived at this
    point, so the outcome stands even if the acknowledgement cannot be delivered."""
    if isinstance(outcome, KVTransferError):
        reply: dict[str, object] = {"type": "done", "ok": False, "error": str(outcome)}
    else:
        reply = {"type": "done", "ok": True}
    try:
        await channel.send_message(reply)
    finally:
        _settle(entry, outcome)


async def _verify_checksum(descriptor: KVTransferDescriptor, data: memoryview) -> None:
    if descriptor.checksum_algorithm is None:
        return
    # Off the event loop: hashing tens of MiB takes milliseconds (zlib releases the GIL).
    actual = await asyncio.to_thread(compute_checksum, data, descriptor.checksum_algorithm)
    if actual != descriptor.checksum:
        raise KVTransferError(
            f"request {descriptor.request_id}: {descriptor.checksum_algorithm} checksum "
            f"mismatch (sent {descriptor.checksum:#x}, received {actual:#x})"
        )


async def _verify_mac(
    channel: Channel,
    sequence: int,
    descriptor: KVTransferDescriptor,
    data: memoryview,
    received: object,
) -> None:
    expected = _mac(channel, sequence, descriptor, data)
    if not macs_equal(expected, received):
        raise KVTransferError(
            f"request {descriptor.request_id}: the pages' MAC does not match (altered in "
            "transit, or a sender without this connection's key)"
        )


class ChannelReceiver(KVReceiver):
    """A KVReceiver serving channels that a backend's listener hands to `_serve`."""

    def __init__(self, offer_wait_s: float) -> None:
        self._posted = PostedReceives()
        self._offer_wait_s = offer_wait_s
        self._serve_tasks: set[asyncio.Task[None]] = set()

    def _serve(self, channel: Channel) -> None:
        task = asyncio.get_running_loop().create_task(
            serve_channel(channel, self._posted, self._offer_wait_s)
        )
        self._serve_tasks.add(task)
        task.add_done_callback(self._serve_tasks.discard)

    async def receive(
        self, request_id: str, destination: torch.Tensor, timeout: float
    ) -> KVTransferDescriptor:
        byte_view(destination, "destination")  # rejects non-CPU / non-contiguous up front
        entry = await self._posted.post(request_id, destination)
        try:
            return await asyncio.wait_for(asyncio.shield(entry.done), timeout)
        except TimeoutError:
            entry.done.cancel()  # a late outcome from the serving task is then dropped
            if entry.channel is not None:
                # The payload is still arriving: cut it off so the caller may reuse the blocks.
                entry.channel.abort()
            raise KVTransferError(
                f"receiving request {request_id}: timed out after {timeout:g} s"
            ) from None
        finally:
            self._posted.remove(request_id)

    async def _close_channels(self) -> None:
        self._posted.fail_all(KVTransferError("receiver closed"))
        for task in list(self._serve_tasks):
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.gather(*self._serve_tasks, return_exceptions=True)
