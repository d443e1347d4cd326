"""Train a toy image classifier (prints accuracy per epoch)."""
import argparse

parser = argparse.ArgumentParser(description="toyvision classifier")
parser.add_argument("--dataset", choices=["mnist", "cifar10", "svhn"], default="mnist")
parser.add_argument("--arch", choices=["resnet18", "vgg11", "mobilenet"], default="resnet18")
parser.add_argument("--batch-size", type=int, default=32)
parser.add_argument("--epochs", type=int, default=1)
parser.add_argument("--lr", type=float, default=0.01)
parser.add_argument("--augment", action="store_true")
args = parser.parse_args()

acc = 0.1
for epoch in range(args.epochs):
    acc += (1 - acc) * min(args.lr * 5, 0.5)
    print(f"epoch {epoch} {args.arch} on {args.dataset}: accuracy {acc:.3f}")
