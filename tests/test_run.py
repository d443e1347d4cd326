"""`mlbench run`: one command from a model to a score. On the embedded sample with a tiny model (transformers'
generate: no engine to start), it must score exactly what the four stage commands run by hand score, resume after
Ctrl-C without redoing a finished stage, and refuse bad input before any work."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import REPO_ROOT, SAMPLE, run_cli

DATA = SAMPLE / "samples.jsonl"
ENVS = REPO_ROOT / "configs" / "eval" / "sample.yaml"
INFER_CFG = "configs/infer/tiny-hf.yaml"  # n 4, 48 new tokens, transformers' generate
LIMIT = "6"


def _run_args(model: Path, out: Path) -> list[str]:
    return ["--model", str(model), "--data", str(DATA), "--readmes", str(SAMPLE / "repos"), "--template",
            "llama-inst", "--tasks", "3", "--limit", LIMIT, "--infer-config", INFER_CFG, "--envs", str(ENVS),
            "--out", str(out)]


def test_run_without_a_model_is_one_error_and_writes_nothing(tmp_path: Path) -> None:
    r = run_cli("mlbench", "run", "--out", tmp_path / "run")
    assert r.returncode == 2 and "missing --model" in r.stderr, r.stderr
    assert not (tmp_path / "run").exists()


def test_a_bad_stage_option_fails_before_any_work_with_the_run_s_flag(tmp_path: Path) -> None:
    r = run_cli("mlbench", "run", "--model", tmp_path, "--infer-config", "configs/infer/nope.yaml",
                "--out", tmp_path / "run")
    assert r.returncode == 2 and "--infer-config" in r.stderr and "not found" in r.stderr, r.stderr
    assert not (tmp_path / "run").exists()


def test_the_run_s_folder_refuses_another_run_s_options(tmp_path: Path) -> None:
    out = tmp_path / "run"
    out.mkdir()
    (out / "run.json").write_text(json.dumps({"model": "other"}))
    r = run_cli("mlbench", "run", "--model", tmp_path, "--data", DATA, "--envs", ENVS, "--out", out)
    assert r.returncode == 2 and "model" in r.stderr, r.stderr
    assert sorted(p.name for p in out.iterdir()) == ["run.json"]


@pytest.mark.integration
def test_one_command_scores_like_the_four_by_hand_and_resumes_after_ctrl_c(tmp_path: Path,
                                                                           tiny_model_dir: Path) -> None:
    out = tmp_path / "run"
    cmd = [str(Path(sys.executable).with_name("mlbench")), "run", *_run_args(tiny_model_dir, out)]
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
    # Ctrl-C once prep is finished: inference is interrupted, prep is kept
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while "prep" not in (json.loads((out / "stages.json").read_text()) if (out / "stages.json").is_file()
                             else {}):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "prep did not finish in 300 s"
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGINT)  # what Ctrl-C sends: the whole foreground group
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 130, stderr[-3000:]
    assert "interrupted during infer; kept: prep" in stderr, stderr[-3000:]
    assert list(json.loads((out / "stages.json").read_text())) == ["prep"]
    assert not (out / "summary.json").exists() and not (out / "eval").exists()

    # the same command resumes: prep kept, the rest run, one summary
    r = run_cli("mlbench", "run", *_run_args(tiny_model_dir, out), env={"TOKENIZERS_PARALLELISM": "false"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "run: prep: kept" in r.stderr and "run: infer ..." in r.stderr, r.stderr
    assert list(json.loads((out / "stages.json").read_text())) == ["prep", "infer", "eval:base:3", "report"]
    summary = json.loads((out / "summary.json").read_text())
    assert (out / "report" / "report.md").is_file() and (out / "report" / "report.html").is_file()

    # the four commands by hand, with the same options
    hand = tmp_path / "hand"
    steps = [
        ["prep", "--config", "configs/prep/paper.yaml", "--data", DATA, "--splits", "full", "--tasks", "3",
         "--tokenizer", tiny_model_dir, "--no-hf", "--readmes", SAMPLE / "repos", "--template", "llama-inst",
         "--out", hand / "prep"],
        ["infer", "--config", INFER_CFG, "--model", tiny_model_dir, "--prompts", hand / "prep", "--split", "full",
         "--tasks", "3", "--limit", LIMIT, "--out", hand / "infer"],
        ["eval", "--data", DATA, "--split", "full", "--generations", hand / "infer" / "task3.jsonl", "--envs", ENVS,
         "--mode", "compat", "--out", hand / "eval"],
        ["report", f"base={hand / 'eval'}", "--reference", "configs/report/paper-rows.yaml", "--out",
         hand / "report"],
    ]
    for step in steps:
        h = run_cli("mlbench", *step, env={"TOKENIZERS_PARALLELISM": "false"})
        assert h.returncode == 0, (step[0], h.stderr[-3000:])
    by_hand = json.loads((hand / "eval" / "summary.json").read_text())["metrics"]["overall"]
    assert summary["scores"] == {"base": {"task3": by_hand}}
    assert by_hand["samples"] == int(LIMIT)
    # the same generations and the same report table
    key = ("github_id", "id", "output")
    gens = [{k: g[k] for k in key} for g in map(json.loads, (out / "infer" / "task3.jsonl").read_text().splitlines())]
    hand_gens = [{k: g[k] for k in key} for g in map(json.loads, (hand / "infer" / "task3.jsonl").read_text()
                                                     .splitlines())]
    assert gens == hand_gens and len(gens) == int(LIMIT)
    assert (out / "report" / "report.csv").read_text() == (hand / "report" / "report.csv").read_text()
    # one summary at the end, on stdout, with the numbers of summary.json
    assert f"{by_hand['pass@1']:.3f}" in r.stdout and "base" in r.stdout, r.stdout

    # a third run keeps everything and prints the same summary
    again = run_cli("mlbench", "run", *_run_args(tiny_model_dir, out))
    assert again.returncode == 0 and again.stdout == r.stdout, again.stderr[-3000:]
    assert again.stderr.count(": kept (finished in an earlier run)") == 4, again.stderr


def test_the_same_run_named_from_another_folder_is_the_same_run(tmp_path: Path, monkeypatch) -> None:
    """A run folder records its options with existing paths made absolute: the same command from another working
    folder (or the folder moved) resumes instead of being refused as another run's."""
    from mlbench_kit.pipeline import identity
    from mlbench_kit.run_config import RunConfig
    monkeypatch.chdir(REPO_ROOT)
    here = RunConfig(model=str(tmp_path), data="examples/sample/samples.jsonl", envs="configs/eval/sample.yaml",
                     adapters=[f"id={tmp_path}"], out="runs/x")
    recorded = identity(here)
    monkeypatch.chdir(tmp_path)
    there = RunConfig(model=".", data=str(DATA), envs=str(ENVS), adapters=["id=."], out="/elsewhere/x")
    assert recorded == identity(there)
    assert recorded != identity(RunConfig(model=".", data=str(DATA), envs=str(ENVS), adapters=["id=."],
                                                 mode="strict", out="x"))


@pytest.mark.parametrize("signum, rc, said", [(signal.SIGTERM, 143, "terminated (SIGTERM) during infer"),
                                              (signal.SIGINT, 130, "interrupted during infer")])
def test_a_signal_a_stage_swallowed_stops_the_run_and_the_stage_is_not_done(tmp_path: Path, monkeypatch, capsys,
                                                                             signum: int, rc: int, said: str) -> None:
    """SIGTERM (scancel, a job's time limit) and Ctrl-C during a stage whose library caught the KeyboardInterrupt
    and returned as if finished: the run stops with 143 or 130, and the stage is not recorded as done (a resume
    would skip it, its output cut short)."""
    from types import SimpleNamespace

    from mlbench_kit import pipeline
    from mlbench_kit.errors import raise_terminated
    from mlbench_kit.run_config import RunConfig

    def swallowing(cfg: object) -> int:
        try:
            os.kill(os.getpid(), signum)
            time.sleep(5)  # the handler raises at once; never reached
        except KeyboardInterrupt:
            pass
        return 0

    monkeypatch.setattr(pipeline, "stage_configs", lambda cfg, out: {"prep": None, "infer": None})
    monkeypatch.setattr(pipeline, "stage", lambda name: SimpleNamespace(
        entry_function=lambda: (lambda cfg: 0) if name == "prep" else swallowing))
    previous = signal.signal(signal.SIGTERM, raise_terminated)  # what `mlbench run`'s CLI runs it under
    try:
        assert pipeline.run_all(RunConfig(out=str(tmp_path / "run"))) == rc
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert said in capsys.readouterr().err
    assert list(json.loads((tmp_path / "run" / "stages.json").read_text())) == ["prep"]
