"""Package layout (metadata is in pyproject.toml): the repository's top-level folders are sub-packages of one
import name, ``mpflow`` — ``operators/`` is ``mpflow.operators``, ``training/`` is ``mpflow.training``,
``service/`` is ``mpflow.service`` and ``mpflow/`` holds the package root and the CLI."""

from setuptools import find_packages, setup

PACKAGE_DIRS = {
    "mpflow": "mpflow",
    "mpflow.operators": "operators",
    "mpflow.training": "training",
    "mpflow.service": "service",
}


def _packages() -> list[str]:
    found = []
    for package, folder in PACKAGE_DIRS.items():
        found += [package] + [f"{package}.{sub}" for sub in find_packages(folder) if sub not in PACKAGE_DIRS]
    return sorted(set(found))


setup(package_dir=PACKAGE_DIRS, packages=_packages())
