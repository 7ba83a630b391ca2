#!/usr/bin/env bash
# Sets up .venv (core only, pinned to the tested set in constraints.txt) and runs the main job:
# the embedded MNIST-scale default.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/python -m pip install -q --disable-pip-version-check -c constraints.txt -e .
mkdir -p outputs
exec .venv/bin/hsa demo --output outputs/hsa_demo.png
