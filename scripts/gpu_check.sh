#!/usr/bin/env bash
# GPU check (issue 13): on a machine with CUDA, runs the CUDA-marked tests (pytest -m cuda),
# the DP-SBCD vs Opacus benchmark and the Opacus overhead benchmark on the GPU, and writes their
# figures, the device name (torch.cuda.get_device_name) and the versions to one Markdown file.
#
#   scripts/gpu_check.sh                  # writes gpu_figures.md
#   scripts/gpu_check.sh OUT.md           # writes OUT.md
#
# Environment: PYTHON (default .venv/bin/python), GPU_CHECK_DEVICE (default cuda),
# GPU_CHECK_SBCD_ARGS / GPU_CHECK_OVERHEAD_ARGS (extra benchmark arguments, e.g. smaller sizes).
# Exits non-zero, with a message, when CUDA is not available or any step fails; the file is
# then not written (nothing half-measured is left behind).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
OUT=${1:-gpu_figures.md}
DEVICE=${GPU_CHECK_DEVICE:-cuda}

fail() { echo "gpu_check: $*" >&2; exit 1; }

[ -x "$PY" ] || command -v "$PY" >/dev/null 2>&1 || fail "no Python at $PY (set PYTHON, or run scripts/test.sh to make .venv)"
"$PY" -c "import torch" 2>/dev/null || fail "torch is not installed for $PY (pip install -e '.[opacus,dev]')"
if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  version=$("$PY" -c "import torch; print(torch.__version__, 'built with CUDA', torch.version.cuda)")
  fail "CUDA is not available (torch.cuda.is_available() is False; torch $version). This script needs a CUDA GPU and a CUDA build of torch; nothing was measured."
fi

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT

echo "gpu_check: versions and device" >&2
"$PY" - "$DEVICE" > "$work/head.md" <<'PYEOF'
import platform, sys
import torch
device = torch.device(sys.argv[1])
from importlib import metadata
def version(name):
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "not installed"
props = torch.cuda.get_device_properties(device)
print("# GPU figures\n")
print(f"- device: {torch.cuda.get_device_name(device)} ({props.total_memory / 2**30:.1f} GiB, "
      f"compute capability {props.major}.{props.minor})")
print(f"- torch {torch.__version__} (CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}), "
      f"opacus {version('opacus')}, tensorflow {version('tensorflow')}, "
      f"hidden-state-accountants {version('hidden-state-accountants')}")
print(f"- python {platform.python_version()}, {platform.platform()}")
PYEOF
if command -v nvidia-smi >/dev/null 2>&1; then
  driver=$(nvidia-smi --query-gpu=driver_version --format=csv,noheader 2>/dev/null | head -1 || true)
  [ -n "$driver" ] && echo "- NVIDIA driver $driver" >> "$work/head.md"
fi

echo "gpu_check: CUDA-marked tests (pytest -m cuda)" >&2
set +e
"$PY" -m pytest -p no:cacheprovider -q -rs -m cuda tests > "$work/tests.txt" 2>&1
tests_rc=$?
set -e
cat "$work/tests.txt" >&2
[ $tests_rc -eq 0 ] || fail "the CUDA tests failed (pytest exit $tests_rc); see the output above"
grep -q " passed" "$work/tests.txt" || fail "no CUDA test ran (all skipped or none selected)"
! grep -qi "skipped" "$work/tests.txt" || fail "some CUDA tests were skipped on a machine with CUDA; see above"

echo "gpu_check: benchmarks/bench_sbcd_vs_opacus.py --device $DEVICE" >&2
# shellcheck disable=SC2086  # the extra arguments are meant to split
"$PY" benchmarks/bench_sbcd_vs_opacus.py --device "$DEVICE" --output "$work/sbcd.md" ${GPU_CHECK_SBCD_ARGS:-} >&2 \
  || fail "bench_sbcd_vs_opacus.py failed"
echo "gpu_check: benchmarks/bench_opacus_overhead.py --device $DEVICE --clock wall" >&2
# shellcheck disable=SC2086
"$PY" benchmarks/bench_opacus_overhead.py --device "$DEVICE" --clock wall --output "$work/overhead.txt" \
  ${GPU_CHECK_OVERHEAD_ARGS:-} >&2 || fail "bench_opacus_overhead.py failed"

{
  cat "$work/head.md"
  echo
  echo "## CUDA-marked tests"
  echo
  echo '```'
  tail -n 5 "$work/tests.txt"
  echo '```'
  echo
  echo "## DP-SBCD vs Opacus (benchmarks/bench_sbcd_vs_opacus.py --device $DEVICE ${GPU_CHECK_SBCD_ARGS:-})"
  echo
  cat "$work/sbcd.md"
  echo
  echo "## Opacus adapter overhead (benchmarks/bench_opacus_overhead.py --device $DEVICE --clock wall ${GPU_CHECK_OVERHEAD_ARGS:-})"
  echo
  echo '```'
  cat "$work/overhead.txt"
  echo '```'
} > "$OUT"
echo "gpu_check: wrote $OUT" >&2
