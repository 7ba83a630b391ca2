"""Where DP-SBCD's pieces live (issue 9): the trainers' shared part is a core module, sampling
names are the core's constants, and the seed rule is the core's. (That the analyses never import
the accountant and the core no framework: tests/core/test_import_rules.py.)"""

from __future__ import annotations

import ast
import pathlib
from typing import List

import numpy as np
import pytest

import hidden_state_accountants
from hidden_state_accountants import ParameterError, sbcd_training
from hidden_state_accountants.analyses import sbcd
from hidden_state_accountants.schedules import SAMPLINGS

PKG = "hidden_state_accountants"
CORE = pathlib.Path(hidden_state_accountants.__file__).resolve().parent
REPO = CORE.parent


def test_trainer_base_is_a_core_module():
    # framework-free as every core module (tests/core/test_import_rules.py)
    assert not hasattr(sbcd, "SbcdTrainerBase")
    assert sbcd_training.SbcdTrainerBase.__module__ == f"{PKG}.sbcd_training"


def _string_constants(path: pathlib.Path) -> List[str]:
    """String literals of a module, docstrings excluded."""
    tree = ast.parse(path.read_text())
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                docstrings.add(id(body[0].value))
    return [
        n.value
        for n in ast.walk(tree)
        if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings
    ]


@pytest.mark.parametrize(
    "relpath",
    [
        "hidden_state_accountants/analyses/sbcd.py",
        "hidden_state_accountants/sbcd_training.py",
        "training/pytorch/sbcd.py",
        "training/keras/sbcd.py",
    ],
)
def test_sampling_names_are_the_cores_constants(relpath):
    literals = _string_constants(REPO / relpath)
    assert literals  # the check can see strings
    assert sorted(set(literals) & set(SAMPLINGS)) == []


# ---------------------------------------------------------------------------- seeds
def test_noise_seed_default_is_a_fresh_secret_draw():
    draws = [sbcd_training.noise_seed(None) for _ in range(4)]
    assert all(secret for _, secret in draws)
    assert len({s for s, _ in draws}) == 4
    assert all(0 <= s < 2**63 for s, _ in draws)


def test_noise_seed_from_the_callers_seed_is_reproducible_and_independent():
    a, secret = sbcd_training.noise_seed(5)
    assert not secret and sbcd_training.noise_seed(5) == (a, False)
    assert a != 5 and a != sbcd_training.noise_seed(6)[0] and 0 <= a < 2**63
    assert sbcd_training.noise_seed(np.int64(5)) == (a, False)


@pytest.mark.parametrize("seed", [-1, 2**63, 1.5, True, "7"])
def test_noise_seed_rejects_bad_seeds(seed):
    with pytest.raises(ParameterError) as err:
        sbcd_training.noise_seed(seed)
    assert err.value.parameter == "seed"
