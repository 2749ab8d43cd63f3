"""Which CPU path each kernel family takes (splitserve.kernels.cpu.isa, the report in
shared/model/cpu_paths.py): decided from the CPU's features, forced lower by
SPLITSERVE_CPU_ISA, never higher than the CPU allows."""

from __future__ import annotations

import json

import pytest

from splitserve.engine.model.cpu_paths import cpu_report
from splitserve.engine.model.quantized_linear import plain_input_activation_passes
from splitserve.kernels.cpu import isa


def _cpu(machine: str, flags: str) -> isa.CpuFeatures:
    return isa.CpuFeatures(machine, "", frozenset(flags.split()))


_SAPPHIRE_RAPIDS = _cpu("x86_64", "avx2 fma f16c bmi2 avx512f avx512bw avx512vl avx512_vnni")
_ZEN2 = _cpu("x86_64", "avx2 fma f16c bmi2")
_OLD_X86 = _cpu("x86_64", "sse4_1 sse4_2")
_GRAVITON = _cpu("aarch64", "fp asimd asimddp i8mm")


def test_cpuinfo_gives_the_first_processors_model_and_flags():
    text = (
        "processor\t: 0\nmodel name\t: AMD EPYC 7B12\nflags\t\t: fpu avx2 fma\n\n"
        "processor\t: 1\nmodel name\t: other\nflags\t\t: fpu\n"
    )
    assert isa._parse_cpuinfo(text) == ("AMD EPYC 7B12", frozenset({"fpu", "avx2", "fma"}))
    arm = "processor\t: 0\nFeatures\t: fp asimd asimddp\nCPU part\t: 0xd0c\n"
    assert isa._parse_cpuinfo(arm) == ("", frozenset({"fp", "asimd", "asimddp"}))


@pytest.mark.parametrize(
    ("features", "best"),
    [(_SAPPHIRE_RAPIDS, "avx512_vnni"), (_ZEN2, "avx2"), (_OLD_X86, "generic"),
     (_GRAVITON, "generic")],
)  # fmt: skip
def test_each_cpu_gets_the_best_variant_it_has(monkeypatch, features, best):
    monkeypatch.delenv(isa.ISA_ENV, raising=False)
    assert isa.kernel_isa(features).name == best


def test_the_switch_forces_a_lower_variant_and_refuses_a_higher_one(monkeypatch):
    monkeypatch.setenv(isa.ISA_ENV, "avx2")
    assert isa.kernel_isa(_SAPPHIRE_RAPIDS) == isa.KernelIsa("avx2", "forced by SPLITSERVE_CPU_ISA")
    monkeypatch.setenv(isa.ISA_ENV, "avx512_vnni")
    with pytest.raises(ValueError, match="lacks avx512f, avx512bw, avx512vl, avx512_vnni"):
        isa.kernel_isa(_ZEN2)
    monkeypatch.setenv(isa.ISA_ENV, "sse")
    with pytest.raises(ValueError, match="expected one of avx512_vnni, avx2, generic"):
        isa.kernel_isa(_ZEN2)


def test_the_baseline_build_needs_avx2_on_x86_only():
    assert isa.baseline_problem(_ZEN2) is None
    assert isa.baseline_problem(_GRAVITON) is None
    assert "lacks avx2, fma, f16c, bmi2" in isa.baseline_problem(_OLD_X86)


def test_the_report_is_plain_json_with_every_family():
    report = cpu_report()
    assert json.loads(json.dumps(report)) == report
    assert set(report["quantization"]) == {"int8", "int4", "gguf"}
    assert report["cpu_kernels"] == "loaded" or report["cpu_kernels"].startswith("unavailable: ")
    assert report["cpu"]["kernel_isa"]["name"] in isa.KERNEL_ISAS
    assert report["dtypes"]["bfloat16"] == "ok"


def test_plain_inputs_take_two_activation_passes_only_with_vnni(monkeypatch):
    monkeypatch.delenv(isa.ISA_ENV, raising=False)
    assert plain_input_activation_passes(_SAPPHIRE_RAPIDS) == 2
    assert plain_input_activation_passes(_ZEN2) == 1
    monkeypatch.setenv(isa.ISA_ENV, "avx2")  # forced down: the AVX2 variant's one pass
    assert plain_input_activation_passes(_SAPPHIRE_RAPIDS) == 1
