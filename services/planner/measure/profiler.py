"""`splitserve plan profile`: measures one pod's costs with the real engine on this machine.

Every figure is the median of `repeats` timed `EngineCore.step()` calls (the loop a pod
runs). The median, not the fastest: a loaded pod pays a step's typical cost, and profiles
made of minimums put every simulated figure of the last validation below the measured one.
Measure on a quiet machine all the same: other processes only ever add time to a step.

- prefill: one prompt of N tokens (fresh token ids, so nothing is cached) in one step;
- decode: B requests decoding at context L. Each shares one L-token prompt prefix that was
  prefilled once and sits in the prefix cache, plus one block of its own, so setting up a
  point costs B blocks of prefill instead of B * L tokens; then the decode steps are timed;
- mixed: B requests decoding at one context, as above, and beside them one fresh prompt of C
  tokens computed whole in the same step (what a colocated pod runs);
- KV capacity: the blocks `--kv-cache-bytes` holds (what `splitserve up` gives a pod), at the
  engine's `--quantization` / `--kv-cache-dtype` / parallel layout, which the profile records;
- KV transfer: pack a request's pages, send them through `splitserve.engine.kv.transfer` to a
receiver
  in this process, unpack them, at two sizes; the fit gives latency and bandwidth;
- with `--neighbor-core`: steps beside a second engine on that CPU (`neighbor.py`).
"""

from __future__ import annotations

import asyncio
import platform
import statistics
import sys
import time

import torch

from splitserve.engine.kv.disaggregation import pack_pages, unpack_pages
from splitserve.engine.kv.transfer import (
    KVTransferConfig,
    KVTransferDescriptor,
    create_kv_transport,
)
from splitserve.planner.measure.engine_steps import (
    Log,
    add_request,
    drain,
    fresh_tokens,
    load_engine,
    timed_step,
    warm_up,
)
from splitserve.planner.measure.neighbor import measure_neighbor
from splitserve.planner.measure.settings import ProfileSettings
from splitserve.planner.measure.tiers import measure_tier_loads
from splitserve.planner.profile import (
    DecodeGrid,
    EngineSetup,
    KVTransferModel,
    MixedGrid,
    PrefillSample,
    Profile,
)

TIMEOUT_S = 60.0


def log_to_stderr(message: str) -> None:
    print(f"[plan profile {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def measure_profile(settings: ProfileSettings, log: Log = log_to_stderr, engine=None) -> Profile:
    """The profile of `engine` (loaded from `settings` when None; a caller passes its own to
    time it again beside a running stack, `measure/pace.py`)."""
    if engine is None:
        engine = load_engine(settings, log)
    started = time.monotonic()
    warm_up(engine)
    prefill = _measure_prefill(engine, settings, log)
    decode = _measure_decode(engine, settings, log)
    mixed = _measure_mixed(engine, settings, log) if settings.mixed_batch_sizes else None
    transfer = _measure_transfer(engine, settings, log)
    tier_loads = measure_tier_loads(engine, settings.repeats, log)
    neighbor = None
    if settings.neighbor_core is not None:
        neighbor = measure_neighbor(engine, settings, log)
    spec = engine.kv_spec
    log(f"measured in {time.monotonic() - started:.0f} s")
    return Profile(
        description=_describe(engine, settings),
        prefill=prefill,
        decode=decode,
        kv_transfer=transfer,
        block_size=spec.block_size,
        num_kv_blocks=spec.num_position_blocks,
        # As pages travel: a position's block in each layer group.
        kv_bytes_per_token=spec.page_bytes_per_block * spec.groups // spec.block_size,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        max_num_seqs=engine.config.scheduler.max_num_seqs,
        mixed=mixed,
        engine=_engine_setup(engine, settings),
        tier_loads=tier_loads,
        neighbor=neighbor,
    )


def _engine_setup(engine, settings: ProfileSettings) -> EngineSetup:
    config = engine.config
    return EngineSetup(
        quantization=config.model.quantization,
        kv_cache_dtype=config.cache.kv_cache_dtype,
        tensor_parallel_size=config.parallel.tensor_parallel_size,
        pipeline_parallel_size=config.parallel.pipeline_parallel_size,
        num_threads=settings.num_threads,
    )


def _describe(engine, settings: ProfileSettings) -> str:
    return (
        f"{engine.model_name}, {engine.config.model.dtype}, torch {torch.__version__}, "
        f"{settings.num_threads} thread(s), {platform.machine()} {platform.processor() or ''}"
        f"({_cpu_name()}), KV over {settings.kv_transport}"
    ).strip()


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown CPU"


def _measure_prefill(engine, settings: ProfileSettings, log: Log) -> list[PrefillSample]:
    samples = []
    for i, num_tokens in enumerate(settings.prefill_lens, 1):
        times = []
        for _ in range(settings.repeats):
            add_request(engine, fresh_tokens(num_tokens), 1)
            times.append(timed_step(engine))
            drain(engine)
        seconds = statistics.median(times)
        samples.append(PrefillSample(num_tokens, seconds))
        log(f"prefill {i}/{len(settings.prefill_lens)}: {num_tokens} tokens {seconds * 1e3:.1f} ms")
    return samples


def _measure_decode(engine, settings: ProfileSettings, log: Log) -> DecodeGrid:
    block = settings.block_size
    rows: list[list[float]] = [[] for _ in settings.batch_sizes]
    num_points = len(settings.batch_sizes) * len(settings.context_lens)
    done = 0
    for context_len in settings.context_lens:
        prefix_len = max(block, context_len // block * block - block)
        prefix = fresh_tokens(prefix_len)
        add_request(engine, prefix, 1)  # leaves the prefix's full blocks in the cache
        drain(engine)
        for row, batch_size in zip(rows, settings.batch_sizes):
            row.append(
                _decode_point(engine, prefix, context_len - prefix_len, batch_size, settings)
            )
            done += 1
            log(
                f"decode {done}/{num_points}: batch {batch_size}, context {context_len}: "
                f"{row[-1] * 1e3:.1f} ms/step"
            )
    return DecodeGrid(list(settings.batch_sizes), list(settings.context_lens), rows)


def _decode_point(
    engine, prefix: list[int], own_len: int, batch_size: int, settings: ProfileSettings
) -> float:
    _start_decodes(engine, prefix, own_len, batch_size, settings.repeats + 1)
    times = [timed_step(engine) for _ in range(settings.repeats)]
    drain(engine)
    return statistics.median(times)


def _start_decodes(
    engine, prefix: list[int], own_len: int, batch_size: int, num_steps: int
) -> None:
    """`batch_size` requests that each decode `num_steps` more tokens after this returns, at a
    context of len(prefix) + own_len (the prefix comes from the cache)."""
    for _ in range(batch_size):
        add_request(engine, prefix + fresh_tokens(own_len), num_steps + 2)
    engine.step()  # the prompts' own tokens
    while any(r.num_tokens - r.num_computed_tokens > 1 for r in engine.scheduler.running):
        engine.step()  # budget ran out: finish the prefills first
    engine.step()  # the first decode step is not timed


# ---- mixed steps ----------------------------------------------------------------------------


def _measure_mixed(engine, settings: ProfileSettings, log: Log) -> MixedGrid:
    """Each point: B decodes at the shortest measured context, then `repeats` times a fresh
    C-token prompt (one output token) added and the step that computes it beside them timed."""
    block = settings.block_size
    context_len = settings.context_lens[0]
    prefix_len = max(block, context_len // block * block - block)
    prefix = fresh_tokens(prefix_len)
    add_request(engine, prefix, 1)
    drain(engine)
    rows = []
    for batch_size in settings.mixed_batch_sizes:
        num_steps = settings.repeats * len(settings.mixed_chunk_lens) + 1
        _start_decodes(engine, prefix, context_len - prefix_len, batch_size, num_steps)
        row = []
        for chunk_len in settings.mixed_chunk_lens:
            times = []
            for _ in range(settings.repeats):
                add_request(engine, fresh_tokens(chunk_len), 1)
                times.append(timed_step(engine))
            row.append(statistics.median(times))
            log(
                f"mixed: {batch_size} decodes + {chunk_len} prompt tokens: "
                f"{row[-1] * 1e3:.1f} ms/step"
            )
        rows.append(row)
        drain(engine)
    return MixedGrid(
        list(settings.mixed_batch_sizes), list(settings.mixed_chunk_lens), context_len, rows
    )


# ---- KV transfer ----------------------------------------------------------------------------


def _measure_transfer(engine, settings: ProfileSettings, log: Log) -> KVTransferModel:
    kv_cache = engine.runner.kv_cache
    sizes = [min(n, engine.kv_spec.num_blocks // 2) for n in settings.transfer_blocks]
    times = {}
    for num_blocks in sizes:
        block_ids = list(range(num_blocks))

        def pack(block_ids=block_ids):
            return pack_pages(kv_cache, block_ids)

        def unpack(pages, block_ids=block_ids):
            unpack_pages(pages, kv_cache, block_ids)

        seconds = asyncio.run(_timed_transfers(settings, pack, unpack, settings.repeats + 2))
        times[num_blocks] = seconds
        transport = settings.kv_transport
        log(f"KV transfer of {num_blocks} block(s) over {transport}: {seconds * 1e3:.1f} ms")
    return _fit_transfer(times, engine.kv_spec.page_bytes_per_block)


async def _timed_transfers(settings: ProfileSettings, pack, unpack, count: int) -> float:
    transport = create_kv_transport(
        KVTransferConfig(backend=settings.kv_transport, offer_wait_s=TIMEOUT_S)
    )
    receiver = await transport.start_receiver()
    sender = transport.create_sender()
    times = []
    try:
        for i in range(count):
            start = time.perf_counter()
            pages = pack()
            destination = pages.new_empty(pages.shape)
            descriptor = KVTransferDescriptor.for_buffer(
                f"t{i}", list(range(pages.shape[0])), pages, None
            )
            received = asyncio.create_task(receiver.receive(f"t{i}", destination, TIMEOUT_S))
            await sender.send(receiver.address, descriptor, pages, TIMEOUT_S)
            await received
            unpack(destination)
            times.append(time.perf_counter() - start)
    finally:
        await sender.close()
        await receiver.close()
    return statistics.median(times[1:])  # the first pays the connection set-up


def _fit_transfer(times: dict[int, float], bytes_per_block: int) -> KVTransferModel:
    (small, small_s), (large, large_s) = sorted(times.items())
    if large == small:
        return KVTransferModel(large * bytes_per_block / large_s, 0.0)
    per_block_s = max((large_s - small_s) / (large - small), 1e-9)
    latency_s = max(small_s - small * per_block_s, 0.0)
    return KVTransferModel(bytes_per_block / per_block_s, latency_s)
