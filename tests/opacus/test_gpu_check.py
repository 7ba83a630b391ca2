"""scripts/gpu_check.sh (issue 13): refuses clearly without CUDA; the benchmarks it runs take
``--device`` and ``--output``. The GPU path itself needs hardware (run the script there)."""

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "gpu_check.sh"


def test_the_script_refuses_without_cuda_and_writes_nothing(tmp_path):
    torch = pytest.importorskip("torch")
    out = tmp_path / "figures.md"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PYTHON=sys.executable)
    res = subprocess.run(["bash", str(SCRIPT), str(out)], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode != 0
    assert "gpu_check: CUDA is not available" in res.stderr and torch.__version__ in res.stderr
    assert not out.exists()


def test_the_cuda_tests_carry_the_marker():
    """`pytest -m cuda` (what the script runs) selects the tests that need a GPU."""
    pytest.importorskip("torch")  # without torch and Opacus those test modules skip at collection
    pytest.importorskip("opacus")
    pytest.importorskip("sklearn")
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-p",
            "no:cacheprovider",
            "--collect-only",
            "-q",
            "-m",
            "cuda",
            "tests/opacus/test_sbcd_torch.py",
            "tests/opacus/test_opacus_example.py",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
    )
    assert "test_runs_on_cuda" in res.stdout and "test_example_trains_on_cuda" in res.stdout


@pytest.mark.parametrize("script", ["bench_sbcd_vs_opacus.py", "bench_opacus_overhead.py"])
def test_the_benchmarks_refuse_cuda_without_it(script):
    pytest.importorskip("opacus")
    extra = ["--clock", "wall"] if script == "bench_opacus_overhead.py" else []
    res = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), "--device", "cuda"] + extra,
        capture_output=True,
        text=True,
        env=dict(os.environ, CUDA_VISIBLE_DEVICES=""),
        timeout=300,
    )
    assert res.returncode == 2 and "--device cuda: CUDA is not available" in res.stderr


@pytest.mark.slow
def test_the_benchmarks_write_their_figures_on_cpu(tmp_path):
    """Tiny settings: the flags the script uses work (--device, --output)."""
    pytest.importorskip("opacus")
    table = tmp_path / "sbcd.md"
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bench_sbcd_vs_opacus.py"),
            "--n",
            "400",
            "--features",
            "16",
            "--width",
            "32",
            "--depth",
            "1",
            "--batch",
            "100",
            "--epochs",
            "1",
            "--device",
            "cpu",
            "--output",
            str(table),
        ],
        check=True,
        capture_output=True,
        timeout=600,
    )
    text = table.read_text()
    assert "device = cpu" in text and "| DP-SBCD (this package) |" in text and "| Opacus DP-SGD |" in text
    figures = tmp_path / "overhead.txt"
    subprocess.run(
        [
            sys.executable,
            str(ROOT / "benchmarks" / "bench_opacus_overhead.py"),
            "--steps",
            "20",
            "--device",
            "cpu",
            "--output",
            str(figures),
        ],
        check=True,
        capture_output=True,
        timeout=600,
    )
    text = figures.read_text()
    assert "device=cpu" in text and "adapter" in text and "get_epsilon after" in text
