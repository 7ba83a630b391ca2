#!/usr/bin/env bash
# Sets up .venv from the project's own files (pinned extras) and runs the test suite,
# then runs the core tests once more against the newest dp-accounting release.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[all,dev]"
# the default suite; the long grids (pytest -m slow: exact-value grids over every schedule, the
# examples end to end; about an hour on 2 cores) run when HSA_SLOW=1, so CI stays under 30 minutes
if [ -n "${HSA_SLOW:-}" ]; then marks="slow or not slow"; else marks="not slow"; fi
.venv/bin/python -m pytest -q -p no:cacheprovider -m "$marks" "$@"
if [ -z "${HSA_SKIP_NEWEST:-}" ]; then
  # the core works with dp-accounting 0.4.3 (TF-Privacy's pin) and the newest release
  python3 -m venv .venv-newest
  .venv-newest/bin/python -m pip install -q --disable-pip-version-check -e ".[dev]"
  .venv-newest/bin/python -m pip install -q --disable-pip-version-check -U dp-accounting
  .venv-newest/bin/python -m pytest -q -p no:cacheprovider "$@"
fi
