#!/usr/bin/env bash
# Create .venv and install mlbench-kit (editable) with its test dependencies. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null && ! command -v bwrap >/dev/null; then
  # bubblewrap is the sandbox eval/ uses; git is needed for repository checkouts
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq bubblewrap git) >/dev/null
fi
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q -e ".[dev]"
