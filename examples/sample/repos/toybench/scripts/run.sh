#!/usr/bin/env bash
set -e
python train.py --dataset "${1:-cora}" --model "${2:-gcn}" --epochs 2
python evaluate.py --checkpoint out/model.json --split test
