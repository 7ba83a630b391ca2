#!/usr/bin/env bash
# Builds the wheel (`pip wheel . --no-deps`) from a copy of the working tree without its build
# outputs, so a stale build/ never puts a deleted module into the wheel.
#
#   scripts/build_wheel.sh OUTDIR [pip wheel options, e.g. --no-build-isolation]
#
# Environment: PYTHON (default python3), whose pip builds the wheel.
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 1 ] || { echo "usage: scripts/build_wheel.sh OUTDIR [pip wheel options]" >&2; exit 2; }
out=$(mkdir -p "$1" && cd "$1" && pwd)
shift
src=$(mktemp -d)
trap 'rm -rf "$src"' EXIT
tar -c --exclude=.git --exclude='.venv*' --exclude=./build --exclude=./dist --exclude='*.egg-info' \
    --exclude=__pycache__ --exclude=./outputs --exclude=.pytest_cache --exclude=.hypothesis . | tar -x -C "$src"
cd "$src"
"${PYTHON:-python3}" -m pip wheel -q --disable-pip-version-check --no-deps -w "$out" "$@" .
