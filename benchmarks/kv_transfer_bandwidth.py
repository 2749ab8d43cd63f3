"""KV page transfer bandwidth between two processes on one machine, per transport config, next
to an in-process memory copy of the same bytes.

    python -m benchmarks.kv_transfer_bandwidth [--sizes-mib 16 64] [--seconds 2] [--repeat 3]
        [--only NAME ...]

Each config runs a fresh receiver process and sender process (UCX options are fixed per
process). A transfer is timed on the sender from `send` to the receiver's acknowledgement, so it
includes the offer/ready/done round trips; payloads are SmolLM2 pages (737,280 bytes a block).
Prints progress, then a table of GB/s (1e9 bytes/s): the median transfer and the aggregate
(all bytes / all time). On a shared machine use `--repeat 3`: other processes' load skews single
runs badly (spinning progress modes most of all).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import statistics
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from splitserve.engine.kv.transfer import (
    KVTransferConfig,
    KVTransferDescriptor,
    create_kv_transport,
)
from splitserve.engine.kv.transfer.config import DEFAULT_UCX_OPTIONS
from splitserve.kernels.reference import pack_kv_pages, unpack_kv_pages

PAGE_SHAPE = (30, 2, 16, 3, 64)  # SmolLM2: layers, K/V, block_size, kv_heads, head_dim
BYTES_PER_BLOCK = 737_280
WARMUP_TRANSFERS = 2
TIMEOUT_S = 60.0
# (config name, what moves the bytes, size_mib -> seconds of each timed transfer)
Row = tuple[str, str, dict[int, list[float]]]


@dataclass(frozen=True)
class BenchConfig:
    name: str
    path: str  # what UCX_PROTO_INFO / the code says moves the bytes
    backend: str
    ucx_options: Mapping[str, str] = field(default_factory=dict)
    progress_mode: str = "thread"
    checksum: str | None = None

    def __post_init__(self) -> None:
        # A plain dict, so the config pickles into the spawned processes.
        object.__setattr__(self, "ucx_options", dict(self.ucx_options))


CONFIGS = [
    BenchConfig("tcp backend", "asyncio sockets, loopback", "tcp"),
    BenchConfig("ucx, UCX defaults", "tcp/lo (shm withheld: error handling)", "ucx"),
    BenchConfig(
        "ucx, +MM_ERROR_HANDLING",
        "sysv, rndv copy-in/copy-out",
        "ucx",
        {"MM_ERROR_HANDLING": "y"},
    ),
    BenchConfig("ucx, library defaults", "sysv ctrl + cma get zcopy", "ucx", DEFAULT_UCX_OPTIONS),
    BenchConfig(
        "ucx, defaults + crc32",
        "as above, checksum both ends",
        "ucx",
        DEFAULT_UCX_OPTIONS,
        checksum="crc32",
    ),
    BenchConfig(
        "ucx, defaults, polling",
        "as above, busy-polling loop",
        "ucx",
        DEFAULT_UCX_OPTIONS,
        progress_mode="polling",
    ),
    BenchConfig(
        "ucx, defaults, thread-polling",
        "as above, spinning progress thread",
        "ucx",
        DEFAULT_UCX_OPTIONS,
        progress_mode="thread-polling",
    ),
    BenchConfig(
        "ucx, defaults, blocking",
        "as above, ucxx blocking mode",
        "ucx",
        DEFAULT_UCX_OPTIONS,
        progress_mode="blocking",
    ),
    BenchConfig(
        "ucx, TLS=tcp",
        "tcp/lo eager frags (cross-host path)",
        "ucx",
        {**DEFAULT_UCX_OPTIONS, "TLS": "tcp"},
    ),
]


def _num_blocks(size_mib: int) -> int:
    return max(1, round(size_mib * (1 << 20) / BYTES_PER_BLOCK))


def _transfer_config(config: BenchConfig) -> KVTransferConfig:
    return KVTransferConfig(
        backend=config.backend,
        ucx_progress_mode=config.progress_mode,
        ucx_options=dict(config.ucx_options),
        offer_wait_s=TIMEOUT_S,
    )


# --- the two processes -----------------------------------------------------------------------


def _receiver_main(config: BenchConfig, control: Any) -> None:
    """Receives what the sender announces: ("size", num_blocks, count) ... then ("stop",)."""

    async def receive_all() -> None:
        receiver = await create_kv_transport(_transfer_config(config)).start_receiver()
        control.send(receiver.address)
        while (message := control.recv())[0] == "size":
            _, num_blocks, count = message
            destination = torch.empty(num_blocks, *PAGE_SHAPE)
            for i in range(count):
                await receiver.receive(f"{num_blocks}-{i}", destination, TIMEOUT_S)
        await receiver.close()

    asyncio.run(receive_all())


def _sender_main(config: BenchConfig, address: str, control: Any, plan: Any, results: Any) -> None:
    """For each (size_mib, seconds) in `plan`: warms up, then sends for about `seconds`."""

    async def send_all() -> None:
        sender = create_kv_transport(_transfer_config(config)).create_sender()
        for size_mib, seconds in plan:
            times = await _timed_transfers(sender, address, control, size_mib, seconds)
            results.put((size_mib, times))
        control.send(("stop",))
        await sender.close()

    async def _timed_transfers(
        sender: Any, address: str, control: Any, size_mib: int, seconds: float
    ) -> list[float]:
        num_blocks = _num_blocks(size_mib)
        pages = torch.randn(num_blocks, *PAGE_SHAPE)
        # Time one transfer first to size the run; the receiver must know the count up front.
        control.send(("size", num_blocks, 1))
        once = await _send(sender, address, pages, f"{num_blocks}-0", config.checksum)
        count = WARMUP_TRANSFERS + max(5, min(200, int(seconds / once)))
        control.send(("size", num_blocks, count))
        times = [
            await _send(sender, address, pages, f"{num_blocks}-{i}", config.checksum)
            for i in range(count)
        ]
        return times[WARMUP_TRANSFERS:]

    asyncio.run(send_all())


async def _send(
    sender: Any, address: str, pages: torch.Tensor, request_id: str, checksum: str | None
) -> float:
    start = time.perf_counter()
    # The checksum is part of the cost when enabled, so it is inside the timed region.
    descriptor = KVTransferDescriptor.for_buffer(request_id, range(pages.shape[0]), pages, checksum)
    await sender.send(address, descriptor, pages, TIMEOUT_S)
    return time.perf_counter() - start


def run_config(config: BenchConfig, sizes_mib: list[int], seconds: float) -> dict[int, list[float]]:
    context = multiprocessing.get_context("spawn")
    control_receiver, control_sender = context.Pipe()
    results = context.Queue()
    receiver = context.Process(target=_receiver_main, args=(config, control_receiver))
    receiver.start()
    address = control_sender.recv()
    plan = [(size, seconds) for size in sizes_mib]
    sender = context.Process(
        target=_sender_main, args=(config, address, control_sender, plan, results)
    )
    sender.start()
    timings = dict(results.get(timeout=TIMEOUT_S * 4) for _ in sizes_mib)
    sender.join(30)
    receiver.join(30)
    return timings


# --- in-process references -------------------------------------------------------------------


def _time_op(op: Any, seconds: float) -> list[float]:
    op()  # first touch of the memory
    times: list[float] = []
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(times) < 5:
        start = time.perf_counter()
        op()
        times.append(time.perf_counter() - start)
    return times


def reference_timings(size_mib: int, seconds: float) -> dict[str, list[float]]:
    num_blocks = _num_blocks(size_mib)
    pages = torch.randn(num_blocks, *PAGE_SHAPE)
    copy_target = torch.empty_like(pages)
    cache = torch.randn(PAGE_SHAPE[0], 2, 2 * num_blocks, *PAGE_SHAPE[2:])
    block_ids = list(range(1, 2 * num_blocks, 2))  # every other block: a realistic scatter
    return {
        "memory copy (torch copy_)": _time_op(lambda: copy_target.copy_(pages), seconds),
        "pack_kv_pages (sender side)": _time_op(lambda: pack_kv_pages(cache, block_ids), seconds),
        "unpack_kv_pages (receiver side)": _time_op(
            lambda: unpack_kv_pages(pages, cache, block_ids), seconds
        ),
    }


# --- report ----------------------------------------------------------------------------------


def _gbps(size_mib: int, times: list[float]) -> tuple[float, float]:
    num_bytes = _num_blocks(size_mib) * BYTES_PER_BLOCK
    return num_bytes / statistics.median(times) / 1e9, num_bytes * len(times) / sum(times) / 1e9


def _row(name: str, path: str, cells: list[str]) -> str:
    return f"| {name:<32} | {path:<38} | " + " | ".join(f"{c:>16}" for c in cells) + " |"


def print_table(rows: list[Row], sizes: list[int]) -> None:
    print(_row("config", "what moves the bytes", [f"{s} MiB med / agg" for s in sizes]))
    print(_row("-" * 32, "-" * 38, ["-" * 16] * len(sizes)))
    for name, path, timings in rows:
        cells = []
        for size in sizes:
            median, aggregate = _gbps(size, timings[size])
            cells.append(f"{median:5.2f} / {aggregate:5.2f}")
        print(_row(name, path, cells))


def _reference_rows(sizes: list[int], seconds: float) -> list[Row]:
    references: dict[str, dict[int, list[float]]] = {}
    for size in sizes:
        for name, times in reference_timings(size, seconds).items():
            references.setdefault(name, {})[size] = times
    print("  done: in-process references", flush=True)
    return [(name, "in process, 1 thread", timings) for name, timings in references.items()]


def _transfer_rows(
    configs: list[BenchConfig], sizes: list[int], seconds: float, rounds: int
) -> list[Row]:
    best: dict[str, dict[int, list[float]]] = {config.name: {} for config in configs}
    # Round-robin, so that on a shared machine every config meets the same mix of other load.
    for attempt in range(1, rounds + 1):
        for i, config in enumerate(configs, 1):
            load = os.getloadavg()[0]
            print(
                f"[round {attempt}, {i}/{len(configs)}] {config.name} (load {load:.2f}) ...",
                flush=True,
            )
            started = time.perf_counter()
            timings = run_config(config, sizes, seconds)
            summary = ", ".join(f"{s} MiB {_gbps(s, timings[s])[0]:.2f} GB/s" for s in sizes)
            print(f"      {summary} ({time.perf_counter() - started:.0f} s)", flush=True)
            kept = best[config.name]
            for size, times in timings.items():
                if size not in kept or statistics.median(times) < statistics.median(kept[size]):
                    kept[size] = times
    return [(config.name, config.path, best[config.name]) for config in configs]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mib", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--seconds", type=float, default=2.0, help="measuring time per cell")
    parser.add_argument("--only", nargs="*", help="run configs whose name contains one of these")
    parser.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="rounds over all configs; per config and size the run with the best median is kept "
        "(filters out other processes' interference on a shared machine)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)  # the references run on one core, like one transfer does
    sizes = args.sizes_mib
    print(f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f} at start", flush=True)
    print("sizes: " + ", ".join(f"{s} MiB = {_num_blocks(s)} blocks" for s in sizes), flush=True)
    configs = [c for c in CONFIGS if not args.only or any(o in c.name for o in args.only)]
    rows = _reference_rows(sizes, args.seconds)
    rows += _transfer_rows(configs, sizes, args.seconds, args.repeat)
    print(f"\nload average {os.getloadavg()[0]:.2f} at end; GB/s = 1e9 bytes/s", end="")
    print(f"; best of {args.repeat} rounds per cell\n" if args.repeat > 1 else "\n")
    print_table(rows, sizes)


if __name__ == "__main__":
    main()
