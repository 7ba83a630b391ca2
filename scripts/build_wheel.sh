#!/usr/bin/env bash
# Builds the wheel (`pip wheel . --no-deps`) from a copy of the working tree without its build
# outputs, so a stale build/ never puts a deleted module into the wheel.
#
#   scripts/build_wheel.sh OUTDIR [pip wheel options, e.g. --no-build-isolation]
#
# Environment: PYTHON (default python3), whose pip builds the wheel.
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: scripts/build_wheel.sh OUTDIR [pip wheel options]" >&2; exit 2; }
out=$(mkdir -p "$1" && cd "$1" && pwd)
py=${PYTHON:-python3}
case $py in */*) py=$(cd "$(dirname "$py")" && pwd)/$(basename "$py") ;; esac  # before any cd
cd "$(dirname "$0")/.."
shift
src=$(mktemp -d)
trap 'rm -rf "$src"' EXIT
tar -c --exclude=.git --exclude='.venv*' --exclude=./build --exclude=./dist --exclude='*.egg-info' \
    --exclude=__pycache__ --exclude=./outputs --exclude=.pytest_cache --exclude=.hypothesis . | tar -x -C "$src"
cd "$src"
"$py" -m pip wheel -q --disable-pip-version-check --no-deps -w "$out" "$@" .
