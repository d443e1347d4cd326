"""Sample toy images from a generator into a folder (one text file per image)."""
import argparse
import os

parser = argparse.ArgumentParser(description="toyvision sampler")
parser.add_argument("--model", choices=["dcgan", "wgan"], default="dcgan")
parser.add_argument("--n-samples", type=int, default=4)
parser.add_argument("--out-dir", default="samples")
args = parser.parse_args()

os.makedirs(args.out_dir, exist_ok=True)
for i in range(args.n_samples):
    with open(os.path.join(args.out_dir, f"{args.model}_{i}.txt"), "w") as fh:
        fh.write(f"{args.model} image {i}\n")
print(f"wrote {args.n_samples} {args.model} samples to {args.out_dir}")
