"""The C++ module from a wheel or an image: loaded without a compiler where it was built before,
and built with a plain message where something it needs is missing.

torch's `cpp_extension.load` checks its build again in every new process: it runs ninja and
the compiler's version check and writes a lock file and build.ninja into the build directory,
even when nothing changed. A pod has none of that (the image's final stage carries no compiler;
the chart mounts the root filesystem read-only). So the module is named after a hash of what
goes into it (`module_name`: the sources and headers, the flags, torch's and Python's versions),
each such build has its own directory, and once one is complete (`mark_built`) later processes
import its library directly (`load_prebuilt`), reading only. A changed source is a new name, so
builds of different checkouts sharing torch's cache never overwrite each other. The
Dockerfile's builder stage builds into TORCH_EXTENSIONS_DIR this way.

Where it must build, `build_problem` names what is missing (a C++ compiler, Python's headers,
ninja) before torch fails in a page of build log. ninja comes with the wheel (a dependency)
into the environment's bin/, which is not on PATH when a virtual environment's programs run
without activating it: `ninja_on_path` adds it for the build.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.util
import logging
import os
import platform
import shutil
import sys
import sysconfig
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType

import torch
from torch import _appdirs  # what cpp_extension's build root is made from

logger = logging.getLogger(__name__)

COMPLETE_MARKER = "splitserve-build-complete"
# torch's build lock (cpp_extension's FileBaton): a build killed mid-way leaves it behind, and
# every later build then waits on it forever. A whole build takes a few minutes on 2 cores, so
# a lock this old is nobody's.
STALE_LOCK_S = 15 * 60


def module_name(base: str, sources: Sequence[Path], flags: Sequence[str]) -> str:
    """`base` and a hash of everything the library is made from: every source and header of
    its folder, the compiler flags, and the torch and Python it is built against."""
    digest = hashlib.sha256()
    folders = {path.parent for path in sources}
    headers = sorted(header for folder in folders for header in folder.glob("*.h"))
    for path in [*sources, *headers]:
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    context = [*flags, torch.__version__, sys.version, platform.machine()]
    digest.update("\0".join(context).encode())
    return f"{base}_{digest.hexdigest()[:16]}"


def build_directory(name: str) -> Path:
    """Where torch builds `name`: TORCH_EXTENSIONS_DIR/name, or under torch's default root
    (torch.utils.cpp_extension's `_get_build_directory`, which a test holds this to). Worked out
    here because importing cpp_extension imports setuptools: 4 MiB resident and 0.07 s in
    every process that only loads a library built before (issue 33's memory target)."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    if root is None:
        default_root = os.path.realpath(_appdirs.user_cache_dir(appname="torch_extensions"))
        abiflags = getattr(sys, "abiflags", "")
        python = f"py{sys.version_info.major}{sys.version_info.minor}{abiflags}"
        root = os.path.join(default_root, f"{python}_{_accelerator_tag()}")
    directory = Path(root) / name
    directory.mkdir(parents=True, exist_ok=True)  # as torch makes it
    return directory


def _accelerator_tag() -> str:
    if torch.version.hip is not None:
        return f"rocm{torch.version.hip.replace('.', '')}"
    if torch.version.cuda is not None:
        return f"cu{torch.version.cuda.replace('.', '')}"
    return "cpu"


def load_prebuilt(name: str) -> ModuleType | None:
    """The library of a complete earlier build of `name`, imported without ninja, a compiler
    or a write; None where there is none."""
    try:
        directory = build_directory(name)
    except OSError:  # no build directory, and no right to make one
        return None
    library = directory / f"{name}.so"
    if not (directory / COMPLETE_MARKER).is_file() or not library.is_file():
        return None
    spec = importlib.util.spec_from_file_location(name, library)
    if spec is None or spec.loader is None:
        return None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def mark_built(name: str) -> None:
    """Marks the build torch just finished and loaded as complete (where the directory is
    writable; else later processes check it through torch as before)."""
    try:
        (build_directory(name) / COMPLETE_MARKER).write_text("")
    except OSError as error:
        logger.info("CPU kernels: could not mark the build complete (%s)", error)


def clear_stale_lock(name: str, max_age_s: float = STALE_LOCK_S) -> bool:
    """Removes torch's build lock of `name` when it is older than `max_age_s` (a killed
    build's); True if it did."""
    try:
        lock = build_directory(name) / "lock"
        age_s = time.time() - lock.stat().st_mtime
    except OSError:  # no directory or no lock: nothing waits
        return False
    if age_s < max_age_s:
        return False  # another process may be building right now
    logger.warning("CPU kernels: removing a stale build lock (%.0f s old): %s", age_s, lock)
    with contextlib.suppress(FileNotFoundError):
        lock.unlink()
    return True


def build_problem() -> str | None:
    """None when this machine can build the module; otherwise what it lacks, in words."""
    compiler = os.environ.get("CXX", "c++")
    if shutil.which(compiler) is None:
        return (
            f"no C++ compiler to build the C++ kernels ({compiler!r} is not on PATH; set CXX "
            "or install g++, e.g. apt-get install g++)"
        )
    headers = Path(sysconfig.get_paths()["include"])
    if not (headers / "Python.h").is_file():
        version = f"{sys.version_info.major}.{sys.version_info.minor}"
        return (
            f"no Python headers to build the C++ kernels ({headers}/Python.h is missing; "
            f"install python{version}-dev)"
        )
    if _ninja_directory() is None:
        return "no ninja to build the C++ kernels (pip install ninja)"
    return None


@contextlib.contextmanager
def ninja_on_path() -> Iterator[None]:
    """PATH with ninja's directory in it while the block runs (torch runs `ninja` by name)."""
    directory = _ninja_directory()
    original = os.environ.get("PATH", "")
    if directory is None or shutil.which("ninja") is not None:
        yield
        return
    os.environ["PATH"] = os.pathsep.join([directory, original])
    try:
        yield
    finally:
        os.environ["PATH"] = original


def _ninja_directory() -> str | None:
    """The directory of a ninja on PATH, or of the ninja package installed with us."""
    found = shutil.which("ninja")
    if found is not None:
        return os.path.dirname(found)
    try:
        import ninja  # optional: the PyPI package, a binary under its BIN_DIR
    except ImportError:
        return None
    directory = getattr(ninja, "BIN_DIR", None)
    return directory if directory and os.path.isfile(os.path.join(directory, "ninja")) else None
