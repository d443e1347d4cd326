#!/usr/bin/env bash
# The main job on the embedded sample, with no network, GPU or downloaded data (a few minutes on 2 CPU cores):
#   tiny base model -> prep (tasks 1-3, ID split) -> LoRA training -> vLLM inference, base and fine-tuned
#   -> sandboxed execution check -> side-by-side report.
# The real thing on a GPU machine with network (see README):
#   bash scripts/demo.sh --data super-dainiu/ml-bench --model codellama/CodeLlama-7b-Instruct-hf
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=mlbench_kit/sample/samples.jsonl
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
SAMPLE=mlbench_kit/sample
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
  [ -f "$RUN/model/config.json" ] || "$BIN/python" -m mlbench_kit.tiny --sample $DATA --repos $SAMPLE/repos --out "$RUN/model"
  MODEL=$RUN/model; TRAIN_CFG=configs/train/tiny-cpu.yaml; INFER_CFG=configs/infer/tiny-cpu.yaml
  PREP_SRC=(--data $DATA --splits full --readmes $SAMPLE/repos --build-splits --id-test-fraction 0.3)
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
# 3. LoRA on the ID training split, task 3 (resumes if interrupted)
"$BIN/accelerate" launch --num_processes 1 --mixed_precision no --main_process_port 0 train/lora.py \
  --config $TRAIN_CFG --model "$MODEL" --prep-dir "$RUN/prep" --task 3 --split id --output-dir "$RUN/train" "${TRAIN_EXTRA[@]}"
# 4. generations (n=5) from the base model and from the fine-tuned adapter, with vLLM
"$BIN/mlbench" infer --model "$MODEL" --prompts "$RUN/prep" --split $TEST --task 3 --config $INFER_CFG \
  "${INFER_EXTRA[@]}" --out "$RUN/infer-base"
"$BIN/mlbench" infer --model "$MODEL" --adapter "$RUN/train/adapter" --prompts "$RUN/prep" --split $TEST --task 3 \
  --config $INFER_CFG "${INFER_EXTRA[@]}" --out "$RUN/infer-lora"
# 5. execute every generation in the sandbox (the paper's compat checks), then 6. the side-by-side report
for v in base lora; do
  "$BIN/mlbench" eval --data "$DATA" "${EVAL_SPLIT[@]}" --generations "$RUN/infer-$v/task3.jsonl" --envs $ENVS \
    --out "$RUN/eval-$v"
done
"$BIN/mlbench" report base="$RUN/eval-base" lora="$RUN/eval-lora" --out "$RUN/report"
echo
echo "demo done: $RUN"
sed -n '3,6p' "$RUN/report/report.md"
echo
echo "  $RUN/prep/        prompts for tasks 1-3 (stats: $RUN/prep/stats.md); test = the held-out ID samples"
echo "  $RUN/train/       LoRA adapter (adapter/), metrics.jsonl, checkpoints/, TensorBoard logs (tb/)"
echo "  $RUN/infer-*/     5 generations per test prompt (raw responses and parsed code), base and fine-tuned"
echo "  $RUN/eval-*/      every generation executed in the bwrap sandbox: results.jsonl, report.md"
echo "  $RUN/report/      report.md, report.csv, report.png: base vs fine-tuned"
echo "Pass@k counts a test sample solved when one of its first k outputs passes the parameter check, the type"
echo "check and runs cleanly; type_accuracy and param_hit_precision show what fine-tuning changed even when"
echo "a tiny model does not get every argument right."
