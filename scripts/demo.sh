#!/usr/bin/env bash
# The main job on the embedded sample, with no network, GPU or downloaded data (a few minutes on 2 CPU cores):
#   tiny base model -> prep (tasks 1-3; test, ID-train and OOD-train splits) -> LoRA on the ID and on the OOD
#   split -> vLLM inference (base, ID-tuned, OOD-tuned) -> sandboxed execution check -> side-by-side report.
# The real thing on a GPU machine with network (see README):
#   bash scripts/demo.sh --data super-dainiu/ml-bench --model codellama/CodeLlama-7b-Instruct-hf
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=examples/sample/samples.jsonl
MODEL=""
while [ $# -gt 0 ]; do
  case "$1" in
    --data) DATA=$2; shift 2;;
    --model) MODEL=$2; shift 2;;
    *) echo "demo: unknown option $1 (use --data and --model)" >&2; exit 2;;
  esac
done
bash scripts/setup.sh
RUN=${RUN:-runs/demo}
SAMPLE=examples/sample
BIN=.venv/bin
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
mkdir -p "$RUN"
if "$BIN/python" -c "import nltk; nltk.data.find('tokenizers/punkt_tab/english')" 2>/dev/null; then
  SPLITTER=punkt
else
  SPLITTER=regex
  echo "demo: NLTK's Punkt model is not installed; task 2 uses the explicit regex splitter (not the paper's)." >&2
fi
if [ -z "$MODEL" ]; then
  # 1. a tiny Llama: tokenizer trained on the sample, weights pretrained briefly on its READMEs (never answers)
  [ -f "$RUN/model/config.json" ] || "$BIN/python" examples/tiny.py --sample $DATA --repos $SAMPLE/repos --out "$RUN/model"
  MODEL=$RUN/model; TRAIN_CFG=configs/train/tiny-cpu.yaml; INFER_CFG=configs/infer/tiny-cpu.yaml
  # toyvision is the out-of-distribution repository: its rows train the OOD adapter, none is in the test split
  PREP_SRC=(--data $DATA --splits full --readmes $SAMPLE/repos --build-splits --ood-repos toyvision
            --id-test-fraction 0.3)
  MAXTOK=1024; TRAIN_EXTRA=(--epochs 30 --set lora.r=16 --set lora.alpha=32 --set data.eval_fraction=0)
  INFER_EXTRA=(--temperature 0.2); EVAL_SPLIT=(); ENVS=configs/eval/sample.yaml
else
  TRAIN_CFG=configs/train/codellama-7b-instruct.yaml; INFER_CFG=configs/infer/paper.yaml
  PREP_SRC=(--data "$DATA" --splits full id_train ood_train --repos-dir repos --checkout ../shared/mlbench/repos.json)
  MAXTOK=8192; TRAIN_EXTRA=(); INFER_EXTRA=(); EVAL_SPLIT=(--split full); ENVS=configs/eval/mlbench.yaml
fi
# 2. prompts for tasks 1-3, cut to the model's budget with its own tokenizer
"$BIN/mlbench" prep "${PREP_SRC[@]}" --splitter $SPLITTER --tasks 1 2 3 --template llama-inst \
  --tokenizer "$MODEL" --max-tokens $MAXTOK --no-hf --out "$RUN/prep"
TEST=test; [ -d "$RUN/prep/test" ] || TEST=full
# 3. LoRA on the ID and on the OOD training split, task 3 (each resumes if interrupted)
for split in id ood; do
  "$BIN/accelerate" launch --num_processes 1 --mixed_precision no --main_process_port 0 train/lora.py \
    --config $TRAIN_CFG --model "$MODEL" --prep-dir "$RUN/prep" --task 3 --split $split --output-dir "$RUN/train-$split" \
    "${TRAIN_EXTRA[@]}"
done
# 4. generations (n=5) from the base model and from both adapters, with vLLM
"$BIN/mlbench" infer --model "$MODEL" --prompts "$RUN/prep" --split $TEST --task 3 --config $INFER_CFG \
  "${INFER_EXTRA[@]}" --out "$RUN/infer-base"
for split in id ood; do
  "$BIN/mlbench" infer --model "$MODEL" --adapter "$RUN/train-$split/adapter" --prompts "$RUN/prep" --split $TEST \
    --task 3 --config $INFER_CFG "${INFER_EXTRA[@]}" --out "$RUN/infer-$split"
done
# 5. execute every generation in the sandbox (the paper's compat checks), then 6. the side-by-side report
for v in base id ood; do
  "$BIN/mlbench" eval --data "$DATA" "${EVAL_SPLIT[@]}" --generations "$RUN/infer-$v/task3.jsonl" --envs $ENVS \
    --out "$RUN/eval-$v"
done
"$BIN/mlbench" report base="$RUN/eval-base" id-tuned="$RUN/eval-id" ood-tuned="$RUN/eval-ood" --out "$RUN/report"
echo
echo "demo done: $RUN"
sed -n '7,12p' "$RUN/report/report.md"
echo
sed -n '/^| setting | param hit/,/^$/p' "$RUN/report/report.md"
echo
echo "  $RUN/prep/        prompts for tasks 1-3 (stats: $RUN/prep/stats.md); test = held-out samples of the ID repository"
echo "  $RUN/train-id/    LoRA adapter trained on the ID split (adapter/), metrics.jsonl, checkpoints/, TensorBoard (tb/)"
echo "  $RUN/train-ood/   the same on the OOD split (another repository only)"
echo "  $RUN/infer-*/     5 generations per test prompt (raw responses and parsed code): base, ID-tuned, OOD-tuned"
echo "  $RUN/eval-*/      every generation executed in the bwrap sandbox: results.jsonl, report.md"
echo "  $RUN/report/      report.md, report.csv, report.png, report_repos.png: the three side by side"
echo "Pass@k counts a test sample solved when one of its first k outputs passes the parameter check, the type"
echo "check and runs cleanly; type accuracy and parameter hit precision show what fine-tuning changed even when"
echo "a tiny model does not get every argument right. OOD-tuned saw only another repository, as in the paper."
