"""`splitserve env` (as `vllm collect-env`): the versions and CPU paths this machine runs.

    {"versions": {"splitserve", "python", "torch", "onednn"},
     "cpu": {machine, model, flags, kernel_isa, torch's own dispatch},
     "cpu_kernels": "loaded" | "unavailable: <why>",
     "quantization": {"int8": "ok" | "<why not>", "int4": ..., "gguf": ...},
     "dtypes": {"bfloat16": ...}, "paths": {kernel family: the path it takes}}

Everything but the versions is the engine's own report (splitserve.engine.model.cpu_paths),
made by the same start-up checks a model load makes, so it says what a model loaded here runs.
The prefill and decode pods log it as one JSON line at start and export it as the info metric
`splitserve:environment_info` (its labels: this dict flattened, `info_labels`).
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import logging
import platform
import re

logger = logging.getLogger(__name__)


def environment_report() -> dict[str, object]:
    """The dict above (plain values: JSON-ready). Runs the engine's CPU checks: a few small
    products, and the C++ kernels' build the first time on a machine."""
    from splitserve.engine.model.cpu_paths import cpu_report  # lazy: torch

    return {"versions": versions(), **cpu_report()}


@functools.cache
def pod_environment() -> dict[str, object]:
    """`environment_report()` made once per process: what a pod logs and exports agree."""
    return environment_report()


def log_environment() -> None:
    """The pod's start-up line: `splitserve env: {...}`, the JSON of `splitserve env --json`."""
    logger.info("splitserve env: %s", json.dumps(pod_environment(), separators=(",", ":")))


def versions() -> dict[str, str]:
    import torch  # lazy: torch, as environment_report's import

    return {
        "splitserve": _installed_version("splitserve"),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "onednn": onednn_version(),
    }


def onednn_version() -> str:
    """oneDNN's version as torch's build configuration names it ("3.12.0"); "none" in a torch
    built without it."""
    import torch  # lazy: torch, as environment_report's import

    if not torch.backends.mkldnn.is_available():
        return "none"
    match = re.search(r"(?:MKL-DNN|oneDNN) v(\d[\w.]*)", torch.__config__.show())
    return match.group(1) if match else "unknown"


def _installed_version(distribution: str) -> str:
    try:
        return importlib.metadata.version(distribution)
    except importlib.metadata.PackageNotFoundError:  # run from a checkout, not installed
        return "not installed"


def info_labels(report: dict[str, object]) -> dict[str, str]:
    """The report as Prometheus label names and values: nested keys joined by "_"
    (`quantization_int4`, `cpu_kernel_isa_name`), lists joined by ","."""
    labels: dict[str, str] = {}
    for key, value in report.items():
        name = re.sub(r"\W", "_", str(key))
        if isinstance(value, dict):
            labels |= {f"{name}_{k}": v for k, v in info_labels(value).items()}
        elif isinstance(value, list | tuple):
            labels[name] = ",".join(str(item) for item in value)
        else:
            labels[name] = str(value)
    return labels


def format_report(report: dict[str, object]) -> str:
    """The report for people: a line per value, nested dicts indented under their key."""
    return "\n".join(_lines(report, indent=""))


def _lines(report: dict[str, object], indent: str) -> list[str]:
    lines = []
    for key, value in report.items():
        if isinstance(value, dict):
            lines.append(f"{indent}{key}:")
            lines += _lines(value, indent + "  ")
        elif isinstance(value, list | tuple):
            lines.append(f"{indent}{key}: {' '.join(str(item) for item in value)}")
        else:
            lines.append(f"{indent}{key}: {value}")
    return lines
