import argparse

p = argparse.ArgumentParser()
p.add_argument("--dataset", default="cora", choices=["cora", "citeseer", "pubmed"])
p.add_argument("--layers", type=int, default=2)
p.add_argument("--hidden", type=int, default=16)
a = p.parse_args()
print(f"node classification on {a.dataset}: {a.layers} layers, hidden {a.hidden}")
