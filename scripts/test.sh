#!/usr/bin/env bash
# The project's test command (README quickstart, and what .ci/run calls): set up, then run pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
export NLTK_DATA=${NLTK_DATA:-$(cd .. && pwd)/shared/mlbench/nltk_data}
exec .venv/bin/python -m pytest "$@"
