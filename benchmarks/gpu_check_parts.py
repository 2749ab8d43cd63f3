"""The parts of `python3 -m benchmarks.gpu_check`: which commands each runs, on the device and
in a dry run, and the runner that gives each command its own time limit."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.gpu_check_figures import BENCH_DTYPES, FIGURES_OF_PART

# The kernel tests that need no model file; their DEVICE is "cuda" under TRITON_INTERPRET=0.
# The kernels whose code or launch changed since the first GPU run (2026-11-26), where every
# kernel test file passed: test_kernels_kv, test_kernels_norm_rope and test_kernels_bench's
# smoke run (80 of its 200 s) wait for the next change to their kernels.
KERNEL_TEST_FILES = (
    "tests/test_kernels_attention.py",
    "tests/test_kernels_dequant.py",
    "tests/test_kv_int8_kernels.py",
    "tests/test_moe_step.py",
)
# Kernel tests that read the SmolLM2 GGUF (its tokenizer, also that of the tiny checkpoints,
# its Q4_1 blocks): call 2 carries it. test_cuda_graphs captures real graphs there.
MODEL_TEST_FILES = (
    "tests/test_triton_backend.py",
    "tests/test_quantized_triton.py",
    "tests/test_cuda_graphs.py",
)
# The kernels changed since the second GPU run (2026-11-27): decode attention's variants
# (KV_HEADS, FUSED_MERGE) and the int4 matmul's inner loop; calls 3 and 4 run only these.
CHANGED_KERNEL_TEST_FILES = ("tests/test_kernels_attention.py", "tests/test_kernels_dequant.py")
# The dry run's one executed test file: fast in the interpreter, and it compiles nothing.
DRY_RUN_TEST_FILE = "tests/test_kernels_norm_rope.py"

# Seconds per command. Each call's commands add up to at most 540 s, inside a call's 600 s:
# call 1 = 60 + 2 * 30 (setup) + 190 (tune) + 160 + 85 = 555, call 2 = 120 + 120 + 120 + 180
# = 540. On the H100 (2026-11-26) the kernel tests needed ~200 s (test_kernels_bench.py's
# bfloat16 smoke run most), the two kernel benchmarks 31 s and 59 s; on 2026-11-27 the four
# files below needed more than 130 s (the limit cut the dequant file's launch variants) and
# the tuner 207 s for 28 shapes.
SETUP_INSTALL_LIMIT_S = 60
SETUP_STEP_LIMIT_S = 30
TUNE_BUDGET_S = 170  # the tuner stops starting shapes then; one shape's search may overrun
TUNE_LIMIT_S = 190
KERNEL_TESTS_LIMIT_S = 160
KERNEL_BENCH_LIMIT_S = 85  # per dtype
# What the tuner writes; every later part (this call's and the next, on a warm machine) runs
# with it as SPLITSERVE_TRITON_CONFIGS (kernels/launch_configs.py).
TUNED_TABLE = "triton_configs.json"
MODEL_TESTS_LIMIT_S = 120
CHANGED_KERNEL_TESTS_LIMIT_S = 150
GRAPH_TIMINGS_LIMIT_S = 90
ENGINE_CHECK_LIMIT_S = 120
ENGINE_TIMINGS_LIMIT_S = 180
PER_TEST_LIMIT_S = 120  # with pytest-timeout (the device image has it): one hung test alone

PARTS_OF_CALL = {
    1: ("setup", "tune", "kernel_tests", "kernel_bench"),
    2: ("setup", "model_tests", "engine_check", "engine_timings"),
    # A third run's two calls, for what changed since the second (each part's code is as
    # above; the shipped launch table stands, the variants are timed as fixed launches).
    3: ("setup", "changed_kernel_tests", "graph_timings"),
    4: ("setup", "engine_check", "engine_timings"),
}


@dataclass(frozen=True)
class CheckContext:
    repo_root: Path
    workdir: Path  # the scratch install (site/) and the logs (logs/)
    is_dry_run: bool
    console: Any  # benchmarks.gpu_check_report.Console

    @property
    def site(self) -> Path:
        return self.workdir / "site"

    @property
    def logs(self) -> Path:
        return self.workdir / "logs"


@dataclass(frozen=True)
class Command:
    name: str  # also its log's name: logs/<name>.log
    argv: list[str]
    limit_s: int
    env: dict[str, str] = field(default_factory=dict)  # on top of the part's environment


@dataclass
class CommandResult:
    name: str
    argv: list[str]
    returncode: int | None  # None when it was killed at its limit
    seconds: float
    log_tail: str  # the last lines of its log, also kept whole in the logs archive

    @property
    def timed_out(self) -> bool:
        return self.returncode is None


@dataclass
class PartResult:
    name: str
    status: str  # passed, failed, timed_out
    seconds: float
    commands: list[CommandResult]
    figures: dict[str, Any]


def run_parts(ctx: CheckContext, names: list[str]) -> list[PartResult]:
    unknown = [name for name in names if name not in COMMANDS_OF_PART]
    if unknown:
        raise ValueError(f"unknown part(s) {unknown}; parts: {', '.join(COMMANDS_OF_PART)}")
    ctx.logs.mkdir(parents=True, exist_ok=True)
    return [run_part(ctx, name) for name in names]


def run_part(ctx: CheckContext, name: str) -> PartResult:
    ctx.console.say(f"== part {name}{' (dry run)' if ctx.is_dry_run else ''}")
    start = time.monotonic()
    results = [run_command(ctx, command) for command in COMMANDS_OF_PART[name](ctx)]
    figures = FIGURES_OF_PART[name](ctx.logs)
    status = _part_status(results)
    seconds = time.monotonic() - start
    ctx.console.say(f"== part {name}: {status} in {seconds:.0f} s")
    return PartResult(name, status, seconds, results, figures)


def _part_status(results: list[CommandResult]) -> str:
    if any(result.timed_out for result in results):
        return "timed_out"
    return "passed" if all(result.returncode == 0 for result in results) else "failed"


def run_command(ctx: CheckContext, command: Command) -> CommandResult:
    """Runs one command in its own process group, killed whole at its limit (pytest and the
    benchmarks start children of their own)."""
    log_path = ctx.logs / f"{command.name}.log"
    ctx.console.say(f"-- {command.name} (limit {command.limit_s} s): {' '.join(command.argv)}")
    start = time.monotonic()
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            command.argv,
            cwd=ctx.repo_root,
            env=_environment(ctx, command),
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        returncode = _wait_or_kill(process, command.limit_s)
    seconds = time.monotonic() - start
    verdict = "killed at its limit" if returncode is None else f"exit {returncode}"
    ctx.console.say(f"-- {command.name}: {verdict} after {seconds:.0f} s")
    tail = _tail(log_path)
    if returncode != 0:
        ctx.console.say(tail)
    return CommandResult(command.name, command.argv, returncode, seconds, tail)


def _wait_or_kill(process: subprocess.Popen, limit_s: int) -> int | None:
    try:
        return process.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
        return None


def _tail(path: Path, num_lines: int = 30) -> str:
    lines = path.read_text(errors="replace").splitlines()
    return "\n".join(lines[-num_lines:])


def _environment(ctx: CheckContext, command: Command) -> dict[str, str]:
    env = dict(os.environ)
    # The scratch install first: the children import splitserve from what setup installed.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ctx.site), env.get("PYTHONPATH")]))
    env["PYTHONUNBUFFERED"] = "1"
    # The C++ CPU kernels would be compiled on first use (tens of seconds of a short call);
    # the CPU reference runs the PyTorch path, which the parity tests hold to transformers.
    env["SPLITSERVE_CPU_KERNELS"] = "0"
    if (ctx.logs / TUNED_TABLE).is_file():
        env["SPLITSERVE_TRITON_CONFIGS"] = str(ctx.logs / TUNED_TABLE)
    env.update(command.env)
    return env


def _python(*args: str) -> list[str]:
    return [sys.executable, *args]


def _setup(ctx: CheckContext) -> list[Command]:
    install = _python(
        "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--no-index",
        "--upgrade", "--target", str(ctx.site), str(ctx.repo_root),
    )  # fmt: skip
    carried = _python("-m", "benchmarks.gpu_check_prepare", "--install-carried", str(ctx.site))
    verify = _python(
        "-m", "benchmarks.gpu_check_prepare", "--verify", str(ctx.logs / "setup_verify.json")
    )
    return [
        Command("setup_install", install, SETUP_INSTALL_LIMIT_S),
        Command("setup_carried", carried, SETUP_STEP_LIMIT_S),
        Command("setup_verify", verify, SETUP_STEP_LIMIT_S),
    ]


def _pytest(ctx: CheckContext, name: str, files: tuple[str, ...], limit_s: int) -> Command:
    # -v: each outcome is in the log as it happens, in case the limit kills pytest before it
    # writes the JUnit file.
    argv = _python("-m", "pytest", "-v", "-rA", "-p", "no:cacheprovider")
    argv.append(f"--junitxml={ctx.logs / (name + '.xml')}")
    if importlib.util.find_spec("pytest_timeout") is not None:
        argv.append(f"--timeout={PER_TEST_LIMIT_S}")
    return Command(name, [*argv, *files], limit_s, {"TRITON_INTERPRET": "0"})


def _collect_then_run_one(ctx: CheckContext, name: str, files: tuple[str, ...]) -> list[Command]:
    """The dry run: every file collected (its imports resolve) in the interpreter, and one
    quick file run there, through the same JUnit path as the device run."""
    collect = _python("-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider", *files)
    interpret = {"TRITON_INTERPRET": "1"}
    run = _pytest(ctx, name, (DRY_RUN_TEST_FILE,), KERNEL_TESTS_LIMIT_S)
    return [
        Command(f"{name}_collect", collect, KERNEL_TESTS_LIMIT_S, interpret),
        Command(run.name, run.argv, run.limit_s, interpret),
    ]


def _kernel_tests(ctx: CheckContext) -> list[Command]:
    if ctx.is_dry_run:
        return _collect_then_run_one(ctx, "kernel_tests", KERNEL_TEST_FILES)
    return [_pytest(ctx, "kernel_tests", KERNEL_TEST_FILES, KERNEL_TESTS_LIMIT_S)]


def _changed_kernel_tests(ctx: CheckContext) -> list[Command]:
    name, files = "changed_kernel_tests", CHANGED_KERNEL_TEST_FILES
    if ctx.is_dry_run:
        return _collect_then_run_one(ctx, name, files)
    return [_pytest(ctx, name, files, CHANGED_KERNEL_TESTS_LIMIT_S)]


def _graph_timings(ctx: CheckContext) -> list[Command]:
    """Kernels' GPU time from graph replays; it needs CUDA, so the dry run only imports it."""
    module = "benchmarks.gpu_graph_timings"
    if ctx.is_dry_run:
        return [Command("graph_timings_import", _python("-c", f"import {module}"), 60)]
    argv = _python("-m", module, "--json", str(ctx.logs / "graph_timings.json"))
    return [Command("graph_timings", argv, GRAPH_TIMINGS_LIMIT_S, {"TRITON_INTERPRET": "0"})]


def _model_tests(ctx: CheckContext) -> list[Command]:
    if ctx.is_dry_run:  # collected only: kernel_tests' dry run already ran the JUnit path
        argv = _python("-m", "pytest", "-q", "--collect-only", "-p", "no:cacheprovider")
        interpret = {"TRITON_INTERPRET": "1"}
        return [Command("model_tests_collect", [*argv, *MODEL_TEST_FILES], 60, interpret)]
    return [_pytest(ctx, "model_tests", MODEL_TEST_FILES, MODEL_TESTS_LIMIT_S)]


def _kernel_bench(ctx: CheckContext) -> list[Command]:
    smoke = ["--smoke"] if ctx.is_dry_run else []
    env = {"TRITON_INTERPRET": "1"} if ctx.is_dry_run else {"TRITON_INTERPRET": "0"}
    return [
        Command(
            f"kernel_bench_{dtype}",
            _python(
                "-m",
                "benchmarks.kernels_bench",
                "--dtype",
                dtype,
                *smoke,
                "--json",
                str(ctx.logs / f"kernel_bench_{dtype}.json"),
            ),
            KERNEL_BENCH_LIMIT_S,
            env,
        )  # fmt: skip
        for dtype in BENCH_DTYPES
    ]


def _tune(ctx: CheckContext) -> list[Command]:
    argv = _python(
        "-m", "benchmarks.triton_tune", "--out", str(ctx.logs / TUNED_TABLE),
        "--record", str(ctx.logs / "triton_tune.json"), "--budget-s", str(TUNE_BUDGET_S),
    )  # fmt: skip
    if ctx.is_dry_run:
        argv.append("--smoke")
    env = {"TRITON_INTERPRET": "1" if ctx.is_dry_run else "0"}
    return [Command("tune", argv, TUNE_LIMIT_S, env)]


def _benchmark(module: str, name: str, limit_s: int) -> Callable[[CheckContext], list[Command]]:
    def commands(ctx: CheckContext) -> list[Command]:
        argv = _python("-m", module, "--json", str(ctx.logs / f"{name}.json"))
        if ctx.is_dry_run:
            argv.append("--smoke")
        # Compiled kernels on the device; the smoke runs keep to the CPU's PyTorch paths.
        return [Command(name, argv, limit_s, {"TRITON_INTERPRET": "0"})]

    return commands


COMMANDS_OF_PART: dict[str, Callable[[CheckContext], list[Command]]] = {
    "setup": _setup,
    "tune": _tune,
    "kernel_tests": _kernel_tests,
    "model_tests": _model_tests,
    "changed_kernel_tests": _changed_kernel_tests,
    "graph_timings": _graph_timings,
    "kernel_bench": _kernel_bench,
    "engine_check": _benchmark("benchmarks.gpu_engine_check", "engine_check", ENGINE_CHECK_LIMIT_S),
    "engine_timings": _benchmark(
        "benchmarks.gpu_engine_timings", "engine_timings", ENGINE_TIMINGS_LIMIT_S
    ),
}
