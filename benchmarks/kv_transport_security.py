"""What protecting the TCP KV transport costs: plain vs per-deployment secret (HMAC challenge
on connect and a Poly1305 MAC of every transfer, shared/kv/transfer/peer_auth.py), side by
side, between two processes.

    python -m benchmarks.kv_transport_security [--quick] [--size-mib 64] [--seconds 3]
        [--rounds 3]

Each round runs a receiver process per config and times, from this process, (a) opening a
fresh connection (connect + handshake + one small transfer, so both configs pay the same round
trips besides the handshake) and (b) sending `--size-mib` of pages again and again on one open
connection. Configs alternate within a round so a busy machine skews both alike. Prints GB/s
(1e9 bytes/s, median transfer) and connection-open milliseconds (median).

`--quick` (a few seconds) is what runs on a shared 2-core box; take figures to quote on a quiet
machine with the defaults (docs/security.md).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import time
from typing import Any

import torch

from splitserve.engine.kv.transfer import (
    KVTransferConfig,
    KVTransferDescriptor,
    create_kv_transport,
)

SECRET = b"benchmark-secret-0123456789abcdef"
CONFIGS = {"plain": None, "secret (handshake, MAC per transfer)": SECRET}
TIMEOUT_S = 60.0
SMALL = torch.zeros((1, 1024), dtype=torch.uint8)


def _config(secret: bytes | None) -> KVTransferConfig:
    return KVTransferConfig(backend="tcp", offer_wait_s=TIMEOUT_S, auth_secret=secret)


def _receiver_main(secret: bytes | None, shape: tuple[int, ...], control: Any) -> None:
    """Posts a destination for every request id the sender announces, until told to stop."""

    async def serve() -> None:
        receiver = await create_kv_transport(_config(secret)).start_receiver()
        control.send(receiver.address)
        loop = asyncio.get_running_loop()
        big, small = torch.empty(shape, dtype=torch.uint8), torch.empty_like(SMALL)
        while True:
            request = await loop.run_in_executor(None, control.recv)
            if request is None:
                break
            destination = small if request.startswith("small") else big
            await receiver.receive(request, destination, TIMEOUT_S)
            control.send("ok")
        await receiver.close()

    asyncio.run(serve())


async def _send(sender, address: str, control: Any, request: str, buffer: torch.Tensor) -> float:
    descriptor = KVTransferDescriptor.for_buffer(request, list(range(buffer.shape[0])), buffer)
    control.send(request)
    await asyncio.sleep(0.005)  # the receiver posts before the offer arrives
    start = time.perf_counter()
    await sender.send(address, descriptor, buffer, TIMEOUT_S)
    elapsed = time.perf_counter() - start
    control.recv()
    return elapsed


async def _measure(secret: bytes | None, address: str, control: Any, buffer, seconds: float):
    """(seconds per bulk transfer, seconds per fresh connection's first small transfer)."""
    bulk, opens = [], []
    for i in range(5):
        sender = create_kv_transport(_config(secret)).create_sender()
        opens.append(await _send(sender, address, control, f"small-{i}", SMALL))
        await sender.close()
    sender = create_kv_transport(_config(secret)).create_sender()
    await _send(sender, address, control, "warmup", buffer)
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline or len(bulk) < 3:
        bulk.append(await _send(sender, address, control, f"bulk-{len(bulk)}", buffer))
    await sender.close()
    return bulk, opens


def run_round(name: str, size_mib: int, seconds: float) -> tuple[list[float], list[float]]:
    secret = CONFIGS[name]
    shape = (size_mib, 1 << 20)
    context = multiprocessing.get_context("spawn")
    ours, theirs = context.Pipe()
    receiver = context.Process(target=_receiver_main, args=(secret, shape, theirs), daemon=True)
    receiver.start()
    try:
        address = ours.recv()
        buffer = torch.randint(0, 255, shape, dtype=torch.uint8)
        return asyncio.run(_measure(secret, address, ours, buffer, seconds))
    finally:
        ours.send(None)
        receiver.join(10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="16 MiB, 0.5 s, 1 round")
    parser.add_argument("--size-mib", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=3.0, help="bulk sending per cell")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    if args.quick:
        args.size_mib, args.seconds, args.rounds = 16, 0.5, 1
    bulk: dict[str, list[float]] = {name: [] for name in CONFIGS}
    opens: dict[str, list[float]] = {name: [] for name in CONFIGS}
    for _ in range(args.rounds):
        for name in CONFIGS:
            times, connects = run_round(name, args.size_mib, args.seconds)
            bulk[name] += times
            opens[name] += connects
    size = args.size_mib << 20
    print(f"TCP KV transport, {args.size_mib} MiB transfers, {args.rounds} round(s), loopback")
    print(f"{'config':28} {'GB/s (median)':>14} {'open ms (median)':>17} {'transfers':>10}")
    for name in CONFIGS:
        gbps = size / statistics.median(bulk[name]) / 1e9
        open_ms = statistics.median(opens[name]) * 1e3
        print(f"{name:28} {gbps:14.2f} {open_ms:17.2f} {len(bulk[name]):10d}")


if __name__ == "__main__":
    main()
