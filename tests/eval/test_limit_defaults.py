"""One execution's limit defaults are written once, in the sandbox's ``Limits``: eval's config and its scoring
rules refer to them, so the three cannot drift apart (they were three copies)."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import REPO_ROOT

from mlbench_kit.eval.scoring import ScoringRules
from mlbench_kit.eval_config import EvalConfig
from mlbench_kit.sandbox import Limits

LIMITS = ("mem_mb", "pids", "cpus", "disk_mb")


def literal_limit_defaults(root: Path) -> list[str]:
    """Each dataclass field of the core and of eval named as one of :data:`LIMITS` whose default is written as a
    literal, as ``file:Class.field``."""
    found = []
    for f in sorted([*(root / "mlbench_kit").rglob("*.py"), *(root / "eval").rglob("*.py")]):
        for cls in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            if not isinstance(cls, ast.ClassDef) or not any("dataclass" in ast.unparse(d) for d in cls.decorator_list):
                continue
            for node in cls.body:
                if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) \
                        and node.target.id in LIMITS and isinstance(node.value, ast.Constant):
                    found.append(f"{f.relative_to(root)}:{cls.name}.{node.target.id}")
    return found


def test_the_limit_defaults_are_written_once() -> None:
    assert literal_limit_defaults(REPO_ROOT) == [f"mlbench_kit/sandbox/spec.py:Limits.{k}" for k in LIMITS]


def test_the_check_sees_a_second_copy(tmp_path: Path) -> None:
    (tmp_path / "mlbench_kit").mkdir()
    (tmp_path / "eval").mkdir()
    (tmp_path / "eval" / "run.py").write_text("@dataclass(frozen=True)\nclass Rules:\n    mem_mb: int = 8192\n"
                                              "    pids: int = Limits.pids\n")
    assert literal_limit_defaults(tmp_path) == ["eval/run.py:Rules.mem_mb"]


def test_eval_runs_under_the_sandbox_s_defaults() -> None:
    cfg = EvalConfig()
    assert {k: getattr(cfg, k) for k in LIMITS} == {k: getattr(Limits(), k) for k in LIMITS}
    # the clock is eval's own choice (cpu; the sandbox's default, wall, is the agent's and the probes')
    assert ScoringRules.from_config(cfg, threads=3).limits == Limits(threads=3, clock=cfg.limit_clock)
