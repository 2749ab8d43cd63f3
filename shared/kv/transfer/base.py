"""The KV transport contract: what a transfer is (`KVTransferDescriptor`), how it fails
(`KVTransferError`) and the receiver/sender interfaces every backend implements.

A transfer moves one contiguous buffer of packed KV pages
(`splitserve.kernels.reference.pack_kv_pages`
layout, `[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]`) from a sender (the
prefill pod) into a destination tensor that the receiver (the decode pod) posted for the request:

    receiver: receive(request_id, destination) ──posts──┐
    sender:   send(address, descriptor, buffer) ── offer ─▶ ready ─▶ payload ─▶ done

The payload lands straight in the destination's memory; nothing is staged in between.
"""

from __future__ import annotations

import abc
import asyncio
import json
import math
import zlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import torch

try:  # xxh3 hashes at memory speed; crc32 (zlib) is the always-present fallback.
    import xxhash
except ImportError:  # pragma: no cover - depends on the environment
    xxhash = None

CHECKSUM_ALGORITHMS = ("crc32", "xxh3_64")


class KVTransferError(RuntimeError):
    """A transfer did not complete: timeout, unreachable or dead peer, rejected offer, or an
    integrity-check mismatch. The destination's contents are undefined after it."""


def default_checksum_algorithm() -> str:
    return "xxh3_64" if xxhash is not None else "crc32"


def compute_checksum(data: memoryview, algorithm: str) -> int:
    """Checksum of a contiguous byte view. Releases the GIL for large inputs, so callers may
    run it in a worker thread."""
    if algorithm == "crc32":
        return zlib.crc32(data)
    if algorithm == "xxh3_64":
        if xxhash is None:
            raise KVTransferError("checksum xxh3_64 requested but xxhash is not installed")
        return xxhash.xxh3_64_intdigest(data)
    raise ValueError(f"checksum algorithm must be one of {CHECKSUM_ALGORITHMS}, got {algorithm!r}")


def byte_view(tensor: torch.Tensor, name: str = "buffer") -> memoryview:
    """The tensor's own memory as a flat writable byte view (no copy). CPU and contiguous only:
    both transports read and write the memory directly."""
    if tensor.device.type != "cpu":
        raise ValueError(f"{name} must be a CPU tensor, got device {tensor.device}")
    if not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    # Viewing as uint8 first also covers bfloat16, which numpy cannot represent.
    return tensor.reshape(-1).view(torch.uint8).numpy().data


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def kv_format(name: str) -> str:
    """A page dtype in kv_cache_dtype terms, for errors: int8 pages are kv_cache_dtype int8
    (codes and scales, kernels/kv_int8.py); any float dtype is 'auto' in that model dtype."""
    if name == "int8":
        return "int8 (kv_cache_dtype 'int8')"
    return f"{name} (kv_cache_dtype 'auto')"


def _torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"dtype must name a torch dtype, got {name!r}")
    return dtype


@dataclass(frozen=True)
class KVTransferDescriptor:
    """What one transfer carries, sent ahead of the payload so the receiver can check it
    against the destination it posted before any byte of KV is written."""

    request_id: str
    # The receiver's block ids the pages belong to, in packed order (shape[0] of them).
    block_ids: tuple[int, ...]
    # Shape of the packed buffer: [num_blocks, num_layers, 2, block_size, kv_heads, head_dim];
    # int8 pages (kv_cache_dtype int8) end in head_dim + 2: each row's codes, then its scale.
    shape: tuple[int, ...]
    dtype: str  # torch dtype name without the "torch." prefix, e.g. "float32" or "int8"
    num_bytes: int
    checksum: int | None = None  # of the payload bytes; None = not checked
    checksum_algorithm: str | None = None  # one of CHECKSUM_ALGORITHMS when checksum is set

    def __post_init__(self) -> None:
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError("request_id must be a non-empty string")
        object.__setattr__(self, "block_ids", tuple(int(b) for b in self.block_ids))
        object.__setattr__(self, "shape", tuple(int(s) for s in self.shape))
        if any(b < 0 for b in self.block_ids):
            raise ValueError(f"block_ids must be >= 0, got {list(self.block_ids)}")
        if not self.shape or self.shape[0] != len(self.block_ids):
            raise ValueError(
                f"shape[0] must equal len(block_ids) ({len(self.block_ids)}), got {self.shape}"
            )
        itemsize = _torch_dtype(self.dtype).itemsize
        if self.num_bytes != math.prod(self.shape) * itemsize:
            raise ValueError(
                f"num_bytes must be {math.prod(self.shape) * itemsize} for shape {self.shape} "
                f"and dtype {self.dtype}, got {self.num_bytes}"
            )
        if (self.checksum is None) != (self.checksum_algorithm is None):
            raise ValueError("checksum and checksum_algorithm must be given together")
        if self.checksum_algorithm not in (None, *CHECKSUM_ALGORITHMS):
            raise ValueError(
                f"checksum_algorithm must be one of {CHECKSUM_ALGORITHMS}, "
                f"got {self.checksum_algorithm!r}"
            )

    @classmethod
    def for_buffer(
        cls,
        request_id: str,
        block_ids: Sequence[int],
        buffer: torch.Tensor,
        checksum_algorithm: str | None = None,
    ) -> KVTransferDescriptor:
        """Describes `buffer` (a packed page buffer); checksums it when an algorithm is given."""
        checksum = None
        if checksum_algorithm is not None:
            checksum = compute_checksum(byte_view(buffer), checksum_algorithm)
        return cls(
            request_id=request_id,
            block_ids=tuple(block_ids),
            shape=tuple(buffer.shape),
            dtype=dtype_name(buffer.dtype),
            num_bytes=buffer.numel() * buffer.element_size(),
            checksum=checksum,
            checksum_algorithm=checksum_algorithm,
        )

    def check_destination(self, destination: torch.Tensor) -> None:
        """Raises KVTransferError unless `destination` can hold exactly this payload."""
        if dtype_name(destination.dtype) != self.dtype:
            raise KVTransferError(
                f"request {self.request_id}: pages of {kv_format(self.dtype)} do not fit this "
                f"pod's cache of {kv_format(dtype_name(destination.dtype))}: prefill and decode "
                "pods must run the same kv_cache_dtype (and model dtype)"
            )
        if tuple(destination.shape) != self.shape:
            raise KVTransferError(
                f"request {self.request_id}: shape {self.shape} does not match the "
                f"destination's {tuple(destination.shape)}: prefill and decode pods must run "
                "the same model with the same block_size and group_window_layers"
            )

    def to_json(self) -> dict[str, object]:
        return asdict(self)

    @classmethod
    def from_json(cls, fields: dict[str, object]) -> KVTransferDescriptor:
        return cls(**fields)  # type: ignore[arg-type]


def encode_message(message: dict[str, object]) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode()


def decode_message(data: bytes | bytearray) -> dict[str, object]:
    try:
        message = json.loads(bytes(data))
    except ValueError as exc:
        raise KVTransferError(f"malformed control message: {exc}") from exc
    if not isinstance(message, dict) or "type" not in message:
        raise KVTransferError(f"malformed control message: {message!r}")
    return message


class KVReceiver(abc.ABC):
    """The decode side: accepts page buffers pushed by senders into posted destinations.

    All methods must be awaited on the event loop that started the receiver.
    """

    @property
    @abc.abstractmethod
    def address(self) -> str:
        """Where senders reach this receiver, e.g. `ucx://10.0.0.5:41234`."""

    @abc.abstractmethod
    async def receive(
        self, request_id: str, destination: torch.Tensor, timeout: float
    ) -> KVTransferDescriptor:
        """Posts `destination` (contiguous CPU tensor shaped like the packed pages) for
        `request_id` and waits until a sender has filled it and the payload has passed its
        checksum; returns the sender's descriptor.

        Post before asking the prefill side to send, so the offer finds the destination waiting.
        Raises KVTransferError on timeout, a mismatched offer or a checksum mismatch; after a
        timeout no byte is written into `destination` any more (the connection is aborted).
        """

    @abc.abstractmethod
    async def close(self) -> None:
        """Stops accepting connections and fails every pending `receive`."""


class KVSender(abc.ABC):
    """The prefill side: pushes packed page buffers to receivers, one connection per address,
    opened on first use and reused. Transfers to one address run one after another."""

    @abc.abstractmethod
    async def send(
        self,
        address: str,
        descriptor: KVTransferDescriptor,
        buffer: torch.Tensor,
        timeout: float,
    ) -> None:
        """Sends `buffer` (contiguous CPU tensor matching `descriptor`) to the receiver at
        `address` and waits for its acknowledgement. `buffer` must stay unchanged until this
        returns. Raises KVTransferError when the receiver rejects the offer, reports a checksum
        mismatch, is unreachable or dead, or does not answer within `timeout` seconds."""

    @abc.abstractmethod
    async def close(self) -> None:
        """Closes every connection."""


class KVTransport(abc.ABC):
    """One backend ("ucx" or "tcp"): makes receivers and senders that speak to each other."""

    kind: str

    @abc.abstractmethod
    async def start_receiver(self, host: str = "127.0.0.1", port: int = 0) -> KVReceiver:
        """Starts listening on `port` (0 = any free one); `host` is the address peers use."""

    @abc.abstractmethod
    def create_sender(self) -> KVSender: ...


async def with_timeout(coro: object, timeout: float, what: str) -> object:
    """Awaits `coro`, turning a timeout into KVTransferError that says what timed out."""
    try:
        return await asyncio.wait_for(coro, timeout)  # type: ignore[arg-type]
    except TimeoutError as exc:
        raise KVTransferError(f"{what}: timed out after {timeout:g} s") from exc


def parse_address(address: str, scheme: str) -> tuple[str, int]:
    """`scheme://host:port` -> (host, port); ValueError naming `address` otherwise."""
    prefix = f"{scheme}://"
    host, sep, port = address.removeprefix(prefix).rpartition(":")
    if not address.startswith(prefix) or not sep or not host or not port.isdigit():
        raise ValueError(f"address must look like {prefix}HOST:PORT, got {address!r}")
    return host, int(port)
