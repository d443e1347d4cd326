#!/usr/bin/env bash
# The demo's first stage's pretraining (examples/tiny.py) on 1 torch thread against 2, in turn (1 2 1 2 ...) so that
# both meet the same load; prints each run's wall seconds and the median ratio 2-thread/1-thread. The demo uses 1.
#   bash bench/demo_stage1.sh [STEPS=200] [ROUNDS=3]
set -euo pipefail
cd "$(dirname "$0")/.."
STEPS=${1:-200}; ROUNDS=${2:-3}
PY=${PYTHON:-.venv/bin/python}
SAMPLE=examples/sample
work=$(mktemp -d "${TMPDIR:-/tmp}/mlbench-stage1.XXXXXX"); trap 'rm -rf "$work"' EXIT
echo "bench: $STEPS pretraining steps of the demo's tiny model, $ROUNDS rounds; load $(cut -d' ' -f1-3 /proc/loadavg)"
declare -A times=([1]="" [2]="")
for r in $(seq "$ROUNDS"); do
  for t in 1 2; do
    start=$(date +%s.%N)
    "$PY" examples/tiny.py --repos "$SAMPLE/repos" --out "$work/m$t-$r" --pretrain-steps "$STEPS" --threads "$t" \
      >/dev/null 2>&1
    s=$(echo "$(date +%s.%N) - $start" | bc)
    times[$t]+="$s "
    printf 'bench: round %d, %d thread(s): %.1f s\n' "$r" "$t" "$s"
  done
done
"$PY" - "${times[1]}" "${times[2]}" <<'PY'
import statistics
import sys
one, two = ([float(x) for x in a.split()] for a in sys.argv[1:3])
print(f"bench: median 1 thread {statistics.median(one):.1f} s, 2 threads {statistics.median(two):.1f} s, "
      f"ratio 2/1 {statistics.median(b / a for a, b in zip(one, two)):.2f}")
PY
