"""The built wheel (issue 22): it holds the core and every adapter (checked against the source tree,
so a new module cannot be left out), its metadata declares ranges and no pins, and it reports the
version the code reports. The slow test installs it into a fresh virtual environment and runs
``hsa`` from there; scripts/test_newest.sh does the same in CI with the dependencies installed by
pip."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import venv
import zipfile
from email.parser import Parser

import pytest

import hidden_state_accountants
from hidden_state_accountants.cli import main

ROOT = pathlib.Path(__file__).resolve().parents[2]
CORE = "hidden_state_accountants"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> pathlib.Path:
    pytest.importorskip("setuptools", reason="building the wheel without isolation needs setuptools (the dev extra)")
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run(
        ["bash", str(ROOT / "scripts" / "build_wheel.sh"), str(out), "--no-build-isolation"],
        check=True,
        env={**os.environ, "PYTHON": sys.executable},
    )
    (built,) = out.glob(f"{CORE}-*.whl")
    return built


def _source_modules() -> set:
    """Where each source file must land in the wheel: the core as it is, adapters/<name>/... and
    training/<name>/... under hidden_state_accountants/<name>/...."""
    core = {p.relative_to(ROOT).as_posix() for p in (ROOT / CORE).rglob("*.py")}
    framework = {
        f"{CORE}/{p.relative_to(ROOT / root).as_posix()}"
        for root in ("adapters", "training")
        for p in (ROOT / root).rglob("*.py")
    }
    return {m for m in core | framework if "__pycache__" not in m}


def _metadata(wheel: pathlib.Path):
    with zipfile.ZipFile(wheel) as z:
        (name,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        meta = Parser().parsestr(z.read(name).decode())
        (ep,) = [n for n in z.namelist() if n.endswith(".dist-info/entry_points.txt")]
        return meta, z.read(ep).decode()


def test_wheel_holds_the_core_and_every_adapter(wheel):
    with zipfile.ZipFile(wheel) as z:
        names = set(z.namelist())
    expected = _source_modules()
    for adapter in ("opacus", "pytorch", "tf_privacy", "keras"):  # the mapping itself, not only the walk
        assert f"{CORE}/{adapter}/__init__.py" in expected
    assert f"{CORE}/analyses/__init__.py" in expected
    missing = sorted(expected - names)
    assert not missing, f"source modules missing from the wheel: {missing}"
    modules = {n for n in names if n.endswith(".py")}
    assert modules == expected, f"modules in the wheel with no source: {sorted(modules - expected)}"
    # nothing at the top level but the package and its metadata (no `adapters`, `training`, tests)
    assert {n.split("/")[0] for n in names} == {CORE, f"{CORE}-{hidden_state_accountants.__version__}.dist-info"}


def test_wheel_metadata_declares_ranges_and_the_code_version(wheel):
    meta, entry_points = _metadata(wheel)
    assert meta["Version"] == hidden_state_accountants.__version__
    assert meta["Requires-Python"] == ">=3.10"
    requires = meta.get_all("Requires-Dist")
    specifiers = [r.split(";")[0] for r in requires]  # the part before any marker (extra == "...")
    assert specifiers and not [s for s in specifiers if "==" in s], specifiers
    core = {r.split(";")[0].strip() for r in requires if ";" not in r}
    assert {r.split(">")[0].split("<")[0] for r in core} >= {"dp-accounting", "numpy", "scipy", "matplotlib"}
    assert not [r for r in core if r.startswith("numpy") and "<" in r], "numpy 2 works: no upper bound"
    assert "hsa = hidden_state_accountants.cli:main" in entry_points


def test_hsa_version(capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"hsa {hidden_state_accountants.__version__}"


def _site_dirs() -> list:
    return [p for p in sys.path if p.endswith(("site-packages", "dist-packages")) and os.path.isdir(p)]


@pytest.mark.slow
def test_wheel_installs_into_a_fresh_environment_and_runs(wheel, tmp_path):
    """The wheel alone, in a fresh venv whose dependencies are this environment's (a .pth file, no
    network): ``hsa --version`` and ``hsa demo`` run from it, and each adapter whose framework is
    installed here imports from it."""
    env_dir = tmp_path / "fresh"
    venv.create(env_dir, with_pip=True)
    python = env_dir / "bin" / "python"
    subprocess.run(
        [str(python), "-m", "pip", "install", "-q", "--no-deps", "--disable-pip-version-check", str(wheel)], check=True
    )
    purelib = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.strip()
    # after the venv's own site-packages, so the wheel's copy wins over any other
    pathlib.Path(purelib, "zz_dependencies.pth").write_text("\n".join(_site_dirs()) + "\n")
    run = dict(cwd=tmp_path, check=True, capture_output=True, text=True)  # outside the source tree
    hsa = str(env_dir / "bin" / "hsa")
    assert subprocess.run([hsa, "--version"], **run).stdout.strip() == f"hsa {hidden_state_accountants.__version__}"
    demo = subprocess.run([hsa, "demo", "--output", str(tmp_path / "demo.png")], **run)
    assert "hidden-state" in demo.stdout and (tmp_path / "demo.png").stat().st_size > 0
    adapters = [
        name
        for name, needs in (("opacus", "opacus"), ("pytorch", "torch"), ("tf_privacy", "tensorflow_privacy"))
        if subprocess.run([sys.executable, "-c", f"import {needs}"], capture_output=True).returncode == 0
    ]
    check = f"import sys, {CORE} as h\nassert h.__file__.startswith(sys.prefix), h.__file__\n" + "".join(
        f"import {CORE}.{a}\n" for a in adapters
    )
    subprocess.run([str(python), "-c", check], **run)
