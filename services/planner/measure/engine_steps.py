"""The measuring engine and the steps a profile times on it, shared by the profiler and the
neighbor engine beside it (`neighbor.py`), which runs in a process of its own.

Requests get fresh token ids (nothing is cached unless a caller means it to be), greedy
sampling and `ignore_eos`, so a request runs exactly the steps its `max_tokens` asks for.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable

from splitserve.engine.sampling_params import SamplingParams
from splitserve.planner.measure.settings import ProfileSettings

VOCAB_RANGE = (1000, 40000)  # ordinary word pieces of SmolLM2's vocabulary

Log = Callable[[str], None]

_ids = iter(range(10**9))
_rng = random.Random(0)


def load_engine(settings: ProfileSettings, log: Log):
    # lazy: torch loads only once an engine is measured; the neighbor process pins its CPU
    # before it gets here
    from splitserve.engine.config import EngineConfig
    from splitserve.engine.core import EngineCore
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


def fresh_tokens(num_tokens: int) -> list[int]:
    return [_rng.randrange(*VOCAB_RANGE) for _ in range(num_tokens)]


def add_request(engine, prompt: list[int], max_tokens: int) -> str:
    request_id = f"profile-{next(_ids)}"
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    engine.add_request(request_id, prompt, params)
    return request_id


def timed_step(engine) -> float:
    start = time.perf_counter()
    engine.step()
    return time.perf_counter() - start


def drain(engine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def warm_up(engine) -> None:
    """First calls pay one-off costs (allocation, kernel selection)."""
    for num_tokens in (64, 256):
        add_request(engine, fresh_tokens(num_tokens), 4)
        drain(engine)
