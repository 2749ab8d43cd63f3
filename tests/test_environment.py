"""`splitserve env` (services/environment.py) run as a user runs it: its JSON has every key,
and its values are this machine's (the CPU flags /proc/cpuinfo lists, the kernels this process
can load, torch's version); SPLITSERVE_CPU_KERNELS=0 reports the kernels unavailable with the
reason. Pods log the same JSON at start (checked here) and export it as an info metric
(tests/test_metrics.py, on real pods)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
import torch

from splitserve.environment import format_report, info_labels, log_environment, pod_environment
from splitserve.kernels import cpu as cpu_kernels

TOP_LEVEL_KEYS = {"versions", "cpu", "cpu_kernels", "quantization", "dtypes"}


def splitserve_env(*flags: str, **env: str) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "splitserve.cli", "env", *flags]
    result = subprocess.run(argv, capture_output=True, text=True, timeout=600, env=os.environ | env)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def cpuinfo_flags() -> set[str]:
    with open("/proc/cpuinfo", encoding="utf-8") as cpuinfo:
        for line in cpuinfo:
            key, _, value = line.partition(":")
            if key.strip() in ("flags", "Features"):
                return set(value.split())
    return set()


@pytest.fixture(scope="module")
def report() -> dict:
    return json.loads(splitserve_env("--json").stdout)


def test_json_has_every_key(report) -> None:
    assert set(report) >= TOP_LEVEL_KEYS
    assert set(report["quantization"]) == {"int8", "int4", "gguf"}
    assert set(report["dtypes"]) == {"bfloat16"}
    assert set(report["versions"]) == {"splitserve", "python", "torch", "onednn"}


def test_values_are_this_machines(report) -> None:
    versions = report["versions"]
    assert versions["torch"] == torch.__version__
    assert versions["python"] == ".".join(map(str, sys.version_info[:3]))
    assert versions["onednn"][0].isdigit(), versions["onednn"]  # this torch has oneDNN
    flags = report["cpu"]["flags"]
    assert flags and set(flags) <= cpuinfo_flags()
    expected = "loaded" if cpu_kernels.load() is not None else "unavailable"
    assert report["cpu_kernels"].split(":")[0] == expected
    for status in [*report["quantization"].values(), *report["dtypes"].values()]:
        assert isinstance(status, str) and status


@pytest.mark.skipif(cpu_kernels.load() is None, reason="no C++ compiler here")
def test_this_machine_loads_the_kernels(report) -> None:
    assert report["cpu_kernels"] == "loaded"


def test_kernels_switched_off_are_reported_unavailable_with_the_reason() -> None:
    off = json.loads(splitserve_env("--json", SPLITSERVE_CPU_KERNELS="0").stdout)
    assert off["cpu_kernels"] == "unavailable: SPLITSERVE_CPU_KERNELS=0"


def test_text_output_names_each_path(report) -> None:
    text = splitserve_env().stdout
    assert f"cpu_kernels: {report['cpu_kernels']}" in text
    assert f"  int4: {report['quantization']['int4']}" in text
    assert f"  torch: {torch.__version__}" in text


def test_pods_log_the_json_line_at_start(caplog) -> None:
    with caplog.at_level(logging.INFO, logger="splitserve.environment"):
        log_environment()
    (line,) = [r.getMessage() for r in caplog.records if r.name == "splitserve.environment"]
    prefix, _, payload = line.partition(": ")
    assert prefix == "splitserve env"
    assert json.loads(payload) == pod_environment()


def test_info_labels_flatten_the_report() -> None:
    report = {
        "versions": {"torch": "2.13.0"},
        "cpu": {"flags": ["avx2", "fma"], "kernel_isa": {"name": "avx2"}},
        "cpu_kernels": "unavailable: no g++",
    }
    assert info_labels(report) == {
        "versions_torch": "2.13.0",
        "cpu_flags": "avx2,fma",
        "cpu_kernel_isa_name": "avx2",
        "cpu_kernels": "unavailable: no g++",
    }
    assert format_report(report).splitlines()[:3] == ["versions:", "  torch: 2.13.0", "cpu:"]
