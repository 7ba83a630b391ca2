"""Doctests of the package's modules, collected by ``pytest --doctest-modules`` (pyproject.toml).

pytest would import a module by its path, which for the framework packages (``adapters/opacus/...``,
installed as ``hidden_state_accountants.opacus``) names a second copy of the package or shadows
the framework itself (``opacus.accountant``). Here every module of the package is imported
under its installed name instead; an adapter whose framework is not installed (torch, Opacus,
TensorFlow, TF-Privacy) has its doctests skipped with the reason, and files outside the package
(tests, examples, benchmarks) are not searched for doctests.
"""

from __future__ import annotations

import importlib
import pathlib
from typing import Dict, Optional

import pytest
from _pytest.doctest import DoctestModule

ROOT = pathlib.Path(__file__).resolve().parent
FRAMEWORK_ROOTS = ("adapters", "training")  # as in setup.py
PACKAGE_DIRS: Dict[str, pathlib.Path] = {
    "hidden_state_accountants": ROOT / "hidden_state_accountants",
    # every package under adapters/ and training/ installs as hidden_state_accountants.<name>, the
    # rule of setup.py (tests/core/test_packaging.py checks the wheel against it)
    **{
        f"hidden_state_accountants.{d.name}": d
        for root in FRAMEWORK_ROOTS
        for d in sorted((ROOT / root).iterdir())
        if (d / "__init__.py").is_file()
    },
}
FRAMEWORKS = ("torch", "opacus", "tensorflow", "tensorflow_privacy", "keras")


def installed_name(path: pathlib.Path) -> Optional[str]:
    """The name ``path`` is installed under, ``None`` outside the package."""
    for package, directory in PACKAGE_DIRS.items():
        try:
            parts = list(path.resolve().relative_to(directory).with_suffix("").parts)
        except ValueError:
            continue
        if parts[-1] == "__init__":
            parts.pop()
        return ".".join([package, *parts])
    return None


class InstalledDoctestModule(DoctestModule):
    """A module's doctests, the module imported under its installed name."""

    module_name: str = ""

    def _getobj(self):
        try:
            return importlib.import_module(self.module_name)
        except ImportError as err:
            missing = (err.name or "").split(".")[0]
            if missing in FRAMEWORKS:
                pytest.skip(f"{self.module_name} needs {missing}", allow_module_level=True)
            raise

    def collect(self):
        module_file = pathlib.Path(self.obj.__file__).resolve()
        if module_file != self.path.resolve():
            return  # an alias of a module whose doctests are collected from its own file
        yield from super().collect()


@pytest.hookimpl(wrapper=True)
def pytest_collect_file(file_path: pathlib.Path, parent):
    collected = yield
    others = [c for c in collected if type(c) is not DoctestModule]
    if len(others) == len(collected):
        return collected
    name = installed_name(file_path)
    if name is None:
        return others
    doctests = InstalledDoctestModule.from_parent(parent, path=file_path)
    doctests.module_name = name
    return others + [doctests]
