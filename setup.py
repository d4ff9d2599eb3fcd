"""Package layout (metadata is in pyproject.toml): the repository's top-level folders are sub-packages of one
import name, ``mpflow`` — ``operators/`` is ``mpflow.operators``, ``training/`` is ``mpflow.training``,
``service/`` is ``mpflow.service`` and ``mpflow/`` holds the package root and the CLI. The data folders inside them
(``operators/pretrained/``, ``service/dashboard/static/``) are listed as namespace packages, so that setuptools
installs their files (pyproject.toml's package-data) as declared rather than as a deprecated implicit package."""

from setuptools import find_namespace_packages, setup

PACKAGE_DIRS = {
    "mpflow": "mpflow",
    "mpflow.operators": "operators",
    "mpflow.training": "training",
    "mpflow.service": "service",
}


def _packages() -> list[str]:
    found = []
    for package, folder in PACKAGE_DIRS.items():
        subs = find_namespace_packages(folder, exclude=["__pycache__", "*.__pycache__"])
        found += [package] + [f"{package}.{sub}" for sub in subs if sub not in PACKAGE_DIRS]
    return sorted(set(found))


setup(package_dir=PACKAGE_DIRS, packages=_packages())
