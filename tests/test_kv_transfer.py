"""KV page transport, both backends for real: UCX over loopback and TCP, across processes.

The receiver lives in this process on one event loop in a background thread (UCX wants all
of a process's UCX work on one loop), shared by the module per backend; senders that must be a
separate process run as spawned children. Pages use SmolLM2's real page shape.
"""

from __future__ import annotations

import asyncio
import importlib.util
import multiprocessing
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Coroutine, Iterator
from dataclasses import dataclass, replace
from typing import Any

import pytest
import torch

from splitserve.common.ports import free_port
from splitserve.engine.kv.disaggregation import (
    RemotePrefillPlan,
    pack_pages,
    page_shape,
    receive_pages,
    send_pages,
    unpack_pages,
)
from splitserve.engine.kv.transfer import (
    KVTransferConfig,
    KVTransferDescriptor,
    KVTransferError,
    create_kv_transport,
)
from splitserve.engine.kv.transfer.base import parse_address

BACKENDS = [
    "tcp",
    pytest.param(
        "ucx",
        marks=pytest.mark.skipif(
            importlib.util.find_spec("ucxx") is None, reason="ucxx-cu12 not installed"
        ),
    ),
]
# SmolLM2-135M: 30 layers, K and V, 16-token blocks, 3 kv heads of 64 -> 737,280 bytes a block.
CACHE_SHAPE = (30, 2, 24, 16, 3, 64)
SRC_BLOCK_IDS = [3, 11, 4, 20, 7]
DST_BLOCK_IDS = [0, 9, 15, 2, 23]
TIMEOUT_S = 20.0  # generous: the box may be busy; the failure tests use their own, short ones
OFFER_WAIT_S = 1.0


def _config(backend: str) -> KVTransferConfig:
    return KVTransferConfig(backend=backend, offer_wait_s=OFFER_WAIT_S, connect_timeout_s=2.0)


def _source_cache(seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(CACHE_SHAPE, generator=generator)


class LoopThread:
    """An asyncio loop in a daemon thread; `run` executes a coroutine on it and waits."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, Any], timeout: float = 60.0) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(5)


@pytest.fixture(scope="module")
def loop_thread() -> Iterator[LoopThread]:
    thread = LoopThread()
    yield thread
    thread.stop()


@dataclass
class Endpoints:
    backend: str
    receiver: Any  # KVReceiver
    sender: Any  # KVSender, in this process


@pytest.fixture(scope="module", params=BACKENDS)
def endpoints(request: pytest.FixtureRequest, loop_thread: LoopThread) -> Iterator[Endpoints]:
    transport = create_kv_transport(_config(request.param))

    async def start() -> Endpoints:
        receiver = await transport.start_receiver()
        return Endpoints(request.param, receiver, transport.create_sender())

    ends = loop_thread.run(start())
    yield ends
    loop_thread.run(ends.sender.close())
    loop_thread.run(ends.receiver.close())


# --- a sender in another process -------------------------------------------------------------


def _sender_child(backend: str, address: str, seed: int, results: Any) -> None:
    """Sends the good transfer, then one whose payload was changed after its checksum."""

    async def main() -> None:
        kv_cache = _source_cache(seed)
        sender = create_kv_transport(_config(backend)).create_sender()
        pages = pack_pages(kv_cache, SRC_BLOCK_IDS)
        await send_pages(sender, address, "exact", pages, DST_BLOCK_IDS, TIMEOUT_S, "crc32")
        results.put(("exact", "ok"))
        pages = kv_cache[:, :, SRC_BLOCK_IDS].permute(2, 0, 1, 3, 4, 5).contiguous()
        descriptor = KVTransferDescriptor.for_buffer("corrupt", DST_BLOCK_IDS, pages, "crc32")
        pages.view(-1)[12345] += 1.0  # the test hook: the payload no longer matches
        try:
            await sender.send(address, descriptor, pages, TIMEOUT_S)
            results.put(("corrupt", "ok"))
        except KVTransferError as exc:
            results.put(("corrupt", f"KVTransferError: {exc}"))
        await sender.close()

    asyncio.run(main())


@dataclass
class CrossProcessRun:
    seed: int
    destination: torch.Tensor  # the receiving KV cache, zeros before
    exact_error: BaseException | None
    corrupt_error: BaseException | None
    child_results: dict[str, str]


async def _receive_into(
    receiver: Any, request_id: str, kv_cache: torch.Tensor
) -> None:
    """What a decode pod does: receive the packed pages, then scatter them into its cache
    (only once the whole payload arrived and passed its checksum)."""
    shape = page_shape(kv_cache, len(DST_BLOCK_IDS))
    plan = RemotePrefillPlan(request_id, 0, 0, DST_BLOCK_IDS, shape, kv_cache.dtype)
    pages, _ = await receive_pages(receiver, plan, TIMEOUT_S)
    unpack_pages(pages, kv_cache, DST_BLOCK_IDS)


async def _receive_both(ends: Endpoints, destination: torch.Tensor) -> list[Any]:
    scratch = torch.zeros_like(destination)
    return await asyncio.gather(
        _receive_into(ends.receiver, "exact", destination),
        _receive_into(ends.receiver, "corrupt", scratch),
        return_exceptions=True,
    )


@pytest.fixture(scope="module")
def cross_process_run(endpoints: Endpoints, loop_thread: LoopThread) -> CrossProcessRun:
    seed = 1234
    destination = torch.zeros(CACHE_SHAPE)
    receiving = asyncio.run_coroutine_threadsafe(
        _receive_both(endpoints, destination), loop_thread.loop
    )
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    child = context.Process(
        target=_sender_child, args=(endpoints.backend, endpoints.receiver.address, seed, results)
    )
    child.start()
    outcomes = receiving.result(2 * TIMEOUT_S + 30)
    child.join(30)
    child_results = dict(results.get(timeout=5) for _ in range(2))
    errors = [o if isinstance(o, BaseException) else None for o in outcomes]
    return CrossProcessRun(seed, destination, errors[0], errors[1], child_results)


def test_pages_arrive_bit_exact_at_other_block_ids(cross_process_run: CrossProcessRun) -> None:
    run = cross_process_run
    assert run.exact_error is None
    assert run.child_results["exact"] == "ok"
    source = _source_cache(run.seed)
    assert torch.equal(run.destination[:, :, DST_BLOCK_IDS], source[:, :, SRC_BLOCK_IDS])
    untouched = [b for b in range(CACHE_SHAPE[2]) if b not in DST_BLOCK_IDS]
    assert torch.count_nonzero(run.destination[:, :, untouched]) == 0


def test_checksum_mismatch_fails_both_sides(cross_process_run: CrossProcessRun) -> None:
    run = cross_process_run
    assert isinstance(run.corrupt_error, KVTransferError)
    assert "crc32 checksum mismatch" in str(run.corrupt_error)
    assert run.child_results["corrupt"].startswith("KVTransferError")
    assert "crc32 checksum mismatch" in run.child_results["corrupt"]


# --- one process: protocol checks ------------------------------------------------------------


def _pages(num_blocks: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(num_blocks, *CACHE_SHAPE[:2], *CACHE_SHAPE[3:]).to(dtype)


async def _send_and_receive(
    ends: Endpoints, request_id: str, pages: torch.Tensor, destination: torch.Tensor
) -> list[Any]:
    descriptor = KVTransferDescriptor.for_buffer(request_id, range(pages.shape[0]), pages)
    return await asyncio.gather(
        ends.receiver.receive(request_id, destination, TIMEOUT_S),
        ends.sender.send(ends.receiver.address, descriptor, pages, TIMEOUT_S),
        return_exceptions=True,
    )


def test_bfloat16_pages_arrive_bit_exact(endpoints: Endpoints, loop_thread: LoopThread) -> None:
    pages = _pages(2, torch.bfloat16)
    destination = torch.zeros_like(pages)
    received, sent = loop_thread.run(_send_and_receive(endpoints, "bf16", pages, destination))
    assert sent is None
    assert received.dtype == "bfloat16" and received.block_ids == (0, 1)
    assert torch.equal(destination, pages)


def test_mismatched_offer_is_rejected_before_any_payload(
    endpoints: Endpoints, loop_thread: LoopThread
) -> None:
    pages = _pages(2)
    destination = torch.zeros(3, *pages.shape[1:])  # room for 3 blocks, 2 offered
    received, sent = loop_thread.run(_send_and_receive(endpoints, "shape", pages, destination))
    for outcome in (received, sent):
        assert isinstance(outcome, KVTransferError)
        assert "does not match the destination" in str(outcome)
    assert torch.count_nonzero(destination) == 0


def test_int8_pages_into_a_float_cache_are_refused_naming_kv_cache_dtype(
    endpoints: Endpoints, loop_thread: LoopThread
) -> None:
    """A prefill pod with kv_cache_dtype int8 and a decode pod with auto (or the reverse)."""
    from splitserve.kernels.kv_int8 import quantize_rows

    pages = quantize_rows(_pages(2))  # int8 rows: head_dim + 2 elements, scales inside
    destination = torch.zeros(pages.shape[:-1] + (pages.shape[-1] - 2,))
    received, sent = loop_thread.run(_send_and_receive(endpoints, "kvdt", pages, destination))
    for outcome in (received, sent):
        assert isinstance(outcome, KVTransferError)
        assert "must run the same kv_cache_dtype" in str(outcome)
        assert "int8 (kv_cache_dtype 'int8')" in str(outcome)
    assert torch.count_nonzero(destination) == 0


def test_offer_without_posted_receive_is_rejected(
    endpoints: Endpoints, loop_thread: LoopThread
) -> None:
    pages = _pages(1)
    descriptor = KVTransferDescriptor.for_buffer("unposted", [0], pages)
    start = time.monotonic()
    with pytest.raises(KVTransferError, match="no receive posted for request unposted"):
        loop_thread.run(endpoints.sender.send(endpoints.receiver.address, descriptor, pages, 10))
    assert time.monotonic() - start < OFFER_WAIT_S + 2


def test_receive_times_out_when_nothing_arrives(
    endpoints: Endpoints, loop_thread: LoopThread
) -> None:
    start = time.monotonic()
    with pytest.raises(KVTransferError, match="receiving request silent: timed out after 0.3 s"):
        loop_thread.run(endpoints.receiver.receive("silent", torch.empty(4), 0.3))
    assert time.monotonic() - start < 2.0


async def _queued_send_times_out(ends: Endpoints) -> tuple[BaseException | None, torch.Tensor]:
    pages = _pages(1)
    first = KVTransferDescriptor.for_buffer("in-flight", [0], pages)
    sending_first = asyncio.ensure_future(
        ends.sender.send(ends.receiver.address, first, pages, TIMEOUT_S)
    )
    await asyncio.sleep(0.2)  # the first offer now holds the connection, waiting for a receive
    queued = replace(first, request_id="queued")
    try:
        await ends.sender.send(ends.receiver.address, queued, pages, 0.2)
        queued_error = None
    except KVTransferError as exc:
        queued_error = exc
    destination = torch.zeros_like(pages)
    await ends.receiver.receive("in-flight", destination, TIMEOUT_S)
    await sending_first
    return queued_error, destination - pages


def test_queued_send_timing_out_leaves_the_transfer_in_flight_intact(
    endpoints: Endpoints, loop_thread: LoopThread
) -> None:
    queued_error, difference = loop_thread.run(_queued_send_times_out(endpoints))
    assert isinstance(queued_error, KVTransferError)
    assert "sending request queued" in str(queued_error) and "timed out after 0.2 s" in str(
        queued_error
    )
    assert torch.count_nonzero(difference) == 0


def test_send_to_address_nobody_listens_on_fails_within_timeout(
    endpoints: Endpoints, loop_thread: LoopThread
) -> None:
    pages = _pages(1)
    descriptor = KVTransferDescriptor.for_buffer("nobody", [0], pages)
    address = f"{endpoints.backend}://127.0.0.1:{free_port()}"
    start = time.monotonic()
    with pytest.raises(KVTransferError, match=f"{address}"):
        loop_thread.run(endpoints.sender.send(address, descriptor, pages, 4.0))
    assert time.monotonic() - start < 4.0 + 1.0


_RECEIVER_CHILD = """
import asyncio, sys, torch
from splitserve.engine.kv.transfer import create_kv_transport

async def main():
    receiver = await create_kv_transport(sys.argv[1]).start_receiver()
    print(receiver.address, flush=True)
    await receiver.receive("before", torch.empty(1, 30, 2, 16, 3, 64), timeout=60)
    print("received", flush=True)
    await asyncio.sleep(120)

asyncio.run(main())
"""


def test_send_to_receiver_that_died_fails_within_timeout(
    endpoints: Endpoints, loop_thread: LoopThread
) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", _RECEIVER_CHILD, endpoints.backend],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        address = child.stdout.readline().strip()
        parse_address(address, endpoints.backend)
        pages = _pages(1)
        before = KVTransferDescriptor.for_buffer("before", [0], pages)
        loop_thread.run(endpoints.sender.send(address, before, pages, TIMEOUT_S))
        assert child.stdout.readline().strip() == "received"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(10)
    after = replace(before, request_id="after")
    start = time.monotonic()
    with pytest.raises(KVTransferError, match=f"sending request after to {address}"):
        loop_thread.run(endpoints.sender.send(address, after, pages, 4.0))
    assert time.monotonic() - start < 4.0 + 1.0


# --- input validation ------------------------------------------------------------------------


def test_bad_inputs_raise_value_error_naming_the_parameter() -> None:
    with pytest.raises(ValueError, match="backend"):
        create_kv_transport("rdma")
    with pytest.raises(ValueError, match="address"):
        parse_address("ucx://no-port", "ucx")
    with pytest.raises(ValueError, match="num_bytes"):
        KVTransferDescriptor("r", (0,), (1, 4), "float32", num_bytes=15)
    with pytest.raises(ValueError, match=r"shape\[0\]"):
        KVTransferDescriptor("r", (0, 1), (1, 4), "float32", num_bytes=16)
    with pytest.raises(ValueError, match="checksum"):
        KVTransferDescriptor("r", (0,), (1, 4), "float32", num_bytes=16, checksum=1)
    with pytest.raises(ValueError, match="src_block_ids"):
        pages = pack_pages(torch.zeros(CACHE_SHAPE), [1])
        asyncio.run(send_pages(None, "tcp://h:1", "r", pages, [1, 2], 1.0))


def test_buffer_not_matching_its_descriptor_is_rejected(
    endpoints: Endpoints, loop_thread: LoopThread
) -> None:
    descriptor = KVTransferDescriptor.for_buffer("mismatch", [0, 1], _pages(2))
    with pytest.raises(ValueError, match="buffer is"):
        loop_thread.run(
            endpoints.sender.send(endpoints.receiver.address, descriptor, _pages(1), 1.0)
        )


def test_non_contiguous_destination_is_rejected(endpoints: Endpoints, loop_thread: LoopThread):
    destination = torch.zeros(4, 6).t()
    with pytest.raises(ValueError, match="destination must be contiguous"):
        loop_thread.run(endpoints.receiver.receive("strided", destination, 1.0))


def test_descriptor_round_trips_through_json() -> None:
    pages = _pages(2)
    descriptor = KVTransferDescriptor.for_buffer("json", [8, 3], pages, "crc32")
    assert KVTransferDescriptor.from_json(descriptor.to_json()) == descriptor
    assert descriptor.num_bytes == 2 * 737_280
    assert descriptor.shape == (2, 30, 2, 16, 3, 64)
