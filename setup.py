"""The package list; everything else is in pyproject.toml.

The core and its subpackages are found under hidden_state_accountants/. Two folders beside it hold
the framework code, and every package in them installs as hidden_state_accountants.<name>:
adapters/ (the accounting seam: what a framework did, translated for the core) and training/ (the
tools that make the papers' assumptions true in a training loop: samplers, feature clipping,
DP-SBCD). An unrelated PyPI project owns the top-level name ``adapters``. Both lists are computed,
so a new module or package cannot be left out of the wheel; tests/core/test_packaging.py checks the
built wheel against the source tree.
"""

from setuptools import find_packages, setup

CORE = "hidden_state_accountants"
FRAMEWORK_ROOTS = ("adapters", "training")
# (root, "opacus"), (root, "opacus.sub"), ...
FRAMEWORK_PACKAGES = [(root, name) for root in FRAMEWORK_ROOTS for name in find_packages(root)]

setup(
    packages=find_packages(include=[CORE, f"{CORE}.*"]) + [f"{CORE}.{name}" for _, name in FRAMEWORK_PACKAGES],
    # a subpackage follows its top-level package's directory
    package_dir={f"{CORE}.{name}": f"{root}/{name}" for root, name in FRAMEWORK_PACKAGES if "." not in name},
)
