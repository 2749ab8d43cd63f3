"""The package's shape: one name per module, and no import hidden in a function to dodge a cycle.

- Every module of `splitserve` (setup.py's folder map) imported in one process loads each file
  once, and nothing loads as `shared`, `services` or `kernels` (the folders' own names).
- An import inside a function is either of an optional dependency (OPTIONAL below) or carries a
  comment that says why it is late: `# lazy: ...` (a heavy load, such as torch, paid only on
  the path that needs it) or `# optional: ...`, on its line or in the comment right above. That
  comment may stand above a run of consecutive imports. An import that dodges a cycle gets
  neither: the fix is to move the borrowed code to a module both sides can import at the top.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

from tests.package_modules import ROOT, package_folders

FOLDER_NAMES = ("shared", "services", "kernels")
# Imported late wherever they are: not installed everywhere (triton, ucxx), or loaded only on
# the one path that wants them (the C++ build, plotting, the Kubernetes client).
OPTIONAL = (
    "triton",
    "ucxx",
    "torch.utils.cpp_extension",
    "transformers",
    "matplotlib",
    "kubernetes",
)
REASON_MARKERS = ("lazy", "optional")


def test_every_module_loads_under_one_name_only() -> None:
    report = _import_everything()
    by_file = defaultdict(list)
    for name, file in report["loaded"].items():
        if name != "__main__":
            by_file[file].append(name)
    doubles = {file: names for file, names in by_file.items() if len(names) > 1}
    assert not doubles, "files loaded under two names: " + json.dumps(doubles, indent=1)
    folder_named = [name for name in report["loaded"] if name.split(".")[0] in FOLDER_NAMES]
    assert not folder_named, f"modules loaded under a folder's name: {folder_named}"
    assert len(report["loaded"]) > 200, "the walk found too few modules to mean anything"


def test_imports_inside_functions_are_optional_or_say_why() -> None:
    offenders = [
        f"{found.path.relative_to(ROOT)}:{found.line}: {found.module}"
        for found in sorted(_function_level_imports(), key=lambda found: (found.path, found.line))
        if not found.is_optional and not found.has_reason
    ]
    assert not offenders, (
        "imports inside functions with no `# lazy:` / `# optional:` comment and no optional "
        "dependency (if one dodges an import cycle, move the code it borrows instead):\n"
        + "\n".join(offenders)
    )


def _import_everything() -> dict:
    """Imports in a fresh interpreter: the test process has loaded modules of its own."""
    result = subprocess.run(
        [sys.executable, "-m", "tests.package_modules"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads(result.stdout.splitlines()[-1])


# ---- function-level imports -----------------------------------------------------------------


@dataclass(frozen=True)
class FunctionImport:
    path: Path
    line: int
    module: str
    has_reason: bool  # a `# lazy:` / `# optional:` comment on it or above its run of imports

    @property
    def is_optional(self) -> bool:
        return any(self.module == name or self.module.startswith(name + ".") for name in OPTIONAL)


def _imported_module(node: ast.Import | ast.ImportFrom) -> str:
    if isinstance(node, ast.Import):
        return ", ".join(alias.name for alias in node.names)
    return "." * node.level + (node.module or "")


def _has_reason(text: str) -> bool:
    comment = text.partition("#")[2].lower()
    return any(marker in comment for marker in REASON_MARKERS)


def _function_level_imports() -> list[FunctionImport]:
    found = []
    for folder in package_folders().values():
        if folder.startswith("proto"):
            continue  # generated stubs
        for path in sorted((ROOT / folder).rglob("*.py")):
            found.extend(_imports_in_functions(path))
    return found


def _imports_in_functions(path: Path) -> list[FunctionImport]:
    text = path.read_text()
    lines = text.splitlines()
    found = []
    for function in ast.walk(ast.parse(text)):
        if isinstance(function, ast.FunctionDef | ast.AsyncFunctionDef):
            for body in _statement_lists(function):
                found.extend(_imports_in_body(path, body, lines))
    return found


def _statement_lists(function: ast.AST) -> list[list[ast.stmt]]:
    """The function's own statement lists (its body, branches, try blocks), not those of the
    functions nested in it, which ast.walk visits on their own."""
    lists, pending = [], [function]
    while pending:
        node = pending.pop()
        for field in ("body", "orelse", "finalbody", "handlers"):
            block = getattr(node, field, None)
            if isinstance(block, list) and block and isinstance(block[0], ast.AST):
                lists.append(block)
                pending.extend(
                    child
                    for child in block
                    if not isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
                )
    return lists


def _imports_in_body(path: Path, body: list[ast.stmt], lines: list[str]) -> list[FunctionImport]:
    """Imports in one statement list; a run of consecutive ones shares the comment above it."""
    found, run_start = [], 0
    for statement in body:
        if not isinstance(statement, ast.Import | ast.ImportFrom):
            run_start = 0
            continue
        run_start = run_start or statement.lineno
        nearby = (
            _comment_block_above(lines, run_start) + lines[run_start - 1 : statement.end_lineno]
        )
        reason = any(_has_reason(text) for text in nearby)
        found.append(FunctionImport(path, statement.lineno, _imported_module(statement), reason))
    return found


def _comment_block_above(lines: list[str], line: int) -> list[str]:
    """The comment lines right above 1-based `line`, nearest last."""
    above = line - 2
    while above >= 0 and lines[above].lstrip().startswith("#"):
        above -= 1
    return lines[above + 1 : line - 1]
