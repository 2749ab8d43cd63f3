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
- with `--neighbor-core`: steps beside a second engine on that CPU (`profiler_neighbor.py`).
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from splitserve.planner.profile import (
    DecodeGrid,
    EngineSetup,
    KVTransferModel,
    MixedGrid,
    PrefillSample,
    Profile,
)
from splitserve.planner.profiler_tiers import measure_tier_loads

VOCAB_RANGE = (1000, 40000)  # ordinary word pieces of SmolLM2's vocabulary
TIMEOUT_S = 60.0


@dataclass(frozen=True)
class ProfileSettings:
    prefill_lens: tuple[int, ...] = (16, 64, 128, 256, 512, 1024)
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    context_lens: tuple[int, ...] = (64, 256, 1024)
    mixed_batch_sizes: tuple[int, ...] = (1, 4, 16)  # () = no mixed steps measured
    mixed_chunk_lens: tuple[int, ...] = (32, 128, 384)
    repeats: int = 3  # timed steps per point (the median is kept)
    num_threads: int = 1
    kv_cache_bytes: int = 256 * 2**20  # as `splitserve up` gives each engine process
    max_num_batched_tokens: int = 512  # the pods' default budget, recorded for the simulator
    block_size: int = 16
    model: str | None = None
    kv_transport: str = "tcp"
    transfer_blocks: tuple[int, int] = (1, 32)
    quantization: str = "none"
    kv_cache_dtype: str = "auto"
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # Another CPU for a second engine to run beside this one (`profiler_neighbor.py`); None:
    # the profile has no neighbor slowdowns.
    neighbor_core: int | None = None

    def __post_init__(self) -> None:
        if self.repeats < 1 or self.num_threads < 1:
            raise ValueError("--repeats and --num-threads must be >= 1")
        core = self.neighbor_core
        if core is not None and not 0 <= core < (os.cpu_count() or 1):
            raise ValueError(f"--neighbor-core {core} is not a CPU of this machine")
        for name in ("prefill_lens", "batch_sizes", "context_lens", "mixed_chunk_lens"):
            values = getattr(self, name)
            if not values or min(values) < 1 or list(values) != sorted(set(values)):
                raise ValueError(f"--{name.replace('_', '-')} must be increasing and >= 1")
        values = self.mixed_batch_sizes
        if values and (min(values) < 1 or list(values) != sorted(set(values))):
            raise ValueError(f"--{name.replace('_', '-')} must be increasing and >= 1")


# `profile --quick` (and `validate --fresh-profile`): about a third of the default's time.
QUICK_GRID = {
    "prefill_lens": (16, 64, 128, 256, 512),
    "batch_sizes": (1, 2, 4, 8, 16),
    "context_lens": (64, 512),
    "mixed_batch_sizes": (1, 4, 16),
    "mixed_chunk_lens": (32, 128, 384),
}

Log = Callable[[str], None]


def log_to_stderr(message: str) -> None:
    print(f"[plan profile {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def measure_profile(settings: ProfileSettings, log: Log = log_to_stderr) -> Profile:
    engine = _load_engine(settings, log)
    started = time.monotonic()
    _warm_up(engine)
    prefill = _measure_prefill(engine, settings, log)
    decode = _measure_decode(engine, settings, log)
    mixed = _measure_mixed(engine, settings, log) if settings.mixed_batch_sizes else None
    transfer = _measure_transfer(engine, settings, log)
    tier_loads = measure_tier_loads(engine, settings.repeats, log)
    neighbor = None
    if settings.neighbor_core is not None:
        from splitserve.planner.profiler_neighbor import measure_neighbor

        neighbor = measure_neighbor(engine, settings, log)
    spec = engine.kv_spec
    log(f"measured in {time.monotonic() - started:.0f} s")
    return Profile(
        description=_describe(engine, settings),
        prefill=prefill,
        decode=decode,
        kv_transfer=transfer,
        block_size=spec.block_size,
        num_kv_blocks=spec.num_blocks,
        kv_bytes_per_token=spec.total_bytes // spec.num_tokens,
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


def _load_engine(settings: ProfileSettings, log: Log):
    from splitserve.engine.config import EngineConfig
    from splitserve.engine.engine import EngineCore
    from splitserve.engine.progress import ConsoleProgress

    # The measuring engine's budget fits the longest measured prompt in one step.
    # (and a mixed step's decodes and prompt together).
    mixed_tokens = max(settings.mixed_batch_sizes, default=0) + max(settings.mixed_chunk_lens)
    budget = max(settings.max_num_batched_tokens, *settings.prefill_lens, mixed_tokens)
    longest = max(settings.prefill_lens[-1], settings.context_lens[-1] + 2 * settings.block_size)
    config = EngineConfig.from_options(
        settings.model,
        num_threads=settings.num_threads,
        kv_cache_bytes=settings.kv_cache_bytes,
        block_size=settings.block_size,
        max_num_batched_tokens=budget,
        max_num_seqs=max(128, *settings.batch_sizes),
        max_model_len=max(2048, longest + 64),
        quantization=settings.quantization,
        kv_cache_dtype=settings.kv_cache_dtype,
        tensor_parallel_size=settings.tensor_parallel_size,
        pipeline_parallel_size=settings.pipeline_parallel_size,
    )
    log(f"loading the model ({settings.num_threads} torch thread(s))")
    return EngineCore(config, progress=ConsoleProgress("loading model"))


def _describe(engine, settings: ProfileSettings) -> str:
    import platform

    import torch

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


# ---- engine steps ---------------------------------------------------------------------------

_ids = iter(range(10**9))
_rng = random.Random(0)


def _fresh_tokens(num_tokens: int) -> list[int]:
    return [_rng.randrange(*VOCAB_RANGE) for _ in range(num_tokens)]


def _add(engine, prompt: list[int], max_tokens: int) -> str:
    from splitserve.engine.sampling_params import SamplingParams

    request_id = f"profile-{next(_ids)}"
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    engine.add_request(request_id, prompt, params)
    return request_id


def _timed_step(engine) -> float:
    start = time.perf_counter()
    engine.step()
    return time.perf_counter() - start


def _drain(engine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def _warm_up(engine) -> None:
    """First calls pay one-off costs (allocation, kernel selection)."""
    for num_tokens in (64, 256):
        _add(engine, _fresh_tokens(num_tokens), 4)
        _drain(engine)


def _measure_prefill(engine, settings: ProfileSettings, log: Log) -> list[PrefillSample]:
    samples = []
    for i, num_tokens in enumerate(settings.prefill_lens, 1):
        times = []
        for _ in range(settings.repeats):
            _add(engine, _fresh_tokens(num_tokens), 1)
            times.append(_timed_step(engine))
            _drain(engine)
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
        prefix = _fresh_tokens(prefix_len)
        _add(engine, prefix, 1)  # leaves the prefix's full blocks in the cache
        _drain(engine)
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
    times = [_timed_step(engine) for _ in range(settings.repeats)]
    _drain(engine)
    return statistics.median(times)


def _start_decodes(
    engine, prefix: list[int], own_len: int, batch_size: int, num_steps: int
) -> None:
    """`batch_size` requests that each decode `num_steps` more tokens after this returns, at a
    context of len(prefix) + own_len (the prefix comes from the cache)."""
    for _ in range(batch_size):
        _add(engine, prefix + _fresh_tokens(own_len), num_steps + 2)
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
    prefix = _fresh_tokens(prefix_len)
    _add(engine, prefix, 1)
    _drain(engine)
    rows = []
    for batch_size in settings.mixed_batch_sizes:
        num_steps = settings.repeats * len(settings.mixed_chunk_lens) + 1
        _start_decodes(engine, prefix, context_len - prefix_len, batch_size, num_steps)
        row = []
        for chunk_len in settings.mixed_chunk_lens:
            times = []
            for _ in range(settings.repeats):
                _add(engine, _fresh_tokens(chunk_len), 1)
                times.append(_timed_step(engine))
            row.append(statistics.median(times))
            log(
                f"mixed: {batch_size} decodes + {chunk_len} prompt tokens: "
                f"{row[-1] * 1e3:.1f} ms/step"
            )
        rows.append(row)
        _drain(engine)
    return MixedGrid(
        list(settings.mixed_batch_sizes), list(settings.mixed_chunk_lens), context_len, rows
    )


# ---- KV transfer ----------------------------------------------------------------------------


def _measure_transfer(engine, settings: ProfileSettings, log: Log) -> KVTransferModel:
    from splitserve.engine.kv.disaggregation import pack_pages, unpack_pages

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
    return _fit_transfer(times, engine.kv_spec.total_bytes // engine.kv_spec.num_blocks)


async def _timed_transfers(settings: ProfileSettings, pack, unpack, count: int) -> float:
    from splitserve.engine.kv.transfer import (
        KVTransferConfig,
        KVTransferDescriptor,
        create_kv_transport,
    )

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
                f"t{i}", range(pages.shape[0]), pages, None
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
