"""The agent stage in a sweep (configs/sweeps/tiny-cpu-agent.yaml): its units, their dependencies and configs, the
eval of their generations, the checks at plan, and sweeps without an agent section left as they were."""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO_ROOT, run_cli, run_session
from test_slurm import assert_plan_refuses, checked_jobs

from mlbench_kit.agent_config import AgentConfig
from mlbench_kit.errors import MLBenchError
from mlbench_kit.slurm.render import check_jobs, jobs, render, write_unit_configs
from mlbench_kit.slurm.spec import load_sweep

AGENT_SWEEP = REPO_ROOT / "configs/sweeps/tiny-cpu-agent.yaml"


def test_an_agent_unit_runs_each_cell_s_model_after_its_training_and_its_eval_reads_it() -> None:
    by_name = checked_jobs(AGENT_SWEEP)
    assert list(by_name) == ["prep", "train", "infer", "eval", "infer-base", "eval-base", "agent", "eval-agent",
                             "agent-base", "eval-agent-base", "report"]
    assert by_name["agent"].deps == [("afterok", "prep"), ("aftercorr", "train")]
    assert by_name["agent-base"].deps == [("afterok", "prep")]
    assert by_name["eval-agent"].deps == [("aftercorr", "agent")]
    assert by_name["eval-agent-base"].deps == [("aftercorr", "agent-base")]
    assert ("afterany", "eval-agent") in by_name["report"].deps and ("afterany", "agent") in by_name["report"].deps
    for agent_job, infer_job in (("agent", "infer"), ("agent-base", "infer-base")):
        agents, evals = by_name[agent_job].units, by_name["eval-" + agent_job].units
        infers = {u.index: u for u in by_name[infer_job].units}
        assert [u.index for u in agents] == [u.index for u in evals] == list(infers)  # task i after task i
        for unit, ev in zip(agents, evals, strict=True):
            cfg, infer = unit.config, infers[unit.index].config
            assert isinstance(cfg, AgentConfig)
            # the cell's model, adapter (the one its train unit writes) and seed, as infer's
            assert (cfg.model, cfg.adapter, cfg.sampling.seed) == (infer.model, infer.adapter, infer.sampling.seed)
            if agent_job == "agent":
                train = {u.index: u for u in by_name["train"].units}[unit.index].config
                assert cfg.adapter == str(Path(train.out) / "adapter")
            else:
                assert cfg.adapter is None
            # infer's rows (prep's file of the cell's task in infer's split), eval's environments
            assert cfg.rows_of == str(Path(infer.prompts) / infer.split / f"task{infer.tasks[0]}.jsonl")
            assert cfg.envs == ev.config.envs == "configs/eval/sample.yaml"
            assert (cfg.repos_dir, cfg.policy, cfg.backend, cfg.episodes) == ("examples/sample/repos", "ml-agent",
                                                                              "hf", 2)
            # its eval scores the generations the agent writes, into a folder of its own beside infer's eval
            assert ev.config.generations == str(Path(str(cfg.out)) / "generations.jsonl")
            assert Path(ev.out).name == "eval-agent" and Path(ev.out).parent == Path(str(cfg.out)).parent
            assert ev.key == unit.key + ".agent"  # its done-marker is not eval's
    report = " ".join(by_name["report"].units[0].argv)
    for unit in by_name["eval-agent"].units:  # the report: the agent setting of the same checkpoint
        assert f"tiny-pretrained/id={unit.out}" in report


def test_the_agent_job_runs_mlbench_agent_from_each_unit_s_written_config(tmp_path: Path, monkeypatch) -> None:
    from mlbench_kit.cli import stage_parser
    from mlbench_kit.flags import resolve
    from mlbench_kit.stages import stage
    monkeypatch.chdir(REPO_ROOT)
    r = run_cli("mlbench", "sweep", "plan", AGENT_SWEEP, "--root", REPO_ROOT, "--scripts", tmp_path)
    assert r.returncode == 0, r.stderr
    by_name = checked_jobs(AGENT_SWEEP)
    for name in ("agent", "agent-base"):
        text = (tmp_path / f"{name}.sbatch").read_text()
        for unit in by_name[name].units:
            written = tmp_path / name / f"{unit.key}.yaml"
            assert f'CMD=("$PY" -m mlbench_kit.cli agent --config {shlex.quote(str(written))});;' in text
            args = stage_parser("agent", raising=True).parse_args(["--config", str(written)])
            cfg = resolve(stage("agent"), args)
            assert cfg == unit.config  # the file alone is the unit
            cfg.require_inputs(str(written))  # a whole run: model, rows, checkouts, folder
        eval_text = (tmp_path / f"eval-{name}.sbatch").read_text()
        for unit in by_name[f"eval-{name}"].units:
            written = tmp_path / f"eval-{name}" / f"{unit.key}.yaml"
            assert shlex.quote(str(written)) in eval_text
            assert yaml.safe_load(written.read_text())["generations"].endswith("/agent/generations.jsonl")


def _sweep_text() -> str:
    return AGENT_SWEEP.read_text()


# (old text, new text, the start of the offending line, the message)
CASES = [
    ("  repos_dir: examples/sample/repos", "  repos_dir: examples/sample/repos\n  max_turn: 3", "  max_turn:",
     "agent has no option 'max_turn'"),
    ("  repos_dir: examples/sample/repos", "  repos_dir: examples/sample/repos\n  episodes: many", "  episodes:",
     "episodes must be int, got 'many'"),
    ("  repos_dir: examples/sample/repos", "  repos_dir: examples/sample/repos\n  tarballs: examples/sample/repos",
     "  tarballs:", "repos_dir and tarballs are both set"),
    ("  repos_dir: examples/sample/repos", "  repos_dir: examples/sample/repso", "  repos_dir:",
     "agent.repos_dir not found: examples/sample/repso"),
    ("  config: configs/agent/tiny-cpu.yaml", "  config: configs/agent/tiny.yaml", "  config: configs/agent",
     "agent.config not found"),
    # the cell's own inputs are the sweep's
    ("  repos_dir: examples/sample/repos", "  repos_dir: examples/sample/repos\n  model: other/model", "  model:",
     "the agent's model is the cell's (runs/tiny/pretrained), not other/model"),
    ("  repos_dir: examples/sample/repos", "  repos_dir: examples/sample/repos\n  set: [sampling.seed=7]",
     "  set: [sampling", "the agent's seed is the cell's (0), not 7"),
    ("  repos_dir: examples/sample/repos   # the pristine checkouts the agent reads\n", "", "agent:",
     "the agent needs the repositories' pristine checkouts"),
    # consistent with eval
    ("  repos_dir: examples/sample/repos", "  repos_dir: examples/sample/repos\n  split: quarter", "  split: q",
     "the agent reads rows of split 'quarter', eval looks them up in 'full'"),
    ("  repos_dir: examples/sample/repos", "  repos_dir: examples/sample/repos\n  policy: bash\n"
     "  envs: configs/eval/mlbench.yaml", "  envs: configs/eval/mlbench", "other environments"),
    ("  repos_dir: examples/sample/repos", "  repos_dir: examples/sample/repos\n  policy: bash", "agent:",
     "the agent's actions run in bwrap, eval's checks in podman"),
    ("  tiny-pretrained: {path: runs/tiny/pretrained, train_config: configs/train/tiny-cpu.yaml}",
     "  tiny-pretrained: {path: runs/tiny/pretrained, train_config: configs/train/tiny-cpu.yaml, "
     "agent: {max_turns: 0}}", "  tiny-pretrained:", "limits.max_turns must be at least 1"),
]


@pytest.mark.parametrize("old,new,line_text,message", CASES, ids=[c[3][:40] for c in CASES])
def test_an_agent_section_mistake_fails_at_plan_with_the_sweep_file_s_line(old: str, new: str, line_text: str,
                                                                          message: str, tmp_path: Path) -> None:
    text = _sweep_text()
    assert old in text, old
    changed = text.replace(old, new, 1)
    if "eval's checks in podman" in message:
        changed = changed.replace("  envs: configs/eval/sample.yaml", "  envs: configs/eval/sample.yaml\n"
                                  "  backend: podman")
    assert_plan_refuses(changed, line_text, message, tmp_path)


def test_model_agent_options_need_the_sweep_s_agent_section(tmp_path: Path) -> None:
    text = (REPO_ROOT / "configs/sweeps/tiny-cpu.yaml").read_text()
    old = "  tiny-random: {path: runs/tiny/random, train_config: configs/train/tiny-cpu.yaml}"
    changed = text.replace(old, old[:-1] + ", agent: {episodes: 1}}")
    f = tmp_path / "s.yaml"
    f.write_text(changed)
    line = next(i for i, ln in enumerate(changed.splitlines(), 1) if ln.startswith("  tiny-random:"))
    with pytest.raises(MLBenchError) as e:
        load_sweep(f, REPO_ROOT)
    assert "has agent options but the sweep has no `agent:` section" in e.value.what
    assert e.value.where == f"{f}:{line}"


def test_without_an_agent_section_the_sweep_plans_and_renders_as_before(tmp_path: Path) -> None:
    # the same sweep less its agent section: the jobs of old, each script and unit config byte for byte what the
    # agent sweep renders for them (the report, which lists the agent's evals too, aside)
    text = _sweep_text()
    section = text[text.index("\nagent:"):text.index("\neval:")]
    f = tmp_path / "s.yaml"
    f.write_text(text.replace(section, ""))
    without, with_agent = load_sweep(f, REPO_ROOT), load_sweep(AGENT_SWEEP, REPO_ROOT)
    for sweep, folder in ((without, tmp_path / "without"), (with_agent, tmp_path / "with")):
        all_jobs = jobs(sweep)
        check_jobs(sweep, all_jobs)
        for job in all_jobs:
            write_unit_configs(folder, job)
            (folder / f"{job.name}.sbatch").write_text(render(sweep, job, folder).replace(str(folder), "FOLDER"))
    names = sorted(p.name for p in (tmp_path / "without").iterdir())
    assert names == ["eval", "eval-base", "eval-base.sbatch", "eval.sbatch", "infer", "infer-base",
                     "infer-base.sbatch", "infer.sbatch", "prep", "prep.sbatch", "report.sbatch", "train",
                     "train.sbatch"]
    assert not any(word in p.read_text() for p in (tmp_path / "without").rglob("*") if p.is_file()
                   for word in ("cli agent", "/agent/", "eval-agent"))
    for p in (tmp_path / "without").rglob("*"):
        if p.is_file() and p.name != "report.sbatch":
            other = tmp_path / "with" / p.relative_to(tmp_path / "without")
            assert p.read_text() == other.read_text().replace("tiny-cpu-agent.yaml", "s.yaml").replace(
                str(AGENT_SWEEP.parent), str(tmp_path)), p


def _run_unit(script: Path, index: int) -> subprocess.CompletedProcess:
    """An array task of a rendered sbatch script, run as Slurm would start it, without Slurm."""
    env = {**os.environ, "SLURM_ARRAY_TASK_ID": str(index), "SLURM_ARRAY_JOB_ID": "1", "SLURM_JOB_ID": "1",
           "MLBENCH_PYTHON": sys.executable}
    return run_session(["bash", str(script)], timeout=600, env=env)


@pytest.mark.integration
@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")
def test_the_rendered_agent_unit_runs_and_its_eval_and_the_report_read_its_generations(tmp_path: Path) -> None:
    # the base cell of tiny-cpu-agent.yaml on a random tiny model: prep, agent-base, eval-agent-base and the report,
    # each from its rendered script and written config, as the jobs run them
    model = tmp_path / "model"
    r = run_cli(sys.executable, str(REPO_ROOT / "examples" / "tiny.py"), "--repos", REPO_ROOT / "examples/sample/repos",
                "--out", model, "--pretrain-steps", "0")
    assert r.returncode == 0, r.stderr
    spec = yaml.safe_load(AGENT_SWEEP.read_text())
    spec["models"] = {"tiny": {"path": str(model), "train_config": "configs/train/tiny-cpu.yaml"}}
    spec.update(splits=["none"], run_dir=str(tmp_path / "sweep"))
    f = tmp_path / "s.yaml"
    f.write_text(yaml.safe_dump(spec, sort_keys=False))
    scripts = tmp_path / "scripts"
    r = run_cli("mlbench", "sweep", "plan", f, "--root", REPO_ROOT, "--scripts", scripts)
    assert r.returncode == 0, r.stderr
    for job in ("prep", "agent-base", "eval-agent-base", "report"):
        r = _run_unit(scripts / f"{job}.sbatch", 0)
        assert r.returncode == 0, (job, r.stdout[-2000:], r.stderr[-3000:])
    cell = tmp_path / "sweep" / "tiny" / "none" / "task3" / "s0"
    rows = [json.loads(x) for x in (tmp_path / "sweep/prep/tiny/test/task3.jsonl").read_text().splitlines()]
    gens = [json.loads(x) for x in (cell / "agent" / "generations.jsonl").read_text().splitlines()]
    assert [(g["github_id"], g["id"]) for g in gens] == [(x["github_id"], x["id"]) for x in rows]  # infer's rows
    assert all(len(g["output"]) == 2 for g in gens)  # configs/agent/tiny-cpu.yaml's episodes
    summary = json.loads((cell / "eval-agent" / "summary.json").read_text())
    assert Path(summary["generations"]) == cell / "agent" / "generations.jsonl", summary
    assert (tmp_path / "sweep/state/agent/tiny.none.task3.s0.done").exists()
    assert (tmp_path / "sweep/state/eval/tiny.none.task3.s0.agent.done").exists()
    assert "agent: ml-agent" in (tmp_path / "sweep/report/report.md").read_text()


def test_agent_jobs_ask_for_their_own_resources_else_infer_s(tmp_path: Path) -> None:
    spec = yaml.safe_load(AGENT_SWEEP.read_text())
    sweep = load_sweep(AGENT_SWEEP, REPO_ROOT)
    assert sweep.resources("agent").mem == "4G" and sweep.resources("infer").mem == "6G"
    del spec["slurm"]["resources"]["agent"]
    (tmp_path / "sweep.yaml").write_text(yaml.safe_dump(spec, sort_keys=False))
    without = load_sweep(tmp_path / "sweep.yaml", REPO_ROOT)
    assert without.resources("agent") == without.resources("infer")
    agent = {j.name: j for j in jobs(without)}["agent"]
    assert "#SBATCH --mem=6G" in render(without, agent)
