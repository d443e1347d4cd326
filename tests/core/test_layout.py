"""The layout's promise: one folder per stage, one core package of contracts, no stage importing another, and
eval/'s wings importing one way only."""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
STAGES = {"data_prep": "data_prep", "train": "train", "infer": "infer", "eval": "eval", "slurm": "slurm",
          "agent": "agent", "learn": "learn"}
# eval/'s wings and the wings each may import; "scoring" is everything at the top of eval/ (run.py, envcli.py, ...)
WINGS = {"envs": set(), "report": set(), "scoring": {"envs"}}


def _package(path: Path, root: Path) -> str:
    """The installed package a file belongs to: ``eval/envs/build.py`` -> ``mlbench_kit.eval.envs``;
    ``mlbench_kit/sandbox/x.py`` -> ``mlbench_kit.sandbox``."""
    parts = path.parent.relative_to(root).parts
    return ".".join(parts if parts[:1] == ("mlbench_kit",) else ["mlbench_kit", *parts])


def _imports(path: Path, root: Path) -> list[tuple[int, str, tuple[str, ...]]]:
    """``(line, module, names)`` of every import in ``path``; relative imports are resolved against the file's
    package (``from ..infer import x`` in ``eval/run.py`` is ``mlbench_kit.infer``)."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name, ()) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                parts = _package(path, root).split(".")
                base = parts[: len(parts) - node.level + 1]
                module = ".".join(base + ([module] if module else []))
            out.append((node.lineno, module, tuple(a.name for a in node.names if a.name != "*")))
    return out


def _targets(module: str, names: tuple[str, ...]) -> list[str]:
    """What one import reaches: ``from mlbench_kit import eval`` reaches ``mlbench_kit.eval``."""
    return [module, *(f"{module}.{n}" for n in names)]


def stage_violations(root: Path = ROOT) -> list[str]:
    """Every import of another stage's module from inside a stage folder, as file:line."""
    bad = []
    for folder, stage in STAGES.items():
        for f in sorted((root / folder).rglob("*.py")):
            for line, mod, names in _imports(f, root):
                for target in _targets(mod, names):
                    parts = target.split(".")
                    if parts[0] == "mlbench_kit" and len(parts) > 1 and parts[1] in STAGES.values() \
                            and parts[1] != stage:
                        bad.append(f"{f.relative_to(root)}:{line} imports {target}")
                        break
    return bad


def _wing(module: str) -> str | None:
    """The eval wing of a module (None outside eval/): ``mlbench_kit.sandbox.cgroups`` -> ``sandbox``."""
    parts = module.split(".")
    if parts[:2] != ["mlbench_kit", "eval"]:
        return None
    return parts[2] if len(parts) > 2 and parts[2] in WINGS else "scoring"


def wing_violations(root: Path = ROOT) -> list[str]:
    """Every import inside eval/ that goes against the wings' direction, as file:line."""
    bad = []
    for f in sorted((root / "eval").rglob("*.py")):
        own = _wing(_package(f, root) + "." + f.stem)
        for line, mod, names in _imports(f, root):
            # ``from . import cgroups`` reaches the submodule; ``from .sandbox import Env`` the sandbox wing
            for target in [f"{mod}.{n}" for n in names] or [mod]:
                wing = _wing(target)
                if wing is not None and wing != own and wing not in WINGS[own]:
                    bad.append(f"{f.relative_to(root)}:{line} ({own}) imports {target} ({wing})")
    return bad


def test_no_stage_imports_another_stage():
    assert stage_violations() == []


def test_eval_wings_import_one_way():
    assert wing_violations() == []


def test_the_check_sees_a_violation(tmp_path):
    for folder in STAGES:
        (tmp_path / folder).mkdir()
    (tmp_path / "infer" / "run.py").write_text("from mlbench_kit.eval.parse import parse_response\n")
    assert stage_violations(tmp_path) == ["infer/run.py:1 imports mlbench_kit.eval.parse"]


def test_the_check_sees_relative_imports(tmp_path):
    for folder in STAGES:
        (tmp_path / folder).mkdir()
    (tmp_path / "eval" / "envs").mkdir()
    (tmp_path / "eval" / "run.py").write_text("from ..infer import x\nfrom .. import train\nfrom . import checks\n")
    (tmp_path / "eval" / "envs" / "box.py").write_text("from ...slurm.sweep import y\nfrom . import cgroups\n")
    assert stage_violations(tmp_path) == ["eval/envs/box.py:1 imports mlbench_kit.slurm.sweep",
                                          "eval/run.py:1 imports mlbench_kit.infer",
                                          "eval/run.py:2 imports mlbench_kit.train"]


def test_the_check_sees_a_wing_violation(tmp_path):
    for wing in ("envs", "report"):
        (tmp_path / "eval" / wing).mkdir(parents=True)
    files = {
        "eval/envs/build.py": "from mlbench_kit.sandbox import Env\nfrom .. import run\n"
                              "from mlbench_kit.eval.report import cli\n",
        "eval/report/render.py": "from ..metrics import ERROR_CLASSES\nfrom .data import Setting\n",
        "eval/run.py": "from .envs import EnvConfig\nfrom mlbench_kit.sandbox import Sandbox\n"
                       "from .report.data import load\n",
        "eval/envcli.py": "from . import run\nfrom .envs.validate import validate\n",
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    assert wing_violations(tmp_path) == [
        "eval/envs/build.py:2 (envs) imports mlbench_kit.eval.run (scoring)",
        "eval/envs/build.py:3 (envs) imports mlbench_kit.eval.report.cli (report)",
        "eval/report/render.py:1 (report) imports mlbench_kit.eval.metrics.ERROR_CLASSES (scoring)",
        "eval/run.py:3 (scoring) imports mlbench_kit.eval.report.data.load (report)",
    ]


def sandbox_violations(root: Path = ROOT) -> list[str]:
    """Every import of a stage's module, or of another core module than the errors, the checked tar extractor
    (docker's layers come back as tars; ``untar`` itself imports only the errors) and the tree walker (``tree``: the
    standard library alone), from the core's sandbox: scoring and the agent both run untrusted code in it, so it must
    stand alone."""
    bad = []
    for f in sorted((root / "mlbench_kit" / "sandbox").rglob("*.py")):
        for line, mod, _names in _imports(f, root):
            parts = mod.split(".")
            allowed = ("mlbench_kit.errors", "mlbench_kit.untar", "mlbench_kit.tree")
            if parts[0] == "mlbench_kit" and mod not in allowed and not mod.startswith("mlbench_kit.sandbox"):
                bad.append(f"{f.relative_to(root)}:{line} imports {mod}")
    return bad


def test_the_sandbox_stands_alone(tmp_path):
    assert sandbox_violations() == []
    (tmp_path / "mlbench_kit" / "sandbox").mkdir(parents=True)
    (tmp_path / "mlbench_kit" / "sandbox" / "box.py").write_text(
        "from mlbench_kit.errors import MLBenchError\nfrom . import cgroups\nfrom mlbench_kit.eval.run import x\n"
        "from ..io import write_atomic\n")
    assert sandbox_violations(tmp_path) == ["mlbench_kit/sandbox/box.py:3 imports mlbench_kit.eval.run",
                                            "mlbench_kit/sandbox/box.py:4 imports mlbench_kit.io"]


def core_violations(root: Path = ROOT) -> list[str]:
    """Every import of a stage's module from the core package (mlbench_kit/, the CLI included), as file:line,
    wherever it sits (a function-local import counts): the core names stages by dotted path only
    (mlbench_kit/stages.py) and imports them when one runs."""
    bad = []
    for f in sorted((root / "mlbench_kit").rglob("*.py")):
        for line, mod, names in _imports(f, root):
            for target in _targets(mod, names):
                parts = target.split(".")
                if parts[0] == "mlbench_kit" and len(parts) > 1 and parts[1] in STAGES.values():
                    bad.append(f"{f.relative_to(root)}:{line} imports {target}")
                    break
    return bad


def test_the_core_imports_no_stage(tmp_path):
    assert core_violations() == []
    (tmp_path / "mlbench_kit").mkdir()
    (tmp_path / "mlbench_kit" / "cli.py").write_text(
        "from .errors import MLBenchError\n\ndef f():\n    from mlbench_kit.train import lora\n"
        "    from . import infer\n    import mlbench_kit.eval.run\n")
    assert core_violations(tmp_path) == ["mlbench_kit/cli.py:4 imports mlbench_kit.train",
                                         "mlbench_kit/cli.py:5 imports mlbench_kit.infer",
                                         "mlbench_kit/cli.py:6 imports mlbench_kit.eval.run"]


def test_every_stage_entry_and_config_exists():
    # the table names them by dotted path: a typo would surface only when that stage runs
    from mlbench_kit.stages import STAGES as TABLE
    assert {s.name for s in TABLE} >= {"prep", "train", "infer", "agent", "eval", "report", "env", "sweep"}
    for st in TABLE:
        module = st.module()
        assert callable(module.run), st.name
        if st.config is not None:  # its options are generated from the config (mlbench_kit.flags)
            assert st.config_class() is not None
            assert not hasattr(module, "add_arguments"), f"{st.entry} writes its own options beside its config"
        else:
            assert callable(module.add_arguments), st.name
