"""Eval's errors point at the step that fixes them: the environments file, a failed probe, missing options."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import pytest
from conftest import REPO_ROOT

from mlbench_kit.cli import main
from mlbench_kit.errors import MLBenchError
from mlbench_kit.sandbox import Env, Sandbox

SAMPLE = REPO_ROOT / "examples" / "sample"
REPO = SAMPLE / "repos" / "toybench"
SAMPLE_ENVS = REPO_ROOT / "configs" / "eval" / "sample.yaml"


def test_a_missing_envs_yaml_says_how_to_build_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture) -> None:
    # before: "config file not found ... fix: check the path"
    cache = tmp_path / "cache"
    monkeypatch.setenv("MLBENCH_CACHE", str(cache))
    missing = cache / "envs.yaml"
    rc = main(["eval", "--data", str(SAMPLE / "samples.jsonl"), "--gold", "--envs", str(missing), "--backend",
               "local", "--unsafe-local", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert rc == 2 and f"{missing}: environments file not found" in err, err
    assert "`mlbench env build [REPO ...]`" in err and f"$MLBENCH_CACHE/envs.yaml (here {missing})" in err
    assert f"--envs {missing}" in err and "check the path" not in err
    assert not (tmp_path / "out").exists()


def test_eval_without_options_names_the_flags_it_needs(capsys: pytest.CaptureFixture) -> None:
    # before: "error: defaults: no `data` given"
    assert main(["eval"]) == 2
    err = capsys.readouterr().err
    first, fix = err.splitlines()[:2]
    assert first == ("error: missing --data, --generations (or --gold), --out: mlbench eval needs --data ROWS, "
                     "--generations FILE (or --gold) and --out DIR"), err
    assert fix.startswith("  fix: e.g. mlbench eval --data ") and "--generations " in fix and "--out " in fix
    assert "defaults" not in err


def _broken_interpreter(folder: Path) -> Path:
    (folder / "bin").mkdir(parents=True)
    for name in ("python", "python3"):
        (folder / "bin" / name).write_text("#!/bin/sh\necho 'Fatal Python error: init_fs_encoding' >&2\nexit 1\n")
        (folder / "bin" / name).chmod(0o755)
    return folder


def test_a_probe_failure_of_the_default_environment_names_the_interpreter(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # before: "build or fix the environment (mlbench env check)", whose answer is "run mlbench env build": the 14
    # real repositories, never the sample's environment, which is the base interpreter of the running Python
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap not installed")
    base = _broken_interpreter(tmp_path / "base")
    monkeypatch.setattr(sys, "base_prefix", str(base))
    monkeypatch.setattr(sys, "_base_executable", str(base / "bin" / "python3"))
    env = Env("toybench", REPO, where=f"{SAMPLE_ENVS}:4")  # as configs/eval/sample.yaml gives it
    with Sandbox("bwrap") as sb, pytest.raises(MLBenchError) as e:
        sb.preflight(env, ["./"])
    what, fix = e.value.what, str(e.value.fix)
    assert "environment 'toybench' failed its probe in the bwrap sandbox" in what
    assert (f"toybench has no environment of its own, so the probe ran the default one: the base interpreter of "
            f"the Python running mlbench ({base}/bin/python3) as `python` from PATH {base}/bin:") in what
    assert "mlbench env check" not in fix
    assert f"`venv: DIR` under repos.toybench in {SAMPLE_ENVS}" in fix
    assert "mlbench env build toybench --recipes configs/eval/envs-sample" in fix
    assert e.value.where == f"{SAMPLE_ENVS}:4"


def test_probe_advice_follows_what_the_environment_is(tmp_path: Path) -> None:
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap not installed")
    venv = _broken_interpreter(tmp_path / "venv")
    with Sandbox("bwrap") as sb:
        what, fix = sb.probe_advice(Env("dgl", REPO, prefix=str(venv), recipe="abc123", where="envs.yaml:3"))
        assert f"the build {venv} of `mlbench env build`" in what
        assert "mlbench env check dgl" in fix and "mlbench env build dgl" in fix
        what, fix = sb.probe_advice(Env("dgl", REPO, prefix=str(venv), where="mine.yaml:7"))
        assert f"the environment {venv} named in mine.yaml" in what
        assert f"{venv}/bin/python -c 'import sys'" in fix and "mlbench env" not in fix
    with Sandbox("podman") as sb:
        _, fix = sb.probe_advice(Env("toybench", REPO, image="localhost/mlbench-base:bookworm", where="s.yaml:4"))
        assert "mlbench env base-image" in fix
        _, fix = sb.probe_advice(Env("dgl", REPO, image="localhost/mlbench-dgl:abc", recipe="abc", where="e:2"))
        assert "mlbench env build dgl --image" in fix


def test_an_environment_without_python_says_how_to_make_one(tmp_path: Path) -> None:
    # before: "build it (mlbench env build) or fix the path" for a venv of the user's own too
    from mlbench_kit.eval.envs import EnvConfig
    (tmp_path / "empty").mkdir()
    f = tmp_path / "envs.yaml"
    f.write_text(f"repos:\n  toybench: {{checkout: {REPO}, venv: empty}}\n"
                 f"  toyvision: {{checkout: {REPO}, venv: empty, recipe: abc123}}\n")
    with pytest.raises(MLBenchError) as e:
        EnvConfig(f).for_repo("toybench")
    assert f"python3 -m venv {tmp_path / 'empty'}" in str(e.value.fix) and "mlbench env" not in str(e.value.fix)
    with pytest.raises(MLBenchError) as e:
        EnvConfig(f).for_repo("toyvision")
    assert e.value.fix == "rebuild it: mlbench env build toyvision"


def test_env_check_without_builds_says_what_it_checks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                      capsys: pytest.CaptureFixture) -> None:
    # before: "run `mlbench env build` first", also for a user whose environments are a file of their own
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap not installed")
    monkeypatch.setenv("MLBENCH_CACHE", str(tmp_path))
    assert main(["env", "check"]) == 2
    err = capsys.readouterr().err
    assert f"{tmp_path / 'envs.yaml'}: no environments built yet" in err
    assert "mlbench env build [REPO ...]" in err and "mlbench eval --envs FILE probes those" in err
