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

`--avx2` builds llama.cpp for AVX2 machines instead (no AVX-512, VNNI or AMX, as on a CPU
that has only AVX2, FMA and F16C) into build/llamacpp-avx2-venv, with its own pip cache so
that the native wheel cached above is never taken for it: the peer of our forced-AVX2 runs
(`benchmarks.quantization --force-avx2`).
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
AVX2_DIR = Path("build/llamacpp-avx2-venv")
# llama.cpp's CPU feature switches for an AVX2-only CPU (ggml's CMake options).
AVX2_CMAKE_ARGS = " ".join(
    ["-DGGML_NATIVE=OFF", "-DGGML_AVX=ON", "-DGGML_AVX2=ON", "-DGGML_FMA=ON", "-DGGML_F16C=ON"]
    + ["-DGGML_BMI2=ON", "-DGGML_AVX_VNNI=OFF", "-DGGML_AVX512=OFF", "-DGGML_AVX512_VBMI=OFF"]
    + ["-DGGML_AVX512_VNNI=OFF", "-DGGML_AVX512_BF16=OFF", "-DGGML_AMX_TILE=OFF"]
    + ["-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF", "-DGGML_CPU_ALL_VARIANTS=OFF"]
)


def ensure_llamacpp_venv(
    directory: Path = DEFAULT_DIR, jobs: int | None = None, avx2: bool = False
) -> Path:
    """The environment's python, building the environment first if llama_cpp does not import
    (`avx2`: llama.cpp built for AVX2-only CPUs, in AVX2_DIR unless `directory` says)."""
    if avx2 and directory == DEFAULT_DIR:
        directory = AVX2_DIR
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
    if avx2:
        env["CMAKE_ARGS"] = AVX2_CMAKE_ARGS
        env["PIP_CACHE_DIR"] = str(directory.parent / "llamacpp-avx2-pip-cache")
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
    parser.add_argument("--avx2", action="store_true", help="llama.cpp for AVX2-only CPUs")
    args = parser.parse_args(argv)
    print(ensure_llamacpp_venv(args.dir, args.jobs, args.avx2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
