"""The package list; everything else is in pyproject.toml.

The core and its subpackages are found under hidden_state_accountants/, and every package under
adapters/ installs as hidden_state_accountants.<adapter> (an unrelated PyPI project owns the
top-level name ``adapters``). Both lists are computed, so a new module or adapter cannot be left
out of the wheel; tests/core/test_packaging.py checks the built wheel against the source tree.
"""

from setuptools import find_packages, setup

CORE = "hidden_state_accountants"
ADAPTERS = find_packages("adapters")  # "opacus", "tf_privacy", "opacus.sub", ...

setup(
    packages=find_packages(include=[CORE, f"{CORE}.*"]) + [f"{CORE}.{name}" for name in ADAPTERS],
    # a subpackage follows its top-level adapter's directory
    package_dir={f"{CORE}.{name}": f"adapters/{name}" for name in ADAPTERS if "." not in name},
)
