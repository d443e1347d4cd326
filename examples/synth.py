"""Synthetic instruction -> command pairs for the demo, made from the fixture repositories' own interfaces.

Every argparse script of a fixture repository (read by AST, never run) and every public function of its Python
package gives pairs with random values: ``python train.py --dataset citeseer --lr 0.02`` with an instruction
that asks for exactly those values, and the README section that documents the script as context. Pairs whose
values repeat a row of the embedded sample (any split, so no test answer or its argument combination) are
dropped. The rows have the benchmark's columns, so `mlbench prep` renders them like any other.

    python examples/synth.py --sample examples/sample/samples.jsonl --repos examples/sample/repos --out DIR
"""

from __future__ import annotations

import argparse
import ast
import json
import random
from pathlib import Path

REPOS = {"toybench": (101, "https://github.com/mlbench-kit/toybench"),
         "toyvision": (102, "https://github.com/mlbench-kit/toyvision")}
FLOATS = ["0.001", "0.002", "0.005", "0.01", "0.02", "0.03", "0.05", "0.1", "0.2", "0.3", "0.5"]
SIZES = ["8", "16", "32", "64", "128", "256"]
WORDS = {"lr": "learning rate", "batch-size": "batch size", "n-samples": "number of samples",
         "out-dir": "output folder", "hidden": "hidden size", "epochs": "epochs", "layers": "layers",
         "dropout": "dropout", "arch": "architecture", "width": "width", "kind": "model", "seed": "seed",
         "split": "split"}
# how people ask for an option's value, several ways each ({v}: the value, {V}: upper-cased)
PHRASES = {
    "dataset": ["on the {v} dataset", "on {v}", "using the {v} data", "with dataset {v}"],
    "model": ["a {V} model", "with the {V} model", "using {V}", "model {v}"],
    "arch": ["a {v} network", "with the {v} architecture", "using {v}"],
    "lr": ["with a learning rate of {v}", "with learning rate {v}", "lr {v}"],
    "epochs": ["for {v} epochs", "{v} epochs", "over {v} epochs"],
    "hidden": ["with a hidden size of {v}", "hidden size {v}", "{v} hidden units"],
    "layers": ["using {v} layers", "with {v} layers", "{v} layers deep"],
    "dropout": ["with dropout {v}", "dropout of {v}"],
    "batch-size": ["with a batch size of {v}", "batch size {v}"],
    "n-samples": ["{v} images", "{v} samples"],
    "out-dir": ["saved in the folder {v}", "into {v}"],
}
BASH_TEMPLATES = ["{purpose} {phrases}.", "Please {purpose_l} {phrases}.", "I need to {purpose_l} {phrases}.",
                  "Run {script} {phrases}."]
PY_TEMPLATES = [
    "Write Python that calls {func} with {pairs} and prints the result.",
    "Use {func} from {pkg} with {pairs}, then print it.",
]


def _options(script: Path) -> list[dict]:
    """The ``add_argument`` calls of a script: flag, choices, type, store_true (by AST, never imported)."""
    out = []
    for node in ast.walk(ast.parse(script.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", "") == "add_argument" and node.args:
            flag = getattr(node.args[0], "value", None)
            if not isinstance(flag, str) or not flag.startswith("--"):
                continue
            kw = {k.arg: k.value for k in node.keywords}
            if "required" in kw:
                return []  # a script with required options is left out: its pairs would need them all
            opt = {"flag": flag[2:], "choices": None, "type": "str", "store_true": False}
            if isinstance(kw.get("choices"), (ast.List, ast.Tuple)):
                opt["choices"] = [e.value for e in kw["choices"].elts]
            if isinstance(kw.get("type"), ast.Name):
                opt["type"] = kw["type"].id
            if getattr(kw.get("action"), "value", None) == "store_true":
                opt["store_true"] = True
            out.append(opt)
    return out


def _value(opt: dict, rng: random.Random) -> str:
    if opt["choices"]:
        return str(rng.choice(opt["choices"]))
    if opt["type"] == "float":
        return rng.choice(FLOATS)
    if opt["type"] == "int":
        if opt["flag"] in ("hidden", "batch-size", "width", "n-samples"):
            return rng.choice(SIZES)
        return str(rng.randint(1, 9))
    return rng.choice(["runs", "outputs", "samples_dir", "results", "my_out"])


def _section(readme: str, name: str) -> str:
    """The README paragraph(s) that mention ``name``: the oracle segment of a synthetic row."""
    paras = [p for p in readme.split("\n\n") if name in p]
    return "\n\n".join(paras[:2]) or readme[:600]


def _phrase(pairs: list[tuple[str, str]], rng: random.Random | None = None) -> str:
    """How a person asks for these values: the option's own phrasing where one is known."""
    parts = []
    for k, v in pairs:
        if v.startswith("--"):
            parts.append(f"with {WORDS.get(k, k)} turned on" if k in WORDS else f"with {k} turned on")
        elif rng is not None and k in PHRASES:
            parts.append(rng.choice(PHRASES[k]).format(v=v, V=v.upper()))
        else:
            parts.append(f"{WORDS.get(k, k)} {v}")
    return ", ".join(parts[:-1]) + (" and " if len(parts) > 1 else "") + parts[-1]


def _purpose(script: Path) -> str:
    """What a script is for, from its docstring or argparse description ("Train a toy model")."""
    tree = ast.parse(script.read_text())
    doc = ast.get_docstring(tree)
    if doc:
        return doc.splitlines()[0].split("(")[0].strip().rstrip(".")
    for node in ast.walk(tree):
        for kw in getattr(node, "keywords", []):
            if kw.arg == "description" and isinstance(kw.value, ast.Constant):
                return str(kw.value.value).capitalize()
    return f"Run {script.name}"


def script_pairs(repo: Path, rng: random.Random, n: int) -> list[dict]:
    """Shell commands for every argparse script of ``repo``."""
    readme_of = {p.parent: p.read_text() for p in repo.rglob("README.md")}
    rows = []
    scripts = [s for s in sorted(repo.rglob("*.py")) if len(_options(s)) >= 2]
    for i in range(n):
        script = scripts[i % len(scripts)]
        opts = [o for o in _options(script) if o["flag"] != "seed"]
        chosen = rng.sample(opts, k=rng.randint(2, min(4, len(opts))))
        pairs = [(o["flag"], f"--{o['flag']}" if o["store_true"] else _value(o, rng)) for o in chosen]
        argv = " ".join(v if v.startswith("--") else f"--{k} {v}" for k, v in pairs)
        folder = script.parent
        readme = readme_of.get(folder) or readme_of.get(repo, "")
        purpose = _purpose(script)
        instruction = rng.choice(BASH_TEMPLATES).format(script=script.name, purpose=purpose,
                                                        phrases=_phrase(pairs, rng),
                                                        purpose_l=purpose[0].lower() + purpose[1:])
        rows.append({"path": "./" + str(folder.relative_to(repo)) if folder != repo else "./",
                     "arguments": {k: v for k, v in pairs}, "instruction": instruction,
                     "oracle": _section(readme, script.name), "type": "Bash Script",
                     "output": f"python {script.name} {argv}"})
    return rows


def python_pairs(repo: Path, rng: random.Random, n: int) -> list[dict]:
    """Python snippets for the public functions of the repository's package (``pkg/__init__.py``)."""
    rows = []
    readme = (repo / "README.md").read_text()
    for init in sorted(repo.glob("*/__init__.py")):
        pkg = init.parent.name
        for fn in [f for f in ast.parse(init.read_text()).body if isinstance(f, ast.FunctionDef)
                   and not f.name.startswith("_")]:
            # the class the function builds names the allowed first argument (its `in (...)` check)
            allowed = [e.value for node in ast.walk(ast.parse(init.read_text())) if isinstance(node, ast.Tuple)
                       for e in node.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
            first, rest = fn.args.args[0].arg, [a.arg for a in fn.args.args[1:]]
            obj = "net" if "backbone" in fn.name else "model"
            method = "summary" if "backbone" in fn.name else "describe"
            for _ in range(n):
                kind = rng.choice(allowed)
                vals = {a: rng.choice(SIZES) if a in ("hidden", "width") else str(rng.randint(1, 6)) for a in rest}
                pairs = [(first, kind), *vals.items()]
                call = f'{fn.name}("{kind}", ' + ", ".join(f"{a}={v}" for a, v in vals.items()) + ")"
                rows.append({"path": "./", "arguments": dict(pairs),
                             "instruction": rng.choice(PY_TEMPLATES).format(func=fn.name, pkg=pkg,
                                                                            pairs=_phrase(pairs)),
                             "oracle": _section(readme, fn.name), "type": "Python Code",
                             "output": f"from {pkg} import {fn.name}\n{obj} = {call}\nprint({obj}.{method}())"})
    return rows


def sample_combinations(sample: Path) -> set[tuple]:
    """(repository, sorted argument values) of every row of the sample: what synthetic rows must not repeat."""
    out = set()
    for line in sample.open():
        r = json.loads(line)
        args = ast.literal_eval(r["arguments"]) if isinstance(r["arguments"], str) else r["arguments"]
        out.add((r["github_id"], tuple(sorted(str(v) for v in args.values()))))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sample", required=True)
    p.add_argument("--repos", required=True)
    p.add_argument("--out", required=True, help="folder: synthetic-<repo>.jsonl per fixture repository")
    p.add_argument("--per-repo", type=int, default=120, help="shell pairs per repository (Python pairs: a third)")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    rng = random.Random(a.seed)
    banned = sample_combinations(Path(a.sample))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    next_id = 20000
    for name, (gid, url) in REPOS.items():
        repo = Path(a.repos) / name
        rows = script_pairs(repo, rng, a.per_repo) + python_pairs(repo, rng, a.per_repo // 6)
        kept, seen = [], set()
        for r in rows:
            key = (gid, tuple(sorted(r["arguments"].values())))
            if key in banned or r["output"] in seen:
                continue
            seen.add(r["output"])
            kept.append({"github_id": gid, "github": url, "repo_id": len(kept), "id": next_id, **r,
                         "arguments": repr(r["arguments"]), "prefix_code": ""})
            next_id += 1
        with (out / f"synthetic-{name}.jsonl").open("w") as fh:
            fh.writelines(json.dumps(r) + "\n" for r in kept)
        print(f"synth: {len(kept)} pairs for {name} ({len(rows) - len(kept)} dropped: repeats or sample combinations)")


if __name__ == "__main__":
    main()
