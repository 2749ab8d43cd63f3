"""Builds (once) the virtual environment llama-cpp-python runs in, beside ours, never in it.

`python -m benchmarks.peer.llamacpp_venv` prints the environment's python after making sure
`llama_cpp` imports. The registry has llama-cpp-python as source only, so pip compiles
llama.cpp here (CMake and a C++ compiler; ~10-30 minutes on 2 cores), tuned for this machine's
CPU (llama.cpp's GGML_NATIVE default), as a user who builds it would get. pip keeps the wheel
it built in its cache, so rebuilding the environment (a fresh checkout, a removed build/) takes
seconds after the first time. The environment sees
this machine's site-packages (`--system-site-packages`) for numpy and jinja2.

`--jobs N` caps the compiler's parallelism (CMAKE_BUILD_PARALLEL_LEVEL): on a shared machine,
1 keeps a core free for others.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import venv
from pathlib import Path

LLAMA_CPP_PYTHON_VERSION = "0.3.36"  # the version issue 19's figures were measured with
DEFAULT_DIR = Path("build/llamacpp-venv")


def ensure_llamacpp_venv(directory: Path = DEFAULT_DIR, jobs: int | None = None) -> Path:
    """The environment's python, building the environment first if llama_cpp does not import."""
    python = directory / "bin" / "python"
    if python.exists() and _imports_llama_cpp(python):
        return python
    print(
        f"[llamacpp-venv] building {directory} (llama-cpp-python {LLAMA_CPP_PYTHON_VERSION}, "
        "compiling llama.cpp: tens of minutes)",
        flush=True,
    )
    venv.EnvBuilder(system_site_packages=True, with_pip=True).create(directory)
    env = dict(os.environ)
    env["CMAKE_BUILD_PARALLEL_LEVEL"] = str(jobs or os.cpu_count() or 1)
    subprocess.run(
        [
            str(python),
            "-m",
            "pip",
            "install",
            "-v",
            f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}",
        ],
        check=True,
        env=env,
    )
    if not _imports_llama_cpp(python):
        raise RuntimeError(f"llama_cpp does not import in {directory} after installing it")
    return python


def _imports_llama_cpp(python: Path) -> bool:
    probe = [str(python), "-c", "import llama_cpp"]
    return subprocess.run(probe, capture_output=True).returncode == 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dir", type=Path, default=DEFAULT_DIR)
    parser.add_argument("--jobs", type=int, default=None, help="parallel compile jobs")
    args = parser.parse_args(argv)
    print(ensure_llamacpp_venv(args.dir, args.jobs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
