"""Type-checks the installed package with mypy, as `splitserve.*`: `make lint` runs it.

mypy finds modules by folder names, and it does not run the import hook through which the
editable install maps services/, shared/, kernels/ and proto/splitserve/v1 under `splitserve`
(setup.py's PACKAGE_FOLDERS). So this builds that package as a tree of symbolic links under
build/typecheck/ (folders are linked whole, so new files need no rebuild of the tree) and checks
it there; mypy's messages then name build/typecheck/splitserve/... paths.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TREE = REPO / "build" / "typecheck"


def package_folders() -> dict[str, str]:
    """setup.py's map of package names to folders, read without running setup.py."""
    module = ast.parse((REPO / "setup.py").read_text())
    for node in module.body:
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", "") == "PACKAGE_FOLDERS":
            return ast.literal_eval(node.value)
    raise SystemExit("setup.py has no PACKAGE_FOLDERS")


def build_link_tree(folders: dict[str, str]) -> None:
    """The root package's entries are linked one by one (its subpackages from other folders
    go beside them); every other mapped package is one link to its folder."""
    shutil.rmtree(TREE, ignore_errors=True)
    root_name, root_folder = "splitserve", folders["splitserve"]
    root = TREE / root_name
    root.mkdir(parents=True)
    for entry in (REPO / root_folder).iterdir():
        if entry.name != "__pycache__":
            (root / entry.name).symlink_to(entry)
    for name, folder in folders.items():
        if name != root_name:
            TREE.joinpath(*name.split(".")).symlink_to(REPO / folder)


def main() -> int:
    build_link_tree(package_folders())
    config = REPO / "pyproject.toml"
    argv = [sys.executable, "-m", "mypy", "--config-file", str(config), "-p", "splitserve"]
    return subprocess.run(argv, cwd=TREE).returncode


if __name__ == "__main__":
    sys.exit(main())
