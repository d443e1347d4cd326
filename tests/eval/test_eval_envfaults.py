"""`mlbench eval` never scores a broken environment as a model failure, and scores the sample's gold 53/53."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO_ROOT

from mlbench_kit.cli import main
from mlbench_kit.eval import execution
from mlbench_kit.sandbox import Sandbox

SAMPLE = REPO_ROOT / "examples" / "sample" / "samples.jsonl"
ENVS = REPO_ROOT / "configs" / "eval" / "sample.yaml"
pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")


def _summary(out: Path) -> dict:
    return json.loads((out / "summary.json").read_text())


@pytest.mark.parametrize("backend", ["bwrap", pytest.param("podman", marks=pytest.mark.integration)])
def test_gold_passes_every_sample(tmp_path, backend, request):
    if backend == "podman" and request.getfixturevalue("base_image") is None:
        pytest.skip("podman unavailable")
    out = tmp_path / backend
    assert main(["eval", "--data", str(SAMPLE), "--gold", "--envs", str(ENVS), "--out", str(out), "--no-ci",
                 "--backend", backend]) == 0
    o = _summary(out)["metrics"]["overall"]
    assert o["samples"] == 53 and o["pass@1"] == 1.0
    res = [json.loads(x) for x in (out / "results.jsonl").open()]
    assert len(res) == 53 and all(r["executed"] and r["exit_code"] == 0 for r in res)


def _envs_with(tmp_path: Path, venv: Path) -> Path:
    doc = yaml.safe_load(ENVS.read_text())
    for spec in doc["repos"].values():
        spec["checkout"] = str((ENVS.parent / spec["checkout"]).resolve())
        spec["venv"] = str(venv)
    path = tmp_path / "envs.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_broken_environment_stops_before_any_verdict(tmp_path, capsys):
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text("#!/bin/sh\necho 'libpython3.so: cannot open shared object' >&2\nexit 127\n")
    (venv / "bin" / "python").chmod(0o755)
    envs = _envs_with(tmp_path, venv)
    out = tmp_path / "run"
    assert main(["eval", "--data", str(SAMPLE), "--gold", "--envs", str(envs), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "environment 'toybench' failed its probe" in err and f"{envs}:" in err and "cannot open shared" in err
    assert not (out / "results.jsonl").exists() and not (out / "summary.json").exists()


class _InterpreterVanishes(Sandbox):
    """A real sandbox whose environment (shared by both repositories) loses its interpreter right after the
    last preflight passed."""

    def preflight(self, env, workdirs):
        probe = super().preflight(env, workdirs)
        if env.name == "toyvision":
            (Path(env.prefix) / "bin" / "python").unlink()
        return probe


def test_mid_run_environment_fault_is_not_a_model_failure(tmp_path, capsys, monkeypatch):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    envs = _envs_with(tmp_path, venv)
    out = tmp_path / "run"
    args = ["eval", "--data", str(SAMPLE), "--gold", "--envs", str(envs), "--out", str(out), "--no-ci"]
    monkeypatch.setattr(execution, "Sandbox", _InterpreterVanishes)
    assert main(args) == 3
    err = capsys.readouterr().err
    assert "were not scored (stopped after 10): the environment or the sandbox failed, not the model" in err
    assert "ENV: interpreter" in err
    faults = [json.loads(x) for x in (out / "faults.jsonl").open()]
    assert execution.MAX_FAULTS <= len(faults) <= execution.MAX_FAULTS + 2
    assert all(f["fault"].startswith("ENV: ") for f in faults)
    scored = [json.loads(x) for x in (out / "results.jsonl").open()] if (out / "results.jsonl").exists() else []
    assert not [r for r in scored if not r["passed"]]  # nothing blamed on the model
    # the environment is repaired: the same command scores what was left, and only that
    monkeypatch.undo()
    subprocess.run([sys.executable, "-m", "venv", "--clear", "--without-pip", str(venv)], check=True)
    assert main(args) == 0
    assert not (out / "faults.jsonl").exists() and _summary(out)["metrics"]["overall"]["pass@1"] == 1.0
