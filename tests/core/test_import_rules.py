"""The package's import rules, read from the source with ``ast`` (issue 21).

* No import circle among the package's modules (core and adapters, each module under its
  installed name; function-level imports count too), none at all.
* The core never imports a framework (torch, Opacus, TensorFlow, TF-Privacy, Keras), and imports
  its own modules at module level only: no deferred import hiding a circle.
* The analyses sit below the accountant: none reaches it through its imports.
* The ground truth stands apart from the bounds: no bound, selection or calibration code depends on
  ``exact``. The report's best known lower bound (``lower_bounds``) is the one way in: only
  ``lower_bounds`` imports ``exact``, only the accountant (for ``PrivacyReport``) imports
  ``lower_bounds``, and without that edge ``exact`` is unreachable from the accountant, calibration
  and every analysis (the code both sides need lives in ``schedule_laws`` and ``mixture_pair``, tested
  on their own in tests/core/test_schedule_laws.py); tests/core/test_lower_bounds.py checks that the report
  computes it only when shown and that nothing else reads it.
* Each adapter imports only its own framework, the core and its framework's training tools; the
  training tools import only their framework and the core (the two that extend a DP library's
  optimizer import that library, and ProjectionHook the Opacus adapter's reading of it).
* Every warning the package emits is a ``HiddenStateWarning``, every exception and warning class
  is defined once, and the leaf modules (``errors``, ``analyses.analysis_info``) import nothing
  that imports them back.
"""

from __future__ import annotations

import ast
import importlib.util
import pathlib
from typing import Dict, Iterator, List, Set, Tuple

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("_hsa_root_conftest", ROOT / "conftest.py")
_root_conftest = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_root_conftest)
PACKAGE_DIRS = _root_conftest.PACKAGE_DIRS  # the installed name of every directory (the doctests' too)

PKG = "hidden_state_accountants"
FRAMEWORKS = {"torch", "opacus", "tensorflow", "tensorflow_privacy", "keras"}
# the framework packages (installed from adapters/ and training/) and the frameworks each may import
ADAPTER_FRAMEWORKS = {
    f"{PKG}.opacus": {"torch", "opacus"},
    f"{PKG}.pytorch": {"torch"},
    f"{PKG}.tf_privacy": {"tensorflow", "tensorflow_privacy"},
    f"{PKG}.keras": {"tensorflow"},
}
MODULE_FRAMEWORKS = {
    # the two training tools that extend a DP library's optimizer (not imported by their package)
    f"{PKG}.pytorch.projection": {"torch", "opacus"},
    f"{PKG}.keras.decoupled_l2": {"tensorflow", "tensorflow_privacy"},
}
ADAPTER_IMPORTS_ADAPTER = {
    # each adapter re-exports and reads its framework's training tools
    (f"{PKG}.opacus", f"{PKG}.pytorch"),
    (f"{PKG}.tf_privacy", f"{PKG}.keras"),
    # ProjectionHook refuses an update the analyses do not cover, as the Opacus adapter reads it
    (f"{PKG}.pytorch.projection", f"{PKG}.opacus"),
}


def _modules() -> Dict[str, pathlib.Path]:
    """Every module of the package under its installed name."""
    out = {}
    for package, directory in PACKAGE_DIRS.items():
        for path in directory.rglob("*.py"):
            if package == PKG and any(path.is_relative_to(d) for p, d in PACKAGE_DIRS.items() if p != PKG):
                continue
            parts = list(path.relative_to(directory).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([package, *parts])] = path
    return out


MODULES = _modules()
TREES = {name: ast.parse(path.read_text(), str(path)) for name, path in MODULES.items()}


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _imports(name: str) -> Iterator[Tuple[str, ast.AST]]:
    """``(imported module, node)`` for every import in ``name``; ``from X import y`` names the
    module ``X.y`` when there is one, else ``X``."""
    for node in ast.walk(TREES[name]):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield alias.name, node
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = name.split(".")
                if not _is_package(name):
                    parts = parts[:-1]
                parts = parts[: len(parts) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            for alias in node.names:
                full = f"{base}.{alias.name}"
                yield (full if full in MODULES else base), node


def _internal(target: str) -> str:
    """The package module ``target`` names (itself or the closest package above it), or ``""``."""
    while target and target not in MODULES:
        target = target.rpartition(".")[0]
    return target


def _graph() -> Dict[str, Set[str]]:
    graph = {name: set() for name in MODULES}
    for name in MODULES:
        for target, _ in _imports(name):
            target = _internal(target)
            if target and target != name:
                graph[name].add(target)
    return graph


GRAPH = _graph()


def _circles(graph: Dict[str, Set[str]]) -> Set[frozenset]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: Dict[str, int] = {}
    low: Dict[str, int] = {}
    stack: List[str] = []
    out = set()

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                out.add(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def _closure(start: str, without: Set[Tuple[str, str]] = frozenset()) -> Set[str]:
    """The modules ``start`` reaches through its imports, not following the edges in ``without``."""
    seen, todo = set(), [start]
    while todo:
        v = todo.pop()
        if v not in seen:
            seen.add(v)
            todo.extend(w for w in GRAPH[v] if (v, w) not in without)
    return seen


def _core(name: str) -> bool:
    return not any(name == a or name.startswith(a + ".") for a in ADAPTER_FRAMEWORKS)


def _function_level(name: str) -> Set[int]:
    """ids of import nodes inside a function or class body."""
    inner = set()
    for node in ast.walk(TREES[name]):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            inner |= {id(n) for n in ast.walk(node) if isinstance(n, (ast.Import, ast.ImportFrom))}
    return inner


# ------------------------------------------------------------------------------ the tests
def test_the_parser_sees_the_package():
    assert {f"{PKG}.accountant", f"{PKG}.analyses.registry", f"{PKG}.opacus.facts", f"{PKG}.keras.sbcd"} <= set(MODULES)
    assert f"{PKG}.analyses.bok" in GRAPH[f"{PKG}.analyses.registry"]
    assert f"{PKG}.opacus.facts" in GRAPH[f"{PKG}.opacus.accountant"]  # relative imports resolve


def test_no_import_circle():
    assert _circles(GRAPH) == set()


def test_the_circle_check_finds_a_circle():
    graph = {k: set(v) for k, v in GRAPH.items()}
    graph[f"{PKG}.errors"].add(f"{PKG}.accountant")
    assert any(f"{PKG}.errors" in c for c in _circles(graph))


def test_the_core_imports_no_framework():
    for name in MODULES:
        if _core(name):
            roots = {target.split(".")[0] for target, _ in _imports(name)}
            assert not roots & FRAMEWORKS, name


def test_the_core_imports_its_modules_at_module_level():
    for name in MODULES:
        if _core(name):
            inner = _function_level(name)
            deferred = [target for target, node in _imports(name) if id(node) in inner and _internal(target)]
            assert not deferred, f"{name} imports {deferred} inside a function"


def test_no_bound_selection_or_calibration_code_depends_on_the_ground_truth():
    """What matters is that no number the package reports, selects, calibrates or budgets with can come
    from ``exact`` (a bound tested against the oracle it is computed from would test nothing). The report
    may show the oracle's lower bound beside the bound, so ``accountant -> lower_bounds -> exact`` is
    allowed; that edge is the only way in, and cutting it leaves ``exact`` unreachable from the bound code."""
    exact, lower = f"{PKG}.exact", f"{PKG}.lower_bounds"
    for name in MODULES:
        if name.startswith(f"{PKG}.analyses"):
            assert exact not in GRAPH[name] and lower not in GRAPH[name], name
    assert {m for m in MODULES if _core(m) and exact in GRAPH[m]} == {lower}
    assert {m for m in MODULES if lower in GRAPH[m]} == {f"{PKG}.accountant"}
    report_only = {(f"{PKG}.accountant", lower)}
    for top in (
        f"{PKG}.accountant",
        f"{PKG}.calibration",
        f"{PKG}.selection",
        f"{PKG}.bounds",
        f"{PKG}.analyses.registry",
        f"{PKG}.recording",
    ):
        assert exact not in _closure(top, without=report_only), top
    assert exact in _closure(f"{PKG}.accountant")  # the rule above is not vacuous
    assert {f"{PKG}.schedule_laws", f"{PKG}.mixture_pair"} <= _closure(f"{PKG}.analyses.registry") & _closure(exact)


def test_no_analysis_reaches_the_accountant():
    """The analyses sit below the accountant (issue 9: analyses/sbcd.py imported it to register
    its event): no module under analyses/ imports accountant.py, directly or through another."""
    analyses = [m for m in MODULES if m.startswith(f"{PKG}.analyses.")]
    assert f"{PKG}.analyses.sbcd" in analyses and len(analyses) >= 8
    assert [m for m in analyses if f"{PKG}.accountant" in _closure(m)] == []


def test_each_adapter_imports_only_its_own_framework():
    for name in MODULES:
        adapter = next((a for a in ADAPTER_FRAMEWORKS if name == a or name.startswith(a + ".")), None)
        if adapter is None:
            continue
        for target, _ in _imports(name):
            root = target.split(".")[0]
            if root in FRAMEWORKS:
                assert root in MODULE_FRAMEWORKS.get(name, ADAPTER_FRAMEWORKS[adapter]), f"{name} imports {target}"
            other = next(
                (a for a in ADAPTER_FRAMEWORKS if a != adapter and (target == a or target.startswith(a + "."))), None
            )
            if other is not None:
                assert (name, other) in ADAPTER_IMPORTS_ADAPTER or (adapter, other) in ADAPTER_IMPORTS_ADAPTER, (
                    f"{name} imports the package {target}"
                )


def test_the_leaf_modules_import_no_module_that_imports_them():
    assert not {t for t in GRAPH[f"{PKG}.errors"]}
    for leaf in (f"{PKG}.errors", f"{PKG}.analyses.analysis_info", f"{PKG}.schedule_laws", f"{PKG}.mixture_pair"):
        assert not any(
            m.startswith(f"{PKG}.analyses.") and m != f"{PKG}.analyses._common" for m in _closure(leaf) - {leaf}
        ), leaf


def _classes() -> Dict[str, List[str]]:
    out: Dict[str, List[str]] = {}
    for name, tree in TREES.items():
        for node in tree.body:
            if isinstance(node, ast.ClassDef):
                out.setdefault(node.name, []).append(name)
    return out


def test_every_class_is_defined_once():
    twice = {c: sorted(where) for c, where in _classes().items() if len(where) > 1}
    # one DP-SBCD trainer and one feature clip (a torch module, a Keras layer) per framework
    assert twice == {
        "DPSBCD": [f"{PKG}.keras.sbcd", f"{PKG}.pytorch.sbcd"],
        "FeatureClip": [f"{PKG}.keras.features", f"{PKG}.pytorch.features"],
    }
    assert _classes()["UnsupportedLayerError"] == [f"{PKG}.errors"]


def test_every_warning_class_is_a_hidden_state_warning():
    from hidden_state_accountants import errors

    warning_classes = {c for c, where in _classes().items() if c.endswith("Warning")}
    assert all(_classes()[c] == [f"{PKG}.errors"] for c in warning_classes)
    assert warning_classes == {n for n in errors.__all__ if n.endswith("Warning")}
    assert all(issubclass(getattr(errors, c), errors.HiddenStateWarning) for c in warning_classes)


# Opacus' own warning, emitted as Opacus' load_checkpoint emits it (the adapter replaces that method)
FOREIGN_WARNINGS = {(f"{PKG}.opacus.engine", "optimizer_state_dict has")}


def test_every_warning_the_package_emits_is_a_hidden_state_warning():
    from hidden_state_accountants import errors

    ours = {n for n in errors.__all__ if n.endswith("Warning")}
    emitted = 0
    for name, tree in TREES.items():
        for node in ast.walk(tree):
            if not (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "warn"
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "warnings"
            ):
                continue
            emitted += 1
            category = next(
                (k.value for k in node.keywords if k.arg == "category"), node.args[1] if len(node.args) > 1 else None
            )
            if category is None and node.args and isinstance(node.args[0], ast.Call):
                category = node.args[0].func  # warnings.warn(CalibrationWarning("..."))
            if isinstance(category, ast.Name) and category.id in ours:
                continue
            text = ast.get_source_segment(MODULES[name].read_text(), node) or ""
            assert any(name == m and marker in text for m, marker in FOREIGN_WARNINGS), (
                f"{name}:{node.lineno} warns without a HiddenStateWarning category"
            )
    assert emitted >= 10


def test_the_installed_names_are_setup_pys():
    """conftest.py imports the framework packages under the names setup.py installs them as."""
    setuptools = pytest.importorskip("setuptools")
    mapped = {
        f"{PKG}.{name}": ROOT / root / name
        for root in ("adapters", "training")
        for name in setuptools.find_packages(str(ROOT / root))
        if "." not in name
    }
    assert {f"{PKG}.opacus", f"{PKG}.tf_privacy", f"{PKG}.pytorch", f"{PKG}.keras"} <= set(mapped)
    assert {k: v for k, v in PACKAGE_DIRS.items() if k != PKG} == mapped
    assert set(mapped) == set(ADAPTER_FRAMEWORKS)  # every framework package has its import rule


def test_every_declared_analysis_is_registered():
    """An ``@analysis`` the registry does not list would be silently left out of every report."""
    import pkgutil

    import hidden_state_accountants.analyses as package
    from hidden_state_accountants.analyses import registry
    from hidden_state_accountants.analyses.analysis_info import AnalysisInfo

    declared = set()
    for module in pkgutil.iter_modules(package.__path__):
        mod = importlib.import_module(f"{package.__name__}.{module.name}")
        declared |= {
            obj.info.name
            for obj in vars(mod).values()
            if callable(obj) and isinstance(getattr(obj, "info", None), AnalysisInfo)
        }
    registered = {info.name for infos in registry.ANALYSES.values() for info in infos}
    assert declared, "no @analysis found"
    assert declared == registered, f"declared but not registered: {sorted(declared - registered)}"
