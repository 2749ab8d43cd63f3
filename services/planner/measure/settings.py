"""What `splitserve plan profile` measures, and with which engine (`ProfileSettings`)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TypedDict


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
    # Another CPU for a second engine to run beside this one (`neighbor.py`); None:
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
            raise ValueError("--mixed-batch-sizes must be increasing and >= 1")


# `profile --quick` (and `validate --fresh-profile`): about a third of the default's time.
class Grid(TypedDict, total=False):
    """The measured grid's axes, as ProfileSettings' fields of the same names."""

    prefill_lens: tuple[int, ...]
    batch_sizes: tuple[int, ...]
    context_lens: tuple[int, ...]
    mixed_batch_sizes: tuple[int, ...]
    mixed_chunk_lens: tuple[int, ...]


QUICK_GRID: Grid = {
    "prefill_lens": (16, 64, 128, 256, 512),
    "batch_sizes": (1, 2, 4, 8, 16),
    "context_lens": (64, 512),
    "mixed_batch_sizes": (1, 4, 16),
    "mixed_chunk_lens": (32, 128, 384),
}
