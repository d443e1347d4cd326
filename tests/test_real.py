"""The real loop, shrunk: SmolLM2-135M-Instruct as released, real ML-Bench rows, the real environment of a test
repository, every stage of `scripts/real.sh --quick` (docs/real-model.md). It fails if any stage
breaks: the model conversion, prep with the model's chat template, LoRA (the loss must fall), vLLM with the
adapter, parsing, execution in the sandbox, the report. Then its agent arm, `--agent --quick`, in the same run
folder: both policies with the real model and its LoRA, 1 row, k = 1, scored and reported."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from conftest import REPO_ROOT, run_session


def _jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


@pytest.fixture(scope="module")
def quick(tmp_path_factory, shared, real_env_cache):
    """`scripts/real.sh --quick` once: its run folder, environment and command, and the first run's result. Its
    cache (MLBENCH_CACHE) is the session's ``real_env_cache``: the real repository's environment that
    tests/eval/test_envs.py builds and validates, built once for both."""
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap not installed (scripts/setup.sh installs it)")
    tmp_path = tmp_path_factory.mktemp("real")
    run = tmp_path / "run"
    env = {k: v for k, v in os.environ.items() if not k.startswith("VIRTUAL_ENV")}
    env.update(MLBENCH_CACHE=str(real_env_cache), NLTK_DATA=str(shared / "nltk_data"))
    cmd = ["bash", "scripts/real.sh", "--quick", "--data", str(shared / "full.jsonl"), "--repos", str(shared / "repos"),
           "--run", str(run)]
    return tmp_path, run, env, cmd, run_session(cmd, timeout=2700, cwd=REPO_ROOT, env=env)


@pytest.mark.integration
def test_real_model_quick_run_end_to_end(quick):
    tmp_path, run, env, cmd, r = quick
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert [ln.split("]")[0] for ln in r.stdout.splitlines() if ln.startswith("real [")] == \
        [f"real [{i}/8" for i in range(1, 9)]

    # the envs stage ran in MLBENCH_CACHE and found the session's build there
    assert "up to date" in (run / "logs" / "envs.log").read_text()
    model = Path(env["MLBENCH_CACHE"]) / "models" / "SmolLM2-135M-Instruct"
    assert json.loads((model / "config.json").read_text())["num_hidden_layers"] == 30
    test = _jsonl(run / "prep" / "test" / "task3.jsonl")
    assert len(test) == 6 and {t["repo"] for t in test} == {"External-Attention-pytorch"}
    assert all(t["template"] == "chat" and t["prompt"].startswith("<|im_start|>system\n") for t in test)

    # the loss falls: the same 18 records in each epoch, so the epochs' mean step losses compare
    steps = [x for x in _jsonl(run / "train-id-task3" / "metrics.jsonl") if "loss" in x and "step" in x]
    by_epoch = {e: [x["loss"] for x in steps if x["epoch"] == e] for e in (0, 1)}
    assert all(by_epoch.values()), steps
    first, last = (sum(v) / len(v) for v in by_epoch.values())
    assert last < first, (first, last)

    gens = {v: _jsonl(run / "infer-task3" / v / "task3.jsonl") for v in ("base", "id-tuned")}
    assert all(len(g) == 6 and all(len(x["output"]) == 2 and len(x["raw"]) == 2 for x in g) for g in gens.values())
    assert sum(bool(o.strip()) for x in gens["id-tuned"] for o in x["output"]) >= 6  # code parsed out of answers

    results = _jsonl(run / "eval-compat" / "task3" / "id-tuned" / "results.jsonl")
    assert len(results) == 12 and all(x["env"] for x in results)
    executed = [x for x in results if x["executed"]]
    assert executed and all(x["exit_code"] is not None for x in executed)  # it ran in the real environment
    summary = json.loads((run / "eval-compat" / "task3" / "id-tuned" / "summary.json").read_text())
    assert summary["gold_valid"]["rows"] >= 1 and not summary.get("faults")

    report = (run / "real-model.md").read_text()
    for part in ("## Results", "| base | 3 | compat |", "| id-tuned | 3 | compat |", "CodeLlama-ID (paper)",
                 "## Time per stage"):
        assert part in report, part
    # a second run finds every stage done
    r = run_session(cmd, timeout=300, cwd=REPO_ROOT, env=env)
    assert r.returncode == 0 and r.stdout.count(" done\n") == 8, r.stdout


@pytest.mark.integration
def test_real_model_agent_arm_quick_run(quick):
    """`--agent --quick` in the quick run's folder: the model, environment and test rows are reused; the ID LoRA
    is the same finished adapter; both policies run the model as released and with its LoRA (1 row, k = 1) to a
    recorded exit, `mlbench eval` scores every answer and the report is written beside the paper's agent rows."""
    from mlbench_kit.agent.episode import EXITS
    tmp_path, run, env, cmd, first = quick
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    kept = ("train-id-task3/adapter/adapter_model.safetensors", "train-id-task3/metrics.jsonl",
            "report-compat/report.md", "real-model.md")  # the quick run's adapter, its training and its reports
    before = {f: (run / f).read_bytes() for f in kept}
    r = run_session([*cmd, "--agent"], timeout=2700, cwd=REPO_ROOT, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("real [")]
    assert [ln.split("]")[0] for ln in lines] == [f"real [{i}/7" for i in range(1, 8)]
    assert all(ln.endswith(" done") for ln in lines[:3]), lines  # model, environment, prep: the quick run's
    # the same settings, so the ID LoRA is the quick run's finished adapter, not trained again
    assert "train: already finished" in (run / "logs" / "train-id.log").read_text()
    assert {f: (run / f).read_bytes() for f in kept} == before
    chosen = _jsonl(run / "agent-rows.jsonl")
    assert len(chosen) == 1 and {c["repo"] for c in chosen} == {"External-Attention-pytorch"}
    for policy in ("ml-agent", "bash"):
        for v in ("base", "id-tuned"):
            gens = _jsonl(run / f"agent-{policy}" / v / "generations.jsonl")
            assert sorted((g["github_id"], g["id"]) for g in gens) == sorted((c["github_id"], c["id"]) for c in chosen)
            assert all(len(g["output"]) == 1 and (g["adapter"] is not None) == (v == "id-tuned") for g in gens)
            episodes = [e for g in gens for e in g["agent"]["episodes"]]
            assert all(e["exit"] in EXITS and e["exit"] != "fault" for e in episodes), episodes
            assert all(1 <= e["turns"] <= 3 and e["tokens_out"] >= 1 for e in episodes)  # --quick: 3 turns
            scored = run / "eval-compat" / f"agent-{policy}" / v
            assert len(_jsonl(scored / "results.jsonl")) == 1  # every episode's answer has a verdict
            summary = json.loads((scored / "summary.json").read_text())
            assert summary["metrics"]["overall"]["samples"] == 1 and not summary["faults"], summary
            assert not summary["unscored"], summary
    report = (run / "report-agent-compat" / "report.md").read_text()
    assert "## Agent runs" in report and "ML-Agent, GPT-4 (paper, quarter set)" in report
    md = (run / "agent-real.md").read_text()
    for part in ("## Results", "| base | ml-agent | compat |", "| id-tuned | bash | compat |", "## Episodes",
                 "| ML-Agent, GPT-4 (paper, quarter set) | ml-agent | 23.53 | 35.29 | 47.06 |"):
        assert part in md, part
    # again: every stage is done
    r = run_session([*cmd, "--agent"], timeout=300, cwd=REPO_ROOT, env=env)
    assert r.returncode == 0 and r.stdout.count(" done\n") == 7, r.stdout


def test_the_learning_arm_samples_the_test_repositories_named_and_a_run_folder_holds_one_choice(tmp_path):
    """``--learn-test-repos`` and ``--learn-methods``: a repository that is not one of the run's test repositories,
    a method that is not one, or a run folder that sampled other test rows or other methods (a folder from before
    the options sampled the defaults), is one clear error before anything is set up or written; it names the
    folder's choice to resume it, and its ``rm`` command, pasted, keeps the learned adapters whatever the folder's
    name. The same rows or methods named in another order, twice or across lines are the same choice."""
    run = tmp_path / "my run"

    def real(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", "scripts/real.sh", "--run", str(run), *args],
                              cwd=REPO_ROOT, capture_output=True, text=True, timeout=60)
    r = real("--learn", "--learn-test-repos", "PyTorch-GAN esm")
    assert r.returncode == 2 and "'esm' is not a test repository of this run" in r.stderr, r.stderr
    r = real("--learn", "--quick", "--learn-test-repos", "all PyTorch-GAN")
    assert r.returncode == 2 and "'all' is not a test repository" in r.stderr, r.stderr
    r = real("--learn", "--learn-test-repos", " ")
    assert r.returncode == 2 and "names no repository" in r.stderr, r.stderr
    r = real("--agent", "--learn-test-repos", "all")
    assert r.returncode == 2 and "--learn-test-repos is an option of --learn" in r.stderr, r.stderr
    r = real("--agent", "--learn-methods", "grpo")  # the misplaced option first, not what it names
    assert r.returncode == 2 and "--learn-methods is an option of --learn" in r.stderr, r.stderr
    r = real("--learn", "--learn-methods", "grpo")  # its curriculum comes from rft's first round
    assert r.returncode == 2 and "name rft too" in r.stderr, r.stderr
    r = real("--learn", "--learn-methods", "rft\nppo")  # every word, whatever separates them
    assert r.returncode == 2 and "got 'ppo'" in r.stderr, r.stderr
    r = real("--learn", "--learn-methods", " ")
    assert r.returncode == 2 and "names no method" in r.stderr, r.stderr
    kept = ["done/train-id", "learn-rft/adapter/adapter_model.safetensors", "eval-strict/base/results.jsonl"]
    stale = ["done/learn-infer", "done/learn-eval", "learn-infer/sft/task3.jsonl", "learning.md",
             "eval-compat/learn/sft/results.jsonl", "eval-strict/learn/sft/results.jsonl"]
    for f in kept + stale:
        (run / f).parent.mkdir(parents=True, exist_ok=True)
        (run / f).write_text("x")
    r = real("--learn", "--learn-test-repos", "all")  # a folder from before the option: the default's 12 rows
    assert r.returncode == 2 and "sampled the test rows of External-Attention-pytorch with rft dpo grpo," in r.stderr
    (run / "learn-test-repos").write_text("External-Attention-pytorch\n")
    r = real("--learn", "--learn-methods", "grpo rft")  # the same rows, fewer methods: other samples
    assert r.returncode == 2 and "with rft dpo grpo, not External-Attention-pytorch with rft grpo" in r.stderr
    # resuming a folder that ran some methods: its choice is named, in any order, whatever separates the names
    (run / "learn-methods").write_text("rft grpo\n")
    r = real("--learn", "--repos", str(tmp_path / "none"))
    assert r.returncode == 2 and "To resume it, name its choice: --learn-test-repos 'External-Attention-pytorch' " \
        "--learn-methods 'rft grpo'." in r.stderr, r.stderr
    r = real("--learn", "--learn-methods", "grpo\nrft rft", "--repos", str(tmp_path / "none"))
    assert r.returncode == 2 and "--repos" in r.stderr and "sampled" not in r.stderr, r.stderr  # past the check
    (run / "learn-methods").unlink()
    (run / "learn-test-repos").write_text("External-Attention-pytorch PyTorch-GAN Time-Series-Library\n")
    r = real("--learn", "--learn-test-repos", "Time-Series-Library PyTorch-GAN External-Attention-pytorch PyTorch-GAN",
             "--repos", str(tmp_path / "none"))
    assert r.returncode == 2 and "--repos" in r.stderr and "sampled" not in r.stderr, r.stderr  # past the check
    r = real("--learn", "--learn-test-repos", "PyTorch-GAN")
    assert r.returncode == 2 and "sampled the test rows of External-Attention-pytorch PyTorch-GAN" in r.stderr
    (run / "learn-methods").write_text("rft grpo\n")
    subprocess.run(["bash", "-c", r.stderr.split("first: ", 1)[1]], check=True, cwd=tmp_path)
    left = sorted(str(f.relative_to(run)) for f in run.rglob("*") if f.is_file())
    assert left == sorted(kept), left
