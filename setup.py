"""Package discovery for the wheel and sdist; everything else is in pyproject.toml.

The repository root is the package `h3_multigpu` (package-dir maps it to "."), which
pyproject.toml's own `packages.find` cannot express: it would name the subfolders `planner`,
`nodes` ... as top-level packages. So the subpackages are found here and prefixed, and a new
product folder ships as soon as it has an `__init__.py`, without a list to forget it in.
"""

from __future__ import annotations

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

# Test and development code: the tests (the twin model the tests time lives in tests/twin) and
# dev/ (benchmarks, schema capture tools, the workflow layout engine). Product code imports none.
DEV_PACKAGES = ["tests", "tests.*", "dev", "dev.*"]
# Folders shipped for their data only: the bundled workflows (pyproject.toml's package-data).
# They hold no modules (dev/workflow_layout writes them); they are listed as packages because
# setuptools warns about, and may one day drop, a data folder that is not one.
DATA_PACKAGES = ["h3_multigpu.workflows", "h3_multigpu.workflows.api"]


# Files of the root that are no modules of the package: this build script (which sits in the
# package folder, and which setuptools' own exclusion misses under pip's build backend) and
# `h3-multigpu.py`, the launcher that runs the CLI from a git clone.
ROOT_SCRIPTS = ("setup", "h3-multigpu")


class BuildPy(build_py):
    """Ships no module of a data folder and no script of the root."""

    def find_package_modules(self, package, package_dir):
        if package in DATA_PACKAGES:
            return []
        return [(pkg, module, path)
                for pkg, module, path in super().find_package_modules(package, package_dir)
                if not (pkg == "h3_multigpu" and module in ROOT_SCRIPTS)]


setup(
    packages=["h3_multigpu",
              *(f"h3_multigpu.{name}" for name in find_packages(".", exclude=DEV_PACKAGES)),
              *DATA_PACKAGES],
    cmdclass={"build_py": BuildPy},
)
