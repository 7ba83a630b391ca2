"""examples/opacus_balls_in_bins_mlp.py in quick mode (issue 28, item 3): an MLP on digits trained on
balls-in-bins batches gets the random-allocation composition, at most Opacus' PRV number for its Poisson twin,
and calibration to a budget trains to within it."""

import json
import pathlib
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("opacus")
pytest.importorskip("sklearn")
pytestmark = pytest.mark.torch

EXAMPLE = pathlib.Path(__file__).resolve().parents[2] / "examples" / "opacus_balls_in_bins_mlp.py"


def test_quick_run_reports_the_amplified_number_and_meets_the_budget():
    res = subprocess.run(
        [sys.executable, str(EXAMPLE), "--quick", "--json"], capture_output=True, text=True, timeout=600, check=True
    )
    out = json.loads(res.stdout.strip().splitlines()[-1])
    rows = out["epsilon_per_epoch"]
    assert [r["epoch"] for r in rows] == [1, 2]
    for r in rows:
        assert r["analysis"] == "composition_allocation_pld"
        assert r["balls_in_bins"] <= r["poisson_twin_prv"]  # random allocation is at least as private as Poisson
    for run in out["accuracy_at_budget"]:
        for name in ("poisson_prv", "balls_in_bins"):
            assert run[name]["epsilon"] <= 2.0 * (1 + 1e-6) and run[name]["accuracy"] > 0.5
