"""The layout's promise: one folder per stage, one core package of contracts, and no stage importing another."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STAGES = {"data_prep": "data_prep", "train": "train", "infer": "infer", "eval": "eval", "slurm": "slurm"}


def _imports(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
    return out


def stage_violations(root: Path = ROOT) -> list[str]:
    """Every import of another stage's module from inside a stage folder, as file:line."""
    bad = []
    for folder, stage in STAGES.items():
        for f in sorted((root / folder).rglob("*.py")):
            for line, mod in _imports(f):
                parts = mod.split(".")
                if parts[0] == "mlbench_kit" and len(parts) > 1 and parts[1] in STAGES.values() and parts[1] != stage:
                    bad.append(f"{f.relative_to(root)}:{line} imports {mod}")
    return bad


def test_no_stage_imports_another_stage():
    assert stage_violations() == []


def test_the_check_sees_a_violation(tmp_path):
    for folder in STAGES:
        (tmp_path / folder).mkdir()
    (tmp_path / "infer" / "run.py").write_text("from mlbench_kit.eval.parse import parse_response\n")
    assert stage_violations(tmp_path) == ["infer/run.py:1 imports mlbench_kit.eval.parse"]
