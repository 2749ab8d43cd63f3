"""`pip install .` alone runs every service: no test extra, no checkout, nothing undeclared.

A clean virtual environment (no system site-packages) gets what the image gets: the
Dockerfile's COPY sources, installed with `pip install .` and no extras. There every entry point
must import and answer `--help`, and every module of `services` must import. The test extras
(transformers, scipy, ...) must be missing there, or the test would prove nothing.

Building the environment takes about 40 s here (torch's CPU wheel lies on disk, pinned by a
constraint so that pip can never pull a CUDA build), so the dependencies are kept under
build/clean-venv-<hash of pyproject.toml and interpreter>, and each run only reinstalls the
project into it (a few seconds). A changed pyproject.toml builds a new one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from tests.test_dockerfile import DOCKERFILE, parse_dockerfile

# make test stays well under 15 min: builds the wheel with its C++ kernels into a clean venv (~50 s
# in CI); test_wheel_kernels is slow too.
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parent.parent
CACHE_DIR = REPO / "build"
COMPLETE_MARKER = ".dependencies-installed"
BUILD_TIMEOUT_S = 900

# Importable where the tests run (the `test` extra, or a stray system package), never needed
# by a service: the clean environment must lack every one.
NOT_INSTALLED = (
    "scipy",
    "transformers",
    "accelerate",
    "triton",
    "ucxx",
    "pytest",
    "openai",
    "benchmarks",
)
# Optional at run time, each with a fallback (the TCP transport, the PyTorch attention): a
# module may need one of these at import only if no entry point imports it.
OPTIONAL = {"triton", "ucxx"}

ENTRY_POINTS = [
    "python -m splitserve.gateway --help",
    "python -m splitserve.prefill --help",
    "python -m splitserve.decode --help",
    "python -m splitserve.planner --help",
    "python -m splitserve.planner autoscale --help",
    "python -m splitserve.planner validate --help",
    "splitserve --help",
    "splitserve up --help",
    "splitserve generate --help",
    "splitserve plan autoscale --help",
    "splitserve env --help",
]


def _clean_env() -> dict[str, str]:
    """This environment without its Python path (which points into the checkout) and without
    the user's site-packages; pip's own settings (the local wheels) stay."""
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith("PYTHON") and key != "VIRTUAL_ENV"
    }
    env["PYTHONNOUSERSITE"] = "1"
    return env


def _run(argv: list[str], cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        argv, cwd=cwd, env=_clean_env(), capture_output=True, text=True, timeout=timeout
    )


def _image_sources() -> list[str]:
    """What the Dockerfile copies into the image before `pip install .`."""
    sources = []
    for instruction in parse_dockerfile(DOCKERFILE.read_text()):
        from_context = not instruction.arguments.startswith("--from=")  # not another stage
        if instruction.keyword == "COPY" and from_context:
            sources += shlex.split(instruction.arguments)[:-1]
    return sources


def _copy_image_sources(destination: Path) -> Path:
    for source in _image_sources():
        path = REPO / source
        if path.is_dir():
            ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
            shutil.copytree(path, destination / source, ignore=ignore)
        else:
            shutil.copy2(path, destination / source)
    return destination


def _torch_constraint(directory: Path) -> Path:
    """torch exactly as pyproject pins it, and the CPU build of it: a CUDA build from the
    registry would be gigabytes."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    (pin,) = [d for d in project["dependencies"] if d.startswith("torch==")]
    path = directory / "constraints.txt"
    path.write_text(f"{pin}+cpu\n")
    return path


def _venv_key() -> str:
    digest = hashlib.sha256((REPO / "pyproject.toml").read_bytes())
    digest.update(f"{sys.executable} {sys.version}".encode())
    return digest.hexdigest()[:12]


def _pip(venv: Path, *args: str, cwd: Path) -> None:
    argv = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", *args]
    result = _run(argv, cwd, BUILD_TIMEOUT_S)
    assert result.returncode == 0, f"{shlex.join(argv)} failed:\n{result.stderr[-4000:]}"


def _venv_with_dependencies(source: Path, scratch: Path, prefix: str = "clean-venv") -> Path:
    """build/<prefix>-<key> holding the project's dependencies, built once per key; an
    interrupted build (no marker) is built again, other keys' environments are removed."""
    venv = CACHE_DIR / f"{prefix}-{_venv_key()}"
    if (venv / COMPLETE_MARKER).exists():
        return venv
    for stale in CACHE_DIR.glob(f"{prefix}-*"):
        shutil.rmtree(stale)
    CACHE_DIR.mkdir(exist_ok=True)
    # Not sys.executable -m venv with our environment: the new one must not see our packages.
    created = _run([sys.executable, "-m", "venv", str(venv)], scratch, 120)
    assert created.returncode == 0, created.stderr
    _pip(venv, "-c", str(_torch_constraint(scratch)), str(source), cwd=scratch)
    (venv / COMPLETE_MARKER).write_text("")
    return venv


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    """A virtual environment holding `pip install .` of this checkout, and nothing else."""
    source = _copy_image_sources(tmp_path_factory.mktemp("image"))
    scratch = tmp_path_factory.mktemp("pip")
    venv = _venv_with_dependencies(source, scratch)
    # The current code, whatever the cached environment held before.
    _pip(venv, "--no-deps", "--force-reinstall", str(source), cwd=scratch)
    return venv


@pytest.fixture(scope="module")
def outside(tmp_path_factory) -> Path:
    """A working directory away from the checkout (`python -m` puts the cwd on the path)."""
    return tmp_path_factory.mktemp("cwd")


def _python(venv: Path, outside: Path, code: str) -> dict:
    result = _run([str(venv / "bin" / "python"), "-c", code], outside, 300)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.splitlines()[-1])


def test_the_environment_is_clean(venv, outside) -> None:
    found = _python(
        venv,
        outside,
        "import importlib.util, json, splitserve\n"
        f"names = {NOT_INSTALLED!r}\n"
        "print(json.dumps({'splitserve': splitserve.__file__,\n"
        "    'found': [n for n in names if importlib.util.find_spec(n) is not None]}))",
    )
    assert found["found"] == [], "the clean environment holds test-only packages"
    assert Path(found["splitserve"]).is_relative_to(venv), "splitserve did not come from the venv"


@pytest.mark.parametrize("command", ENTRY_POINTS)
def test_entry_point_answers_help(venv, outside, command) -> None:
    program, *args = shlex.split(command)
    result = _run([str(venv / "bin" / program), *args], outside, 300)
    assert result.returncode == 0, f"`{command}` in the clean environment:\n{result.stderr}"
    assert result.stdout.startswith("usage:"), result.stdout[:500]


IMPORT_EVERY_MODULE = """
import importlib, json, pkgutil

failures = {}
package = importlib.import_module("splitserve")
for module in pkgutil.walk_packages(package.__path__, "splitserve."):
    try:
        importlib.import_module(module.name)
    except ImportError as error:
        failures[module.name] = error.name or str(error)
print(json.dumps(failures))
"""


def test_every_service_module_imports(venv, outside) -> None:
    """Services import nothing optional; elsewhere only the optional backends' own modules
    need their package (the entry points above prove nothing on their paths imports them)."""
    failures = _python(venv, outside, IMPORT_EVERY_MODULE)
    engine_or_kernels = ("splitserve.engine.", "splitserve.kernels.")
    in_services = [module for module in failures if not module.startswith(engine_or_kernels)]
    assert in_services == [], f"services modules need uninstalled packages: {failures}"
    assert set(failures.values()) <= OPTIONAL, failures


def test_kv_transport_falls_back_to_tcp_without_ucxx(venv, outside) -> None:
    note = _python(
        venv,
        outside,
        "import argparse, json\n"
        "from splitserve.launcher import add_up_flags, plan\n"
        "parser = argparse.ArgumentParser()\n"
        "add_up_flags(parser)\n"
        "args = parser.parse_args(['--prefill', '1', '--decode', '1'])\n"
        "print(json.dumps(plan(args).mode_note))",
    )
    assert "KV over tcp (ucxx is not installed)" in note
