"""Maps the repository's folders under the one installed name, `splitserve`.

The design keeps `services/`, `shared/`, `kernels/` and `proto/` as top-level folders; users
import one name. pyproject.toml holds everything else; only the folder-to-package map lives
here, because setuptools' declarative config cannot find subpackages under a renamed root.
"""

from setuptools import find_packages, setup

PACKAGE_FOLDERS = {
    "splitserve": "services",
    "splitserve.engine": "shared",
    "splitserve.kernels": "kernels",
    "splitserve.v1": "proto/splitserve/v1",
}


def packages_under(name: str, folder: str) -> list[str]:
    return [name] + [f"{name}.{sub}" for sub in find_packages(folder)]


setup(
    package_dir=PACKAGE_FOLDERS,
    packages=[
        pkg for name, folder in PACKAGE_FOLDERS.items() for pkg in packages_under(name, folder)
    ],
    package_data={
        "splitserve.kernels.cpu": ["*.cpp", "*.h"],
        # Launch configurations tuned per GPU model (kernels/launch_configs.py).
        "splitserve.kernels": ["configs/*.json"],
        "splitserve.v1": ["*.proto", "*.pyi"],
    },
)
