"""Launch configurations of the Triton kernels (tile sizes, warps, pipeline stages), measured
per GPU model rather than guessed.

A kernel asks `launch_config(kernel, key, device, default)` for its meta-parameters. On CUDA
the answer comes from the table of the device's model: `kernels/configs/<model>.json`, written
by `python -m benchmarks.triton_tune` on that GPU (every candidate checked against the
PyTorch reference and timed; the fastest kept), or from the file `SPLITSERVE_TRITON_CONFIGS`
names. What the table does not hold, and every CPU run (Triton's interpreter), gets `default`.

A static table rather than `triton.autotune`: autotuning times its first call's inputs, and
the engine's first calls are warm-ups and CUDA-graph captures of padding rows whose timings
say nothing about real contexts. The tuner times the shapes serving runs (batch 64 over
4096-token contexts, the decode matmuls of batch 1, 16 and 256 rows) instead.

    {"device": "NVIDIA H100 80GB HBM3", "kernels": {"decode_attention": {
        "bfloat16/d64/g3/b16/kv": {"TILE_N": 128, "num_warps": 4, "num_stages": 3}}}}
"""

from __future__ import annotations

import functools
import json
import os
import re
from pathlib import Path
from typing import Any

import torch

CONFIG_DIR = Path(__file__).resolve().parent / "configs"
CONFIG_FILE_VARIABLE = "SPLITSERVE_TRITON_CONFIGS"


def lookup_environment() -> tuple[str | None, str | None]:
    """What a lookup depends on besides its arguments (TRITON_INTERPRET, the table file named
    by CONFIG_FILE_VARIABLE): the kernels' per-shape caches of their launches key on it."""
    return os.environ.get("TRITON_INTERPRET"), os.environ.get(CONFIG_FILE_VARIABLE)


def launch_config(
    kernel: str, key: str, device: torch.device, default: dict[str, Any]
) -> dict[str, Any]:
    """`default` with what the device's table holds for (kernel, key) laid over it. The
    kernels cache the answer per shape (`lookup_environment`), as every call would otherwise
    build the key and look it up again on the step's hot path."""
    if device.type != "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return default
    index = device.index if device.index is not None else torch.cuda.current_device()
    table = device_table(_device_name(index), os.environ.get(CONFIG_FILE_VARIABLE))
    return {**default, **table.get(kernel, {}).get(key, {})}


@functools.cache
def _device_name(index: int) -> str:
    # Once per device: every kernel call asks, and a decode step makes hundreds of them.
    return torch.cuda.get_device_name(index)


def table_path(device_name: str) -> Path:
    """Where the shipped table of a GPU model lives: its name in lower case, one `_` for each
    run of other characters ("NVIDIA H100 80GB HBM3" -> nvidia_h100_80gb_hbm3.json)."""
    stem = re.sub(r"[^a-z0-9]+", "_", device_name.lower()).strip("_")
    return CONFIG_DIR / f"{stem}.json"


@functools.cache
def device_table(device_name: str, override: str | None) -> dict[str, dict[str, dict]]:
    """kernel -> key -> meta-parameters for `device_name`; `override` (a file) wins over the
    shipped table. Empty where neither exists."""
    path = Path(override) if override else table_path(device_name)
    if not path.is_file():
        return {}
    return json.loads(path.read_text())["kernels"]


def write_table(path: Path, device_name: str, kernels: dict[str, dict[str, dict]]) -> None:
    """The tuner's output, in the format `device_table` reads."""
    path.write_text(json.dumps({"device": device_name, "kernels": kernels}, indent=1) + "\n")
