"""What `pip install` of the wheel gives a user: the C++ CPU kernels, built on first use from the
sources the wheel ships, and loaded without a compiler afterwards (kernels/cpu/prebuilt.py).

The wheel is built from what the image copies (`pip wheel --no-deps --no-build-isolation`),
installed into a virtual environment with no system site-packages (test_packaging's machinery:
the dependencies cached under build/wheel-venv-<key>, the project reinstalled each run), beside
Hugging Face's `kernels` package, whose top-level name ours once took (issue 32). There, with a
fresh TORCH_EXTENSIONS_DIR, `splitserve env --json` must report `cpu_kernels: loaded` (a build
from site-packages, minutes on 2 cores: these tests are `slow`), a second process must load
that build without a compiler and without writing to it, and a machine with no compiler must
be told so in plain words. The tests of what names the missing tool run here in the suite.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from splitserve.kernels.cpu import prebuilt
from tests.test_packaging import (
    REPO,
    _copy_image_sources,
    _pip,
    _run,
    _torch_constraint,
    _venv_with_dependencies,
)

HF_KERNELS = "kernels"  # Hugging Face's package on PyPI: its import name is `kernels` too
NO_COMPILER = "no-such-c++-compiler"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    source = _copy_image_sources(tmp_path_factory.mktemp("image"))
    dist = tmp_path_factory.mktemp("dist")
    argv = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"]
    result = _run([*argv, "-w", str(dist), str(source)], source, 600)
    assert result.returncode == 0, result.stderr[-4000:]
    (built,) = dist.glob("splitserve-*.whl")
    return built


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    """The wheel installed in a clean environment with its dependencies, and HF's kernels
    beside it where pip can get them."""
    scratch = tmp_path_factory.mktemp("pip")
    source = _copy_image_sources(tmp_path_factory.mktemp("image-deps"))
    venv = _venv_with_dependencies(source, scratch, prefix="wheel-venv")
    if not (venv / "hf-kernels-tried").exists():
        constraint = _torch_constraint(scratch)
        argv = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "-c", str(constraint)]
        _run([*argv, HF_KERNELS], scratch, 900)  # no registry: the coexistence test skips
        (venv / "hf-kernels-tried").write_text("")
    _pip(venv, "--no-deps", "--force-reinstall", str(wheel), cwd=scratch)
    return venv


def _in_venv(venv: Path, argv: list[str], cwd: Path, **env: str) -> dict:
    """Runs `argv` (a program of the environment's bin/) in `cwd`, away from the checkout, and
    parses what it prints as JSON."""
    environment = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    environment |= {"PYTHONNOUSERSITE": "1", **env}
    environment.pop("VIRTUAL_ENV", None)
    program, *args = argv
    result = subprocess.run(
        [str(venv / "bin" / program), *args],
        cwd=cwd,
        env=environment,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout)


@pytest.mark.slow
def test_the_wheel_holds_one_name_and_the_kernel_sources(wheel) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    top_level = {name.split("/")[0] for name in names if ".dist-info/" not in name}
    assert top_level == {"splitserve"}, "one installed name (issue 32)"
    sources = {p.name for p in (REPO / "kernels" / "cpu").iterdir() if p.suffix in (".cpp", ".h")}
    shipped = {Path(n).name for n in names if n.startswith("splitserve/kernels/cpu/")}
    assert sources and sources <= shipped, f"not in the wheel: {sorted(sources - shipped)}"
    # The GPUs' tuned Triton launch tables (kernels/launch_configs.py) travel with it.
    tables = {p.name for p in (REPO / "kernels" / "configs").glob("*.json")}
    shipped = {Path(n).name for n in names if n.startswith("splitserve/kernels/configs/")}
    assert tables and tables <= shipped, f"not in the wheel: {sorted(tables - shipped)}"


@pytest.mark.slow
def test_hf_kernels_and_splitserve_import_side_by_side(venv, tmp_path) -> None:
    code = (
        "import importlib.util, json\n"
        f"spec = importlib.util.find_spec({HF_KERNELS!r})\n"
        "found = None\n"
        "if spec is not None:\n"
        f"    import {HF_KERNELS} as hf, splitserve.kernels.cpu as ours\n"
        "    found = [hf.__file__, ours.__file__]\n"
        "print(json.dumps(found))"
    )
    found = _in_venv(venv, ["python", "-c", code], tmp_path)
    if found is None:
        pytest.skip("pip could not get Hugging Face's kernels package here")
    hf_file, ours_file = (Path(f) for f in found)
    assert hf_file.is_relative_to(venv) and ours_file.is_relative_to(venv)
    assert "splitserve" not in hf_file.parts and "splitserve" in ours_file.parts


@pytest.mark.slow
def test_a_wheel_install_builds_and_then_loads_the_kernels(venv, tmp_path) -> None:
    cache = tmp_path / "torch_extensions"  # nothing built yet: the wheel's sources build
    report = _in_venv(
        venv, ["splitserve", "env", "--json"], tmp_path, TORCH_EXTENSIONS_DIR=str(cache)
    )
    assert report["cpu_kernels"] == "loaded", report["cpu_kernels"]
    assert report["quantization"] == {"int8": "ok", "int4": "ok", "gguf": "ok"}
    (build,) = [d for d in cache.iterdir() if (d / prebuilt.COMPLETE_MARKER).is_file()]
    before = {path: path.stat().st_mtime_ns for path in build.rglob("*")}
    # A pod: no compiler; the build is imported as it is, nothing written beside it.
    report = _in_venv(
        venv,
        ["splitserve", "env", "--json"],
        tmp_path,
        TORCH_EXTENSIONS_DIR=str(cache),
        CXX=NO_COMPILER,
    )
    assert report["cpu_kernels"] == "loaded", report["cpu_kernels"]
    assert {path: path.stat().st_mtime_ns for path in build.rglob("*")} == before


@pytest.mark.slow
def test_a_wheel_install_without_a_compiler_says_so(venv, tmp_path) -> None:
    report = _in_venv(
        venv,
        ["splitserve", "env", "--json"],
        tmp_path,
        TORCH_EXTENSIONS_DIR=str(tmp_path / "empty"),
        CXX=NO_COMPILER,
    )
    assert report["cpu_kernels"].startswith("unavailable: no C++ compiler"), report
    assert NO_COMPILER in report["cpu_kernels"]


# ---- what names the missing tool, in this environment ---------------------------------------


def test_build_problem_names_a_missing_compiler(monkeypatch) -> None:
    monkeypatch.setenv("CXX", NO_COMPILER)
    problem = prebuilt.build_problem()
    assert problem is not None and problem.startswith("no C++ compiler") and NO_COMPILER in problem


def test_build_problem_names_missing_python_headers(monkeypatch, tmp_path) -> None:
    import sysconfig

    paths = sysconfig.get_paths() | {"include": str(tmp_path)}  # a folder with no Python.h
    monkeypatch.setattr(sysconfig, "get_paths", lambda: paths)
    problem = prebuilt.build_problem()
    if shutil.which(os.environ.get("CXX", "c++")) is None:
        pytest.skip("no compiler here: that is named first")
    assert problem is not None and problem.startswith("no Python headers")
    assert str(tmp_path) in problem


def test_ninja_from_the_environment_joins_path_for_the_build(monkeypatch, tmp_path) -> None:
    """A venv's programs run without activating it: its bin/ (where pip puts ninja) is not on
    PATH, and torch runs `ninja` by name."""
    ninja = pytest.importorskip("ninja", reason="the ninja package is a dependency")
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing on it
    assert shutil.which("ninja") is None
    with prebuilt.ninja_on_path():
        assert shutil.which("ninja") == os.path.join(ninja.BIN_DIR, "ninja")
    assert os.environ["PATH"] == str(tmp_path)


def test_a_killed_builds_lock_is_cleared_and_a_fresh_one_kept(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    lock = prebuilt.build_directory("some_kernels") / "lock"
    lock.write_text("")
    assert not prebuilt.clear_stale_lock("some_kernels")  # may be a build running now
    assert lock.exists()
    old = time.time() - prebuilt.STALE_LOCK_S - 60
    os.utime(lock, (old, old))
    assert prebuilt.clear_stale_lock("some_kernels")
    assert not lock.exists()
    assert not prebuilt.clear_stale_lock("some_kernels")  # nothing left to clear


@pytest.mark.parametrize("extensions_dir", [None, "set"])
def test_the_build_directory_is_the_one_torch_builds_in(monkeypatch, tmp_path, extensions_dir):
    """prebuilt.py works the directory out without importing cpp_extension; a build there and
    a later process's read-only load must agree on it, with TORCH_EXTENSIONS_DIR or without
    (torch's default root under the user's cache)."""
    from torch.utils.cpp_extension import _get_build_directory

    if extensions_dir is None:
        monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
        monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    else:
        monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    ours = prebuilt.build_directory("some_kernels")
    assert ours == Path(_get_build_directory("some_kernels", verbose=False))
    assert ours.is_dir() and str(ours).startswith(str(tmp_path))
