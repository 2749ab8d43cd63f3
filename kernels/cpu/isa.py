"""What this CPU can run, read once, and which variant of our C++ kernels runs here.

Everything that chooses a CPU path by instruction set asks this module; nothing else reads
/proc/cpuinfo. The C++ module (`load()` in `__init__.py`) is compiled for a baseline, not for
the build machine: x86-64-v3 (AVX2, FMA, F16C) on x86-64, plain ARMv8-A elsewhere, so one build
runs on every CPU of its class. Its int4 product has variants chosen at run time:

    avx512_vnni  AVX512F/BW/VL + AVX512-VNNI: 16 outputs per register, dpbusd dot products
    avx2         AVX2 + FMA + F16C: 8 outputs per register, maddubs / madd dot products
    generic      portable C++ (ARM, and a reference the others are tested against)

The best variant the CPU has runs, unless SPLITSERVE_CPU_ISA names a lower one (tests force
avx2 on an AVX-512 machine: tests/test_isa_dispatch.py); naming one the CPU lacks is refused at
load, never run. torch keeps its own dispatch (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA), which
this module only reports.
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass

ISA_ENV = "SPLITSERVE_CPU_ISA"
# Best first. Each variant's needs, in /proc/cpuinfo's flag names.
KERNEL_ISAS: dict[str, tuple[str, ...]] = {
    "avx512_vnni": ("avx512f", "avx512bw", "avx512vl", "avx512_vnni"),
    "avx2": ("avx2", "fma", "f16c"),
    "generic": (),
}
# What the C++ module's baseline build needs on x86-64 (-march=x86-64-v3).
X86_BASELINE = ("avx2", "fma", "f16c", "bmi2")
# Flags worth reporting (the rest of /proc/cpuinfo's list says nothing about our paths).
_REPORTED_FLAGS = (
    "sse4_2", "avx", "avx2", "fma", "f16c", "avx_vnni", "avx512f", "avx512bw", "avx512vl",
    "avx512dq", "avx512_vnni", "avx512vbmi", "avx512_bf16", "avx512_fp16", "amx_tile",
    "amx_int8", "amx_bf16", "asimd", "asimddp", "i8mm", "bf16", "sve",
)  # fmt: skip


@dataclass(frozen=True)
class CpuFeatures:
    """The processor as the kernels see it: its architecture, model and instruction flags."""

    machine: str  # platform.machine(): x86_64, aarch64, ...
    model: str  # /proc/cpuinfo's model name ("" where it has none)
    flags: frozenset[str]  # x86 "flags" or ARM "Features"

    @property
    def is_x86(self) -> bool:
        return self.machine in ("x86_64", "AMD64", "i686")

    def has(self, *flags: str) -> bool:
        return all(flag in self.flags for flag in flags)

    def missing(self, flags: tuple[str, ...]) -> list[str]:
        return [flag for flag in flags if flag not in self.flags]


@functools.cache
def cpu_features() -> CpuFeatures:
    """This machine's CPU, read once from /proc/cpuinfo (Linux); elsewhere an empty flag set,
    which keeps every kernel family on its portable path."""
    model, flags = "", frozenset[str]()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
            model, flags = _parse_cpuinfo(cpuinfo.read())
    except OSError:
        pass
    return CpuFeatures(platform.machine(), model, flags)


def _parse_cpuinfo(text: str) -> tuple[str, frozenset[str]]:
    """(model name, flags) of the first processor listed."""
    model, flags = "", frozenset[str]()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key in ("model name", "Model") and not model:
            model = value.strip()
        elif key in ("flags", "Features") and not flags:
            flags = frozenset(value.split())
    return model, flags


def baseline_problem(features: CpuFeatures | None = None) -> str | None:
    """None when the C++ module's baseline build runs on this CPU; otherwise what it lacks."""
    features = features or cpu_features()
    if not features.is_x86:
        return None
    missing = features.missing(X86_BASELINE)
    if missing:
        return f"this CPU lacks {', '.join(missing)} (the kernels are built for x86-64-v3)"
    return None


@dataclass(frozen=True)
class KernelIsa:
    """Which variant our C++ kernels run, and why that one."""

    name: str  # a KERNEL_ISAS key
    reason: str


def kernel_isa(features: CpuFeatures | None = None) -> KernelIsa:
    """The variant for this CPU: the best it has, or SPLITSERVE_CPU_ISA's when set. Raises
    ValueError when the variable names an unknown variant or one this CPU cannot run."""
    features = features or cpu_features()
    available = [name for name, needs in KERNEL_ISAS.items() if _runs(name, needs, features)]
    forced = os.environ.get(ISA_ENV, "").strip().lower()
    if not forced:
        return KernelIsa(available[0], "the best this CPU has")
    if forced not in KERNEL_ISAS:
        raise ValueError(f"{ISA_ENV}={forced!r}: expected one of {', '.join(KERNEL_ISAS)}")
    if forced not in available:
        missing = ", ".join(features.missing(KERNEL_ISAS[forced])) or "an x86-64 CPU"
        raise ValueError(f"{ISA_ENV}={forced}: this CPU lacks {missing}")
    return KernelIsa(forced, f"forced by {ISA_ENV}")


def _runs(name: str, needs: tuple[str, ...], features: CpuFeatures) -> bool:
    if name == "generic":
        return True
    return features.is_x86 and features.has(*needs)


def torch_dispatch() -> dict[str, str]:
    """What torch itself dispatches to (its own choice, overridable by its variables)."""
    import torch  # lazy: reading the CPU's features needs no torch; only this report does

    return {
        "aten_capability": torch.backends.cpu.get_cpu_capability(),
        "onednn_max_isa": os.environ.get("ONEDNN_MAX_CPU_ISA", "default (the CPU's best)"),
    }


def features_report() -> dict[str, object]:
    """The CPU's part of `splitserve env`: a plain dict."""
    features = cpu_features()
    try:
        chosen = kernel_isa(features)
        isa = {"name": chosen.name, "reason": chosen.reason}
    except ValueError as error:
        isa = {"name": "none", "reason": str(error)}
    return {
        "machine": features.machine,
        "model": features.model,
        "flags": [flag for flag in _REPORTED_FLAGS if flag in features.flags],
        "kernel_isa": isa,
        **torch_dispatch(),
    }
