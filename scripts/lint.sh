#!/usr/bin/env bash
# Lint (ruff: style, bugs, import order) and type-check (mypy) the tree; .ci/run calls it before the tests and
# the pre-commit hooks run the same checks. Usage: bash scripts/lint.sh [ruff|mypy] (both when no argument).
#
# mypy cannot follow the editable install: pyproject.toml maps the stage folders into one namespace with
# setuptools' package-dir (eval/ -> mlbench_kit.eval, ...), which only the editable finder knows about, so
# `mypy -p mlbench_kit.eval` fails with "Can't find package". We therefore lay out the namespace as it is
# installed, as a tree of symlinks in build/typecheck/mlbench_kit (build/ is git-ignored), check that package,
# and print paths as they are in the repository again.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${MLBENCH_LINT_BIN:-.venv/bin}
what=${1:-all}

if [ "$what" = all ] || [ "$what" = ruff ]; then
  "$BIN/ruff" check .
fi

if [ "$what" = all ] || [ "$what" = mypy ]; then
  tree=build/typecheck
  rm -rf "$tree/mlbench_kit" && mkdir -p "$tree/mlbench_kit"
  for f in mlbench_kit/*.py; do ln -s "../../../$f" "$tree/$f"; done
  for d in mlbench_kit/*/; do  # the core's own subpackages (the sandbox)
    d=${d%/}; if [ -f "$d/__init__.py" ]; then ln -s "../../../$d" "$tree/$d"; fi
  done
  # the same mapping as [tool.setuptools] package-dir in pyproject.toml
  for stage in data_prep eval train infer slurm agent learn; do ln -s "../../../$stage" "$tree/mlbench_kit/$stage"; done
  MYPYPATH=$tree "$BIN/mypy" -p mlbench_kit 2>&1 | sed -e "s#^$tree/mlbench_kit/\(data_prep\|eval\|train\|infer\|slurm\|agent\|learn\)/#\1/#" \
                                                    -e "s#^$tree/mlbench_kit/#mlbench_kit/#"
  exit "${PIPESTATUS[0]}"
fi
