import os
import pathlib

import pytest
from hypothesis import HealthCheck, settings

# Accounting calls take milliseconds to seconds; no per-example deadline, few examples.
settings.register_profile(
    "hsa",
    deadline=None,
    max_examples=int(os.environ.get("HSA_HYPOTHESIS_EXAMPLES", "25")),
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile("hsa")


# The folder says which framework a test needs (tests/core: none; tests/opacus: torch and Opacus;
# tests/tf: TensorFlow and TF-Privacy), so `-m "not torch and not tf"` (the core run on the newest
# Python, scripts/test_newest.sh) selects exactly tests/core, whatever a file declares itself.
_FRAMEWORK_MARK = {"opacus": "torch", "tf": "tf"}


_TESTS = pathlib.Path(__file__).resolve().parent


def pytest_collection_modifyitems(config, items):
    for item in items:
        path = item.path.resolve()
        if _TESTS in path.parents:
            mark = _FRAMEWORK_MARK.get(path.relative_to(_TESTS).parts[0])
            if mark:
                item.add_marker(getattr(pytest.mark, mark))
