"""Where DP-SBCD's pieces live (issue 9): the analyses never import the accountant, the
trainers' shared part is a framework-free core module, sampling names are the core's
constants, and the seed rule is the core's."""

from __future__ import annotations

import ast
import doctest
import pathlib
from typing import Dict, Iterator, List, Optional

import numpy as np
import pytest

import hidden_state_accountants
from hidden_state_accountants import ParameterError, sbcd_training
from hidden_state_accountants.analyses import sbcd
from hidden_state_accountants.schedules import SAMPLINGS

PKG = "hidden_state_accountants"
CORE = pathlib.Path(hidden_state_accountants.__file__).resolve().parent
REPO = CORE.parent
ACCOUNTANT = f"{PKG}.accountant"


def _module_name(path: pathlib.Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _core_modules() -> Dict[str, pathlib.Path]:
    return {_module_name(p): p for p in sorted(CORE.rglob("*.py"))}


def _imported(path: pathlib.Path, name: str, modules: Dict[str, pathlib.Path]) -> Iterator[str]:
    """The package's modules that ``path`` imports directly (anywhere in the file, relative
    imports resolved; ``from pkg import x`` counts as importing ``pkg.x`` if that is a module,
    else ``pkg``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in modules:
                    yield alias.name
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                mod = ".".join(base + ([node.module] if node.module else []))
            else:
                mod = node.module or ""
            for alias in node.names:
                sub = f"{mod}.{alias.name}"
                if sub in modules:
                    yield sub
                elif mod in modules:
                    yield mod


def _import_graph() -> Dict[str, List[str]]:
    modules = _core_modules()
    return {name: sorted(set(_imported(path, name, modules))) for name, path in modules.items()}


def _path_to(graph: Dict[str, List[str]], start: str, target: str) -> Optional[List[str]]:
    """An import chain from ``start`` to ``target``, or ``None``."""
    seen, stack = {start}, [[start]]
    while stack:
        chain = stack.pop()
        for nxt in graph.get(chain[-1], []):
            if nxt == target:
                return chain + [nxt]
            if nxt not in seen:
                seen.add(nxt)
                stack.append(chain + [nxt])
    return None


def test_the_graph_sees_imports():
    """The parser finds the imports it must (else the test below would pass vacuously)."""
    graph = _import_graph()
    assert f"{PKG}.analyses.sbcd" in graph[ACCOUNTANT]  # the accountant registers DP-SBCD's event
    assert ACCOUNTANT in graph[f"{PKG}.sbcd_training"]
    assert f"{PKG}.analyses._common" in graph[f"{PKG}.analyses.sbcd"]
    assert _path_to(graph, f"{PKG}.sbcd_training", f"{PKG}.schedules") is not None


def test_no_analysis_module_imports_the_accountant():
    """The analyses sit below the accountant: no module under analyses/ imports accountant.py,
    directly or through another module (analyses/sbcd.py did, to register its event, and
    hosted the trainers' base class, which needs the accountant)."""
    graph = _import_graph()
    analyses = [m for m in graph if m == f"{PKG}.analyses" or m.startswith(f"{PKG}.analyses.")]
    assert f"{PKG}.analyses.sbcd" in analyses and len(analyses) >= 8
    chains = {m: _path_to(graph, m, ACCOUNTANT) for m in analyses}
    assert {m: c for m, c in chains.items() if c is not None} == {}


def test_trainer_base_is_a_framework_free_core_module():
    assert not hasattr(sbcd, "SbcdTrainerBase")
    assert sbcd_training.SbcdTrainerBase.__module__ == f"{PKG}.sbcd_training"
    tree = ast.parse((CORE / "sbcd_training.py").read_text())
    roots = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    roots |= {(n.module or "").split(".")[0] for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
    assert not roots & {"torch", "tensorflow", "opacus", "tensorflow_privacy", "keras"}


def _string_constants(path: pathlib.Path) -> List[str]:
    """String literals of a module, docstrings excluded."""
    tree = ast.parse(path.read_text())
    docstrings = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                docstrings.add(id(body[0].value))
    return [n.value for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings]


@pytest.mark.parametrize("relpath", [
    "hidden_state_accountants/analyses/sbcd.py",
    "hidden_state_accountants/sbcd_training.py",
    "adapters/pytorch/sbcd.py",
    "adapters/tf_privacy/sbcd.py",
])
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


@pytest.mark.parametrize("module", [sbcd, sbcd_training])
def test_module_doctests(module):
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0
