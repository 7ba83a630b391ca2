import os
import pathlib
import subprocess
import sys

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


@pytest.fixture
def sbcd_example_row():
    """Runs ``examples/<script> --quick`` (a DP-SBCD digits example, torch or Keras) and returns the
    cells of its table row for batch size 479: the setting, test accuracy, epsilon (analysis), ..."""

    def run(script: str, timeout: int):
        out = subprocess.run(
            [sys.executable, str(_TESTS.parent / "examples" / script), "--quick", "--no-progress"],
            capture_output=True,
            text=True,
            check=True,
            timeout=timeout,
        ).stdout
        row = [line for line in out.splitlines() if line.startswith("| 479")][0]
        return [c.strip() for c in row.strip("|").split("|")]

    return run


@pytest.fixture
def check_sbcd_report():
    """Checks a DP-SBCD trainer's (torch or Keras) report against the core's accountant (issue 27): a
    one-block model gets Thm 4.5 (below composition), a network of several blocks the composition
    bound, with Thm 4.5's reason."""
    import numpy as np

    from hidden_state_accountants import HiddenStateAccountant
    from hidden_state_accountants.analyses import sbcd as core

    def check(opt) -> None:
        ev, orders = opt.privacy_event(), [2.0, 8.0, 32.0]
        report = opt.explain(1e-5)
        assert report.epsilon == pytest.approx(opt.get_epsilon(1e-5), rel=1e-12)
        assert report.epsilon == pytest.approx(HiddenStateAccountant().compose(ev).get_epsilon(1e-5), rel=1e-12)
        thm = {a.name: a for a in report.analyses}[core.THM_4_5_NAME]
        rdp = core.composition_rdp(ev, orders)
        if ev.num_layers == 1:
            assert report.epsilon <= thm.epsilon < report.composition_epsilon
            rdp = np.minimum(core.thm_4_5_rdp(ev, orders), rdp)
        else:
            assert report.analysis == core.COMPOSITION_NAME
            assert thm.epsilon is None and thm.reason == core.multi_block_reason(ev.num_layers)
        np.testing.assert_allclose(opt.get_rdp(orders), rdp, rtol=1e-9)

    return check


@pytest.fixture(scope="module")
def torch_one_thread():
    """One torch thread for a module of tests on tiny matrices (thread hand-offs dominate on small
    shared machines); use with ``pytest.mark.usefixtures("torch_one_thread")``."""
    import torch

    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)
