"""What a benchmark's figures carry about the machine they ran on, and the switch that runs
every process of a benchmark on the AVX2 paths of an AVX-512 machine."""

from __future__ import annotations

import json
import os

# torch, oneDNN and our kernels take their AVX2 paths; vLLM's own C++ kernels pick their ISA
# when built and are not forced.
AVX2_ENV = {
    "ATEN_CPU_CAPABILITY": "avx2",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "SPLITSERVE_CPU_ISA": "avx2",
}


def machine_cpu() -> dict:
    """`splitserve env`'s CPU section: model, flags, the kernels' ISA and why."""
    from splitserve.environment import environment_report  # lazy: torch, after the forcing

    return environment_report()["cpu"]


def machine_line() -> str:
    """`splitserve env`'s CPU line, for a report's first line."""
    return "splitserve env cpu: " + json.dumps(machine_cpu())


def machine_title() -> str:
    """The same machine in a few words, short enough for a plot's title."""
    cpu = machine_cpu()
    isa = cpu.get("kernel_isa", {}).get("name", "?")
    return f"{cpu.get('model', '?')}, {os.cpu_count()} CPUs, kernels {isa}"
