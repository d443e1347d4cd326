#!/usr/bin/env bash
# The main job on the embedded sample, with no network, GPU or downloaded data:
#   prep (tasks 1-3) -> sandboxed execution check of the ground truth and of a noisy generations file -> report.
# Train and infer stages join this script as they land.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
RUN=${RUN:-runs/demo}
SAMPLE=mlbench_kit/sample
BIN=.venv/bin
if "$BIN/python" -c "import nltk; nltk.data.find('tokenizers/punkt_tab/english')" 2>/dev/null; then
  SPLITTER=punkt
else
  SPLITTER=regex
  echo "demo: NLTK's Punkt model is not installed; task 2 uses the explicit regex splitter (not the paper's)." >&2
fi
"$BIN/mlbench" prep --data $SAMPLE/samples.jsonl --splits full --readmes $SAMPLE/repos --splitter $SPLITTER \
  --build-splits --id-test-fraction 0.5 --out "$RUN/prep"
"$BIN/mlbench" eval --data $SAMPLE/samples.jsonl --gold --envs configs/eval/sample.yaml --out "$RUN/eval-gold"
"$BIN/python" - "$RUN" <<'PY'
import json, sys
from pathlib import Path
run = Path(sys.argv[1])
# A stand-in generations file until infer/ lands: per sample, 5 outputs of decreasing quality.
rows = [json.loads(x) for x in open("mlbench_kit/sample/samples.jsonl")]
with open(run / "noisy-generations.jsonl", "w") as fh:
    for r in rows:
        gt = r["output"]
        outs = ["echo I do not know", gt.replace("--", "--no-such-", 1), gt, gt, gt]
        fh.write(json.dumps({"github_id": r["github_id"], "id": r["id"], "output": outs}) + "\n")
PY
"$BIN/mlbench" eval --data $SAMPLE/samples.jsonl --generations "$RUN/noisy-generations.jsonl" \
  --envs configs/eval/sample.yaml --mode strict --static-gate --out "$RUN/eval-noisy"
echo
echo "demo done. Files:"
echo "  $RUN/prep/<split>/task{1,2,3}.jsonl   rendered prompts (stats: $RUN/prep/stats.md)"
echo "  $RUN/eval-gold/report.md             ground truth executed in the sandbox (should be all passes)"
echo "  $RUN/eval-noisy/report.md            5 outputs/sample: wrong type, unknown option, then correct ->"
echo "                                       Pass@1 0, Pass@5 1; error classes E1/E2 explain the misses"
