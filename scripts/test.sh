#!/usr/bin/env bash
# Sets up .venv from the project's own files (pinned extras) and runs the test suite,
# then runs the core tests once more against the newest dp-accounting release.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[all,dev]"
# the long tests (examples end to end) too: the whole run stays well under CI's 30 minutes
.venv/bin/python -m pytest -q -m "slow or not slow" "$@"
if [ -z "${HSA_SKIP_NEWEST:-}" ]; then
  # the core works with dp-accounting 0.4.3 (TF-Privacy's pin) and the newest release
  python3 -m venv .venv-newest
  .venv-newest/bin/python -m pip install -q --disable-pip-version-check -e ".[dev]"
  .venv-newest/bin/python -m pip install -q --disable-pip-version-check -U dp-accounting
  .venv-newest/bin/python -m pytest -q -p no:cacheprovider "$@"
fi
