"""Every module of the installed `splitserve` package, by the name it is installed under.

setup.py's PACKAGE_FOLDERS maps folders to package names; this walks those folders and names
each .py file as the package sees it. Run as a program (`python -m tests.package_modules`) it
imports them all in a fresh interpreter and prints, as JSON, what `sys.modules` then holds
from the repository, so a test can look for one file loaded under two names.
"""

from __future__ import annotations

import ast
import importlib
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def package_folders() -> dict[str, str]:
    """setup.py's PACKAGE_FOLDERS, read without running setup() (it would build)."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]) == "PACKAGE_FOLDERS":
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py has no PACKAGE_FOLDERS")


def module_names() -> list[str]:
    """Every module under the mapped folders, as `splitserve.*` names."""
    names = []
    for package, folder in package_folders().items():
        base = ROOT / folder
        for path in sorted(base.rglob("*.py")):
            if "__pycache__" not in path.parts:
                names.append(_module_name(package, path.relative_to(base)))
    return names


def _module_name(package: str, relative: Path) -> str:
    parts = list(relative.with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join([package, *parts])


def import_all() -> dict[str, object]:
    """Imports every module; one whose third-party dependency is missing is skipped."""
    skipped = {}
    for name in module_names():
        try:
            importlib.import_module(name)
        except ModuleNotFoundError as error:
            if error.name is None or error.name.split(".")[0] == "splitserve":
                raise  # one of ours: a broken import, not an optional dependency
            skipped[name] = error.name
    return {"skipped": skipped, "loaded": _loaded_from_repository()}


def _loaded_from_repository() -> dict[str, str]:
    """Module name -> resolved file, for every loaded module whose file lies in the repo."""
    loaded = {}
    for name, module in list(sys.modules.items()):
        file = getattr(module, "__file__", None)
        if file and ROOT in Path(file).resolve().parents:
            loaded[name] = str(Path(file).resolve())
    return loaded


if __name__ == "__main__":
    print(json.dumps(import_all()))
