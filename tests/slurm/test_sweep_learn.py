"""Learning in a sweep (configs/sweeps/tiny-cpu-learn.yaml): a learn unit per tuned cell after its training, the
learned adapter through infer and eval as train's, the checks at plan with the sweep file's line, the sbatch
scripts; and one real run of a learn chain on the one-node Slurm cluster, the report naming the method and round."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO_ROOT, run_cli
from test_slurm import (  # the sweep tests' own helpers
    _status,
    _wait,
    assert_plan_refuses,
    checked_jobs,
    slurm,  # noqa: F401  (the one-node cluster, a fixture)
    submit,
)

from mlbench_kit.errors import MLBenchError
from mlbench_kit.learn_config import LearnConfig
from mlbench_kit.slurm.render import jobs, render
from mlbench_kit.slurm.spec import load_sweep

LEARN_SWEEP = REPO_ROOT / "configs/sweeps/tiny-cpu-learn.yaml"


def test_a_learn_unit_runs_after_train_from_its_adapter_and_the_learned_one_is_scored_as_train_s() -> None:
    by_name = checked_jobs(LEARN_SWEEP)
    assert list(by_name) == ["prep", "train", "infer", "eval", "infer-base", "eval-base", "learn", "infer-learn",
                             "eval-learn", "report"]
    assert by_name["learn"].deps == [("afterok", "prep"), ("aftercorr", "train")]
    assert by_name["infer-learn"].deps == [("aftercorr", "learn")]
    assert by_name["eval-learn"].deps == [("aftercorr", "infer-learn")]
    assert {("afterany", n) for n in ("learn", "infer-learn", "eval-learn")} <= set(by_name["report"].deps)
    trains = {u.index: u for u in by_name["train"].units}
    infers = {u.index: u for u in by_name["infer"].units}
    evals = {u.index: u for u in by_name["eval"].units}
    learns, infer_learned, eval_learned = (by_name[n].units for n in ("learn", "infer-learn", "eval-learn"))
    # one learn unit per tuned cell, array task i after train's task i (aftercorr pairs the same indices)
    assert [u.index for u in learns] == [u.index for u in infer_learned] == [u.index for u in eval_learned] \
        == list(trains) and len(learns) == 1
    for unit, inf, ev in zip(learns, infer_learned, eval_learned, strict=True):
        cfg, train, infer = unit.config, trains[unit.index].config, infers[unit.index].config
        assert isinstance(cfg, LearnConfig)
        # loaded from the sweep's learn section on top of its config file, as `mlbench learn` would
        assert (cfg.method, cfg.rft.rounds, cfg.rft.k, cfg.rft.infer_config) == ("rft", 1, 4,
                                                                                 "configs/infer/tiny-hf.yaml")
        # the cell's model, its SFT adapter, its training split, the split its infer scores (the leak check's)
        assert (cfg.model, cfg.adapter) == (train.model, str(Path(str(train.out)) / "adapter"))
        assert (cfg.prep_dir, cfg.split, cfg.eval_split, cfg.task, cfg.seed) == (
            train.data.prep_dir, "id_train", infer.split, 3, 0)
        # the checker's rows, environments and sandbox are eval's: a reward is eval's verdict
        assert (cfg.data, cfg.envs, cfg.backend) == (evals[unit.index].config.data, evals[unit.index].config.envs,
                                                     evals[unit.index].config.backend)
        cfg.require_inputs()
        # the learned adapter goes through infer as the SFT adapter does (the same options), into its own folders
        assert inf.config.adapter == str(Path(str(cfg.out)) / "adapter") and Path(inf.out).name == "infer-learn"
        assert (inf.config.split, inf.config.sampling, inf.config.model) == (infer.split, infer.sampling, infer.model)
        assert ev.config.generations == str(Path(inf.out) / "task3.jsonl") and Path(ev.out).name == "eval-learn"
        assert (inf.key, ev.key) == (unit.key + ".learn", unit.key + ".learn")  # done-markers apart from train's
    report = by_name["report"].units[0].argv
    assert f"tiny-pretrained/id+rft={eval_learned[0].out}" in report
    assert f"tiny-pretrained/id={evals[eval_learned[0].index].out}" in report


def test_the_learn_jobs_run_from_their_written_configs_with_their_own_resources(tmp_path: Path, monkeypatch) -> None:
    from mlbench_kit.cli import stage_parser
    from mlbench_kit.flags import resolve
    from mlbench_kit.stages import stage
    monkeypatch.chdir(REPO_ROOT)
    r = run_cli("mlbench", "sweep", "plan", LEARN_SWEEP, "--root", REPO_ROOT, "--scripts", tmp_path)
    assert r.returncode == 0, r.stderr
    assert re.search(r"^learn: 1 task\(s\), \d+ done; after afterok:prep, aftercorr:train;", r.stdout, re.M)
    assert re.search(r"^infer-learn: 1 task\(s\), \d+ done; after aftercorr:learn;", r.stdout, re.M)
    by_name = checked_jobs(LEARN_SWEEP)
    text = (tmp_path / "learn.sbatch").read_text()
    assert "#SBATCH --mem=6G" in text and "#SBATCH --time=00:40:00" in text and "srun" not in text
    for unit in by_name["learn"].units:
        written = tmp_path / "learn" / f"{unit.key}.yaml"
        assert f'CMD=("$PY" -m mlbench_kit.cli learn --config {shlex.quote(str(written))});;' in text
        args = stage_parser("learn", raising=True).parse_args(["--config", str(written)])
        assert resolve(stage("learn"), args) == unit.config  # the file alone is the unit
    for name, stage_name in (("infer-learn", "infer"), ("eval-learn", "eval")):
        script = (tmp_path / f"{name}.sbatch").read_text()
        for unit in by_name[name].units:
            written = tmp_path / name / f"{unit.key}.yaml"
            assert f"cli {stage_name} --config {shlex.quote(str(written))}" in script
    report = (tmp_path / "report.sbatch").read_text()
    assert "tiny-pretrained/id+rft=" in report and "/eval-learn" in report
    # without resources.learn: train's, on one node (learn runs as one process)
    spec = yaml.safe_load(LEARN_SWEEP.read_text())
    del spec["slurm"]["resources"]["learn"]
    spec["slurm"]["resources"]["train"].update(nodes=2, gpus_per_node=2)
    f = tmp_path / "s.yaml"
    f.write_text(yaml.safe_dump(spec, sort_keys=False))
    sweep = load_sweep(f, REPO_ROOT)
    learn = {j.name: j for j in jobs(sweep)}["learn"]
    text = render(sweep, learn)
    assert "#SBATCH --nodes=1" in text and "#SBATCH --gpus-per-node=2" in text and "#SBATCH --mem=4G" in text


def test_a_learn_unit_executes_under_eval_s_time_limit(tmp_path: Path) -> None:
    """A sweep's eval time limit (its option, or its config file's) is learn's too: the rewards are verdicts under
    the limit the learned adapter is scored with. Before, learn ran every execution under the benchmark's default."""
    text = LEARN_SWEEP.read_text()
    f = tmp_path / "sweep.yaml"
    envs = "  envs: configs/eval/sample.yaml\n"
    f.write_text(text.replace(envs, envs + "  timeout: 45\n"))
    by_name = checked_jobs(f)
    assert [u.config.timeout for u in by_name["learn"].units] == [45.0]
    assert [u.config.timeout for u in by_name["eval"].units] == [45.0] * len(by_name["eval"].units)
    eval_cfg = tmp_path / "eval.yaml"
    eval_cfg.write_text("timeout: 25\n")
    f.write_text(text.replace(envs, envs + f"  config: {eval_cfg}\n"))
    assert [u.config.timeout for u in checked_jobs(f)["learn"].units] == [25.0]
    # without one, learn's config file keeps its own (the tiny one's 20 s); a learn section that sets another than
    # eval's is refused at its line
    assert [u.config.timeout for u in checked_jobs(LEARN_SWEEP)["learn"].units] == [20.0]
    changed = text.replace(envs, envs + "  timeout: 45\n")
    assert_plan_refuses(changed.replace("  method: rft\n", "  method: rft\n  timeout: 30\n"), "  timeout: 30",
                        "learn's rewards would come from other timeout (30.0) than eval scores with (45.0)", tmp_path)


def test_a_sweep_without_a_learn_section_plans_no_learn_job() -> None:
    for path in ("tiny-cpu.yaml", "paper.yaml"):
        names = list(checked_jobs(REPO_ROOT / "configs/sweeps" / path))
        assert not any("learn" in n for n in names), names


# (old text, new text, the start of the offending line, the message)
CASES = [
    ("  method: rft\n", "  method: rft\n  roundz: 2\n", "  roundz:", "learn has no option 'roundz'"),
    ("  method: rft\n", "  method: rft\n  k: many\n", "  k: many", "rft.k must be int, got 'many'"),
    ("  method: rft\n", "  method: rft\n  k: 0\n", "  k: 0", "rft.k must be at least 1, got 0"),
    ("  method: rft\n", "  method: sft\n", "  method: sft", "method must be one of"),
    ("  method: rft\n", "  method: dpo\n", "  method: dpo", "method 'dpo' needs the training split's generations"),
    ("  method: rft\n", "  method: data\n", "  method: data", "method 'data' writes no adapter"),
    ("  method: rft\n", "  method: rft\n  model: other/model\n", "  model:",
     "learn's model is the cell's (runs/tiny/pretrained), not other/model"),
    ("  method: rft\n", "  method: rft\n  split: ood_train\n", "  split: ood",
     "learn's split is the cell's (id_train), not ood_train"),
    ("  method: rft\n", "  method: rft\n  eval_split: full\n", "  eval_split:",
     "learn's eval_split is the cell's (test), not full"),
    ("  method: rft\n", "  method: rft\n  set: [seed=3]\n", "  set: [seed",
     "learn's seed is the cell's (0), not 3"),
    ("  method: rft\n", "  method: rft\n  envs: configs/eval/mlbench.yaml\n", "  envs:",
     "learn's rewards would come from other envs (configs/eval/mlbench.yaml) than eval scores with"),
    ("  method: rft\n", "  method: rft\n  backend: podman\n", "  backend:",
     "learn's rewards would come from other backend (podman) than eval scores with (bwrap)"),
    ("  config: configs/learn/tiny-cpu.yaml ", "  config: configs/learn/tiny.yaml ", "  config: configs/learn",
     "learn.config not found: configs/learn/tiny.yaml"),
    ("  method: rft\n", "  method: rft\n  set: [rft.train_config=configs/train/tiny.yaml]\n", "  set: [rft",
     "rft.train_config not found: configs/train/tiny.yaml"),
    ("splits: [none, id]", "splits: [none]", "learn:", "the sweep trains none (splits: [none])"),
    ("  tiny-pretrained: {path: runs/tiny/pretrained, train_config: configs/train/tiny-cpu.yaml}",
     "  tiny-pretrained: {path: runs/tiny/pretrained, train_config: configs/train/tiny-cpu.yaml, "
     "learn: {workers: 0}}", "  tiny-pretrained:", "workers must be at least 1"),
]


@pytest.mark.parametrize("old,new,line_text,message", CASES, ids=[c[3][:40] for c in CASES])
def test_a_learn_option_mistake_fails_at_plan_with_the_sweep_file_s_line(old: str, new: str, line_text: str,
                                                                        message: str, tmp_path: Path) -> None:
    text = LEARN_SWEEP.read_text()
    assert old in text, old
    assert_plan_refuses(text.replace(old, new, 1), line_text, message, tmp_path)


def test_model_learn_options_need_the_sweep_s_learn_section(tmp_path: Path) -> None:
    text = (REPO_ROOT / "configs/sweeps/tiny-cpu.yaml").read_text()
    old = "  tiny-random: {path: runs/tiny/random, train_config: configs/train/tiny-cpu.yaml}"
    changed = text.replace(old, old[:-1] + ", learn: {method: grpo}}")
    f = tmp_path / "s.yaml"
    f.write_text(changed)
    line = next(i for i, ln in enumerate(changed.splitlines(), 1) if ln.startswith("  tiny-random:"))
    with pytest.raises(MLBenchError) as e:
        load_sweep(f, REPO_ROOT)
    assert "has learn options but the sweep has no `learn:` section" in e.value.what
    assert e.value.where == f"{f}:{line}"



@pytest.mark.integration
@pytest.mark.usefixtures("slurm")
@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")
def test_a_learn_chain_runs_on_the_cluster_and_the_report_names_the_learned_checkpoint(tmp_path: Path) -> None:
    # configs/sweeps/tiny-cpu-learn.yaml's ID cell on a tiny model, made cheap: 12 training steps, infer through
    # transformers (no vLLM engine to start), one rft round of k = 2; every unit submitted to the one-node cluster
    model = tmp_path / "tiny"
    r = run_cli(sys.executable, str(REPO_ROOT / "examples" / "tiny.py"), "--repos", REPO_ROOT / "examples/sample/repos",
                "--out", model, "--pretrain-steps", "40")
    assert r.returncode == 0, r.stderr
    spec = yaml.safe_load(LEARN_SWEEP.read_text())
    spec.update(name="learntest", run_dir=str(tmp_path / "sweep"), splits=["id"],
                models={"tiny": {"path": str(model), "train_config": "configs/train/tiny-cpu.yaml"}})
    spec["train"] = {"max_steps": 12, "set": ["data.eval_fraction=0"]}
    spec["infer"] = {"config": "configs/infer/tiny-hf.yaml", "split": "test", "n": 2}
    spec["learn"]["set"] = ["rft.k=2"]
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(yaml.safe_dump(spec, sort_keys=False))
    run_dir = tmp_path / "sweep"

    out, submitted = submit(sweep)
    assert [n for n, _, _ in submitted] == ["prep", "train", "infer", "eval", "learn", "infer-learn", "eval-learn",
                                            "report"]
    ids = {n: j for n, j, _ in submitted}
    assert f"learn       job {ids['learn']}: 1 task(s), after afterok:{ids['prep']},aftercorr:{ids['train']}" \
        in out
    assert f"after aftercorr:{ids['learn']}" in out and f"after aftercorr:{ids['infer-learn']}" in out
    rows = _wait(sweep, lambda rows: all(r["state"] in ("done", "failed", "cancelled") for r in rows), timeout=1800)
    assert all(r["state"] == "done" for r in rows), [(r["job"], r["key"], r["state"], r["log"]) for r in rows]
    assert {r["job"] for r in _status(sweep)} >= {"learn", "infer-learn", "eval-learn"}

    cell = run_dir / "tiny" / "id" / "task3" / "s0"
    learn = cell / "learn"
    assert yaml.safe_load((learn / "config.yaml").read_text())["adapter"] == str(cell / "train" / "adapter")
    meta = json.loads((learn / "adapter" / "mlbench_train.json").read_text())
    assert meta["learned"]["method"] == "rft" and meta["learned"]["from_adapter"] == str(cell / "train" / "adapter")
    rounds = [json.loads(x) for x in (learn / "rounds.jsonl").read_text().splitlines()]
    assert [x["round"] for x in rounds] == [1] and rounds[0]["answers"] > 0  # its samples were executed
    # Slurm ran the chain in order: learn after train's adapter, the learned adapter's infer after learn's
    assert (cell / "train" / "adapter" / "adapter_config.json").stat().st_mtime < \
        (learn / "learn.json").stat().st_mtime
    assert (learn / "adapter" / "adapter_config.json").stat().st_mtime < \
        (cell / "infer-learn" / "infer.json").stat().st_mtime
    served = json.loads((cell / "infer-learn" / "infer.json").read_text())["adapter"]["name"]
    assert Path(served) == (learn / "adapter").resolve()
    summary = json.loads((cell / "eval-learn" / "summary.json").read_text())
    assert Path(summary["generations"]) == cell / "infer-learn" / "task3.jsonl"
    assert (run_dir / "state" / "learn" / "tiny.id.task3.s0.done").exists()
    assert (run_dir / "state" / "infer" / "tiny.id.task3.s0.learn.done").exists()

    report = (run_dir / "report" / "report.md").read_text()
    samples = summary["metrics"]["overall"]["samples"]
    assert f"| tiny/id | 3 | 1 | {samples} | SFT |" in report, report
    assert f"| tiny/id+rft | 3 | 1 | {samples} | rft round 1 of 1 |" in report, report
    assert "CodeLlama-ID (paper) *(quoted)*" in report  # the paper's rows, quoted as in every report
