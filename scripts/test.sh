#!/usr/bin/env bash
# Sets up .venv with every extra, pinned to the tested set (constraints.txt), and runs the test
# suite; then scripts/test_newest.sh runs the core tests on the newest Python on the machine with
# numpy 2 and the newest dp-accounting, from the built wheel (HSA_SKIP_NEWEST=1 skips that).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt -e ".[all,dev]"
# lint and format first (ruff, pinned in constraints.txt; configured in pyproject.toml)
.venv/bin/ruff check .
.venv/bin/ruff format --check .
# the default suite; the long grids (pytest -m slow: exact-value grids over every schedule, the
# examples end to end; about an hour on 2 cores) run when HSA_SLOW=1, so CI stays under 30 minutes
if [ -n "${HSA_SLOW:-}" ]; then marks="slow or not slow"; else marks="not slow"; fi
.venv/bin/python -m pytest -q -p no:cacheprovider -m "$marks" "$@"
if [ -z "${HSA_SKIP_NEWEST:-}" ]; then
  ./scripts/test_newest.sh "$@"
fi
