"""Sweeps on a real one-node Slurm cluster (slurm/cluster.sh): plan, scripts, dependencies, preemption, resume."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import REPO_ROOT, run_cli

from mlbench_kit.errors import MLBenchError
from mlbench_kit.slurm.render import check_jobs, jobs, render
from mlbench_kit.slurm.spec import load_sweep

SAMPLE = REPO_ROOT / "examples" / "sample"


@pytest.fixture(scope="session")
def slurm():
    """Start (or reuse) the one-node cluster; the environment its clients need. A cluster these tests started is
    stopped after them (its daemons outlived the suite before)."""
    if os.geteuid() != 0 and not shutil.which("sbatch"):
        pytest.skip("needs root to start a Slurm cluster (CI runs as root; scripts/setup.sh installs slurm-wlm)")
    r = subprocess.run(["bash", "slurm/cluster.sh", "start"], cwd=REPO_ROOT, capture_output=True, text=True,
                       timeout=180)
    assert r.returncode == 0, r.stderr
    conf = r.stdout.strip().rpartition("SLURM_CONF=")[2]
    os.environ["SLURM_CONF"] = conf
    yield {"SLURM_CONF": conf}
    if "already running" not in r.stderr:
        subprocess.run(["bash", "slurm/cluster.sh", "stop"], cwd=REPO_ROOT, capture_output=True, timeout=120)


def _sh(*cmd: str) -> subprocess.CompletedProcess:
    return subprocess.run(list(cmd), capture_output=True, text=True, timeout=60)


def test_sweep_file_errors_name_the_line(tmp_path: Path) -> None:
    base = yaml.safe_load((REPO_ROOT / "configs/sweeps/tiny-cpu.yaml").read_text())
    # (change, the text of the offending line, the message)
    cases = [({"seed": [1]}, "seed:", "unknown key 'seed'"),
             ({"splits": ["none", "idd"]}, "- idd", "splits.1 must be one of 'none', 'id', 'ood'"),  # the item's line
             ({"models": {"m": {"path": "x"}}}, "  m:", "needs `train_config`"),
             ({"slurm": {"resources": {"train": {"gpu": 1}}}}, "      gpu: 1",
              "unknown key 'slurm.resources.train.gpu'"),
             ({"slurm": {"resources": {"eval": {"nodes": 2}}}}, "      nodes: 2", "only training spans nodes"),
             ({"tasks": [4]}, "tasks:", "tasks must be a list of 1, 2, 3")]
    for change, line_text, message in cases:
        f = tmp_path / "s.yaml"
        text = yaml.safe_dump({**base, **change}, sort_keys=False)
        f.write_text(text)
        line = next(i for i, ln in enumerate(text.splitlines(), 1) if ln.startswith(line_text))
        with pytest.raises(MLBenchError) as e:
            load_sweep(f, REPO_ROOT)
        assert message in e.value.what, (change, e.value.what)
        assert e.value.where == f"{f}:{line}", (change, e.value.where, line)


@pytest.mark.parametrize("path", sorted((REPO_ROOT / "configs/sweeps").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_cell_of_the_shipped_sweeps_passes_its_stage_s_own_checks(path: Path) -> None:
    # each unit's command parsed by its stage's parser, train and infer configs loaded with the flags on top
    sweep = load_sweep(path, REPO_ROOT)
    all_jobs = jobs(sweep)
    check_jobs(sweep, all_jobs)
    units = {j.stage: len(j.units) for j in all_jobs}
    assert units["prep"] == len(sweep.models) and units["report"] == 1


@pytest.mark.parametrize("path", sorted((REPO_ROOT / "configs/sweeps").glob("*.yaml")), ids=lambda p: p.stem)
def test_each_unit_s_command_resolves_to_the_config_the_sweep_checked(path: Path, monkeypatch) -> None:
    # the sweep checks a unit's options as typed configs; the job runs them as a command line: the two agree
    from mlbench_kit.cli import stage_parser
    from mlbench_kit.flags import resolve
    from mlbench_kit.stages import load_stage_config, stage
    sweep = load_sweep(path, REPO_ROOT)
    monkeypatch.chdir(REPO_ROOT)  # where the jobs run
    for job in jobs(sweep):
        if job.stage == "report":
            continue
        for unit in job.units[:3]:
            checked = load_stage_config(stage(job.stage), unit.opts, lambda key: key, REPO_ROOT)
            argv = unit.argv[1:] if job.stage == "train" else unit.argv[4:]
            args = stage_parser(job.stage, raising=True).parse_args(argv)
            assert resolve(stage(job.stage), args) == checked, (job.name, unit.key)


def test_a_unit_replays_from_its_written_config(tmp_path: Path, monkeypatch) -> None:
    # `sweep plan --scripts` writes each unit's resolved config beside the sbatch scripts; the job runs
    # `mlbench STAGE --config unit.yaml`, and so can a person replaying one cell by hand
    from mlbench_kit.cli import stage_parser
    from mlbench_kit.flags import resolve
    from mlbench_kit.stages import stage
    monkeypatch.chdir(REPO_ROOT)
    r = run_cli("mlbench", "sweep", "plan", REPO_ROOT / "configs/sweeps/paper.yaml", "--root", REPO_ROOT,
                "--scripts", tmp_path)
    assert r.returncode == 0, r.stderr
    sweep = load_sweep(REPO_ROOT / "configs/sweeps/paper.yaml", REPO_ROOT)
    all_jobs = jobs(sweep)
    check_jobs(sweep, all_jobs)
    for job in all_jobs:
        if job.stage == "report":
            continue
        text = (tmp_path / f"{job.name}.sbatch").read_text()
        for unit in job.units:
            written = tmp_path / job.name / f"{unit.key}.yaml"
            assert shlex.quote(str(written)) in text, (job.name, unit.key)
            argv = ["--config", str(written)]
            args = stage_parser(job.stage, raising=True).parse_args(argv)
            assert resolve(stage(job.stage), args) == unit.config, (job.name, unit.key)
    assert "--max-context-tokens" not in (tmp_path / "prep.sbatch").read_text()  # the options live in the files


def test_a_sweep_s_infer_split_defaults_to_infer_s_own(tmp_path: Path, monkeypatch) -> None:
    # the sweep had its own infer default (split: test) while `mlbench infer` reads full: one default, the config's
    from mlbench_kit.eval_config import EvalConfig
    from mlbench_kit.infer_config import InferConfig
    text = (REPO_ROOT / "configs/sweeps/tiny-cpu.yaml").read_text()
    section = text[text.index("\ninfer:"):text.index("\neval:")]
    assert "\n  split: test\n" in section
    f = tmp_path / "s.yaml"
    f.write_text(text.replace(section, ""))  # no infer section: every infer option at its default
    monkeypatch.chdir(REPO_ROOT)
    sweep = load_sweep(f, REPO_ROOT)
    all_jobs = jobs(sweep)
    check_jobs(sweep, all_jobs)
    splits = {(j.stage, u.config.split) for j in all_jobs if j.stage in ("infer", "eval") for u in j.units}
    assert splits == {("infer", InferConfig().split), ("eval", EvalConfig().split)} and InferConfig().split == "full"


def test_a_stage_option_typo_fails_at_plan_with_its_line(tmp_path: Path) -> None:
    # `mdoe: strict` used to pass `sweep plan` and fail only when the eval jobs started, after prep, train and infer
    text = (REPO_ROOT / "configs/sweeps/paper.yaml").read_text()
    cases = [("  workers: 16\n", "  workers: 16\n  mdoe: strict\n", "  mdoe:", "eval has no option 'mdoe'"),
             # a rule across options, checked by eval's own config (EvalConfig.check), not only its parser
             ("  workers: 16\n", "  workers: 16\n  timeout_pass: true\n", "  timeout_pass:", "strict-mode rule"),
             ("  max_context_tokens: 8192\n", "  max_context_tokens: 8192\n  tasks: [4]\n", "  tasks: [4]",
              "`tasks` are among [1, 2, 3], got [4]"),
             ("  config: configs/infer/paper.yaml\n", "  config: configs/infer/paper.yaml\n  temperature: hot\n",
              "  temperature:", "sampling.temperature must be float, got 'hot'"),
             ("  reference: configs/report/paper-rows.yaml\n", "  refrence: configs/report/paper-rows.yaml\n",
              "  refrence:", "report has no option 'refrence'"),
             ("  envs: configs/eval/mlbench.yaml\n", "  envs: configs/eval/mlbench.yaml\n  no_ci: 1\n", "  no_ci:",
              "no_ci is true or false, got 1"),
             # Llama-2: 4,096 positions; prep must leave infer's 1,024 new tokens free, or every task-1 prompt fails
             ("max_new_tokens: 1024}", "max_new_tokens: 512}", "    prep: {max_context_tokens",
              "infer generates up to 1024 new tokens, but prep left room for 512")]
    for old, new, line_text, message in cases:
        assert old in text, old
        changed = text.replace(old, new, 1)
        f = tmp_path / "s.yaml"
        f.write_text(changed)
        line = next(i for i, ln in enumerate(changed.splitlines(), 1) if ln.startswith(line_text))
        sweep = load_sweep(f, REPO_ROOT)
        with pytest.raises(MLBenchError) as e:
            check_jobs(sweep, jobs(sweep))
        assert message in e.value.what and e.value.where == f"{f}:{line}", (message, e.value.what, e.value.where)
        r = run_cli("mlbench", "sweep", "plan", f)  # the command says it too, before printing any plan
        assert r.returncode == 2 and message in r.stderr and r.stdout == "", r.stderr


@pytest.mark.parametrize("name", ["paper", "tiny-cpu"])
def test_the_training_launcher_is_srun_s_command_with_and_without_gpus(name: str) -> None:
    # a blank line inside srun's continuation once left srun with no command (CPU sweeps: no --gpus-per-node), so
    # the launcher ran outside the step and never received the USR1 that asks training to checkpoint
    sweep = load_sweep(REPO_ROOT / f"configs/sweeps/{name}.yaml", REPO_ROOT)
    text = render(sweep, next(j for j in jobs(sweep) if j.stage == "train"))
    joined = re.sub(r"\\\n", " ", text)
    srun = next(line for line in joined.splitlines() if line.startswith("srun "))
    assert "bash -c" in srun and "accelerate.commands.launch" in srun and srun.rstrip().endswith("&"), srun
    assert ("--gpus-per-node=" in srun) == (name == "paper")
    if name == "paper":  # LoRA on one node: DDP (the frozen base fits every GPU), not FSDP2's per-layer gathers
        assert "--config_file configs/accelerate/ddp.yaml" in srun


@pytest.mark.parametrize("name,cells,nodes", [("paper", 27, 1), ("paper-multinode", 27, 2)])
@pytest.mark.integration
def test_paper_sweeps_plan_and_render_valid_sbatch(name: str, cells: int, nodes: int, tmp_path: Path,
                                                    slurm: dict) -> None:
    sweep = load_sweep(REPO_ROOT / f"configs/sweeps/{name}.yaml", REPO_ROOT)
    assert len(sweep.cells()) == cells == 3 * 3 * 3
    all_jobs = {j.name: j for j in jobs(sweep)}
    assert [len(all_jobs[n].units) for n in ("prep", "train", "infer", "eval", "infer-base", "eval-base")] == \
        [3, 18, 18, 18, 9, 9]
    assert all_jobs["infer"].deps == [("afterok", "prep"), ("aftercorr", "train")]
    for job in all_jobs.values():
        script = tmp_path / f"{job.name}.sbatch"
        script.write_text(render(sweep, job))
        assert _sh("bash", "-n", str(script)).returncode == 0
        text = script.read_text()
        assert f"#SBATCH --array={','.join(str(u.index) for u in job.units)}" in text
        if job.stage == "train":
            assert f"#SBATCH --nodes={nodes}" in text and "#SBATCH --gpus-per-node=" in text
            assert "#SBATCH --requeue" in text and "#SBATCH --signal=B:USR1@600" in text
            assert '--machine_rank "$SLURM_NODEID"' in text and '--num_machines "$SLURM_NNODES"' in text
        # sbatch parses every directive and checks it against a cluster with 8 (paper) GPUs; only the size
        # of this one 2-core node is overridden on the command line
        r = _sh("sbatch", "--test-only", "--nodes=1", "--cpus-per-task=1", "--mem=100M", str(script))
        assert "to start at" in r.stderr, (job.name, r.stderr)


def _tiny_models(root: Path) -> dict[str, Path]:
    out = {}
    for name, steps in (("tiny-a", 40), ("tiny-b", 0)):
        out[name] = root / name
        r = run_cli(sys.executable, str(REPO_ROOT / "examples" / "tiny.py"),
                    "--repos", SAMPLE / "repos", "--out", out[name], "--pretrain-steps", str(steps))
        assert r.returncode == 0, r.stderr
    return out


def submit(sweep: Path) -> tuple[str, list[tuple[str, str, int]]]:
    """``mlbench sweep submit SWEEP``, which must succeed: its output and each submitted array's (name, job id,
    tasks)."""
    r = run_cli("mlbench", "sweep", "submit", sweep)
    assert r.returncode == 0, r.stderr
    return r.stdout, [(n, j, int(c)) for n, j, c in re.findall(r"^(\S+)\s+job (\d+): (\d+) task", r.stdout, re.M)]


def checked_jobs(path: Path) -> dict:
    """A sweep file's jobs by name, after the checks `mlbench sweep plan` makes."""
    sweep = load_sweep(path, REPO_ROOT)
    all_jobs = jobs(sweep)
    check_jobs(sweep, all_jobs)
    return {j.name: j for j in all_jobs}


def assert_plan_refuses(changed: str, line_text: str, message: str, tmp_path: Path) -> None:
    """A sweep file's text (``changed``) fails to load or check with ``message`` at the line starting with
    ``line_text``, and `mlbench sweep plan` says it with exit 2 before printing any plan."""
    f = tmp_path / "s.yaml"
    f.write_text(changed)
    line = next(i for i, ln in enumerate(changed.splitlines(), 1) if ln.startswith(line_text))
    with pytest.raises(MLBenchError) as e:
        checked_jobs(f)
    assert message in e.value.what and e.value.where == f"{f}:{line}", (message, e.value.what, e.value.where)
    r = run_cli("mlbench", "sweep", "plan", f, "--root", REPO_ROOT)
    assert r.returncode == 2 and message in r.stderr and r.stdout == "", r.stderr


def _status(sweep: Path) -> list[dict]:
    r = run_cli("mlbench", "sweep", "status", sweep, "--json")
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def _wait(sweep: Path, until, timeout: float = 900) -> list[dict]:
    t0 = time.time()
    while time.time() - t0 < timeout:
        rows = _status(sweep)
        if until(rows):
            return rows
        time.sleep(3)
    raise AssertionError(f"timed out: {[(r['job'], r['key'], r['state'], r['reason']) for r in rows]}")


def _log(path: str | Path) -> str:
    return Path(path).read_text(errors="replace").replace("\r", "\n")


def _tail(path: Path, chars: int) -> str:
    try:
        return _log(path)[-chars:]
    except OSError as e:
        return f"({e})"


def _diag(job_id: str, log: Path) -> str:
    """What a failed wait on a job reports: its log, Slurm's view of the job and the node, and the daemons' logs."""
    conf = Path(os.environ.get("SLURM_CONF", "/tmp/mlbench-slurm/slurm.conf"))
    daemon_logs = re.findall(r"^Slurm(?:ctld|d)LogFile=(\S+)", conf.read_text() if conf.exists() else "", re.M)
    parts = [f"--- {log} (tail)\n{_tail(log, 3000)}",
             f"--- scontrol show job {job_id}\n{_sh('scontrol', 'show', 'job', job_id).stdout}",
             f"--- sinfo -N -l\n{_sh('sinfo', '-N', '-l').stdout}"]
    parts += [f"--- {d} (tail)\n{_tail(Path(d), 4000)}" for d in daemon_logs]
    return "\n".join(parts)


_ENDED = ("BOOT_FAIL", "CANCELLED", "COMPLETED", "DEADLINE", "FAILED", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED",
          "TIMEOUT")


def _job_state(job_id: str) -> str:
    m = re.search(r"JobState=(\S+)", _sh("scontrol", "show", "job", job_id).stdout)
    return m.group(1) if m else "UNKNOWN"


def _start_now(job_id: str, log: Path) -> None:
    """Lift the ~2 minute hold Slurm puts on a requeued job, to keep the test short.

    The update only applies once the job is back to PENDING: sent while it is still completing, it is refused
    and the job waits out the hold. The new start must still fall in a later second than the requeue: slurmd
    revokes the job's credentials as of the requeue's kill request (one-second resolution) and refuses a launch
    whose credential is not newer ("Job credential revoked"), which fails the task for good; the hold Slurm sets
    (AuthInfo's cred_expire + 1 s) exists for that. StartTime=now let the backfill pass start the task in the
    requeue's own second. The kill request predates PENDING, so a start one second after seeing PENDING is safe.
    """
    t0 = time.time()
    while _job_state(job_id) != "PENDING":
        assert time.time() - t0 < 120, _diag(job_id, log)
        time.sleep(1)
    r = _sh("scontrol", "update", f"JobId={job_id}", "StartTime=now+1")
    assert r.returncode == 0, r.stderr


@pytest.mark.integration
def test_two_model_sweep_end_to_end_with_preemption_and_resume(tmp_path: Path, slurm: dict) -> None:
    models = _tiny_models(tmp_path)
    spec = yaml.safe_load((REPO_ROOT / "configs/sweeps/tiny-cpu.yaml").read_text())
    spec.update(name="citest", run_dir=str(tmp_path / "sweep"),
                models={n: {"path": str(p), "train_config": "configs/train/tiny-cpu.yaml"} for n, p in models.items()})
    # tiny-a trains long enough to be interrupted: checkpoints every 10 steps
    spec["models"]["tiny-a"]["train"] = {"max_steps": 240, "set": ["data.eval_fraction=0", "checkpoint.every_steps=10"]}
    spec["train"] = {"max_steps": 12, "set": ["data.eval_fraction=0"]}
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(yaml.safe_dump(spec, sort_keys=False))
    run_dir = tmp_path / "sweep"

    out, submitted = submit(sweep)
    assert [(n, c) for n, _, c in submitted] == [("prep", 2), ("train", 2), ("infer", 2), ("eval", 2),
                                                  ("infer-base", 2), ("eval-base", 2), ("report", 1)]
    ids = {n: j for n, j, _ in submitted}
    assert f"after afterok:{ids['prep']},aftercorr:{ids['train']}" in out  # the chain Slurm enforces

    # a second submit while jobs wait is refused, not doubled
    again = run_cli("mlbench", "sweep", "submit", sweep)
    assert again.returncode == 2 and "still queued or running" in again.stderr

    # preempt tiny-a's training once it has a complete checkpoint: USR1 to the batch shell, as Slurm sends it
    # --signal=B:USR1@N before the time limit
    train_a = run_dir / "tiny-a" / "id" / "task3" / "s0" / "train"
    t0 = time.time()
    while not list(train_a.glob("checkpoints/step-*/COMPLETE")):
        assert time.time() - t0 < 600, _status(sweep)
        time.sleep(0.5)
    task_a = next(r for r in _status(sweep) if r["job"] == "train" and r["key"].startswith("tiny-a"))
    assert _sh("scancel", "--batch", "--signal=USR1", task_a["slurm_id"]).returncode == 0
    log_a = run_dir / "logs" / f"train-{task_a['slurm_id']}.out"
    t0 = time.time()
    while "Restarts=1" not in _sh("scontrol", "show", "job", task_a["slurm_id"]).stdout:
        assert time.time() - t0 < 120, _diag(task_a["slurm_id"], log_a)
        time.sleep(1)
    saved = (train_a / "PREEMPTED").read_text().strip()
    _start_now(task_a["slurm_id"], log_a)

    # then Slurm's own requeue (what preemption does): SIGTERM to every process, the job requeued by Slurm.
    # The resumed task may wait for the node while tiny-b's infer and eval hold its CPUs: a hang guard, not a timing.
    # A task that ended without a new checkpoint (its relaunch refused, say) fails the test at once, not at the guard.
    t0 = time.time()
    while max(p.parent.name for p in train_a.glob("checkpoints/step-*/COMPLETE")) <= Path(saved).name:
        ended = _job_state(task_a["slurm_id"]) in _ENDED
        assert not ended and time.time() - t0 < 900, _diag(task_a["slurm_id"], log_a)  # a checkpoint after the resume
        time.sleep(0.5)
    assert _sh("scontrol", "requeue", task_a["slurm_id"]).returncode == 0
    t0 = time.time()
    while not (train_a / "PREEMPTED").exists() or (train_a / "PREEMPTED").read_text().strip() == saved:
        assert time.time() - t0 < 120, _diag(task_a["slurm_id"], log_a)
        time.sleep(0.5)
    saved2 = (train_a / "PREEMPTED").read_text().strip()
    _start_now(task_a["slurm_id"], log_a)

    rows = _wait(sweep, lambda rows: all(r["state"] in ("done", "failed", "cancelled") for r in rows))
    assert all(r["state"] == "done" for r in rows), [(r["job"], r["key"], r["state"]) for r in rows]

    log = _log(log_a)
    assert "requeued; the next run resumes" in log and "restart 1" in log and "restart 2" in log
    for ckpt in (saved, saved2):
        step = int(re.search(r"step-(\d+)", ckpt).group(1))
        assert f"resumed from {ckpt} (step {step})" in log
    assert saved2 > saved
    metrics = [json.loads(x) for x in (train_a / "metrics.jsonl").read_text().splitlines()]
    assert len([m for m in metrics if m.get("event") == "preempted"]) == 2
    assert max(m.get("step", 0) for m in metrics) == 240  # finished after the resumes

    # Slurm ran each chain in order: a cell's infer began after its train wrote the adapter
    for model in models:
        cell = run_dir / model / "id" / "task3" / "s0"
        started = min(p.stat().st_mtime for p in (cell / "infer").iterdir())
        assert (cell / "train" / "adapter" / "adapter_config.json").stat().st_mtime < started

    report = (run_dir / "report" / "report.md").read_text()
    for label in ("tiny-a/none", "tiny-a/id", "tiny-b/none", "tiny-b/id"):  # 12 ID test rows (toyvision is OOD)
        assert f"| {label} | 3 | 1 | 12 |" in report
    assert (run_dir / "report" / "report_repos.png").stat().st_size > 1000

    # re-submitting skips finished work: everything done -> nothing submitted; one eval removed -> only it
    r = run_cli("mlbench", "sweep", "submit", sweep)
    assert r.returncode == 0 and "everything is done" in r.stdout
    (run_dir / "state" / "eval" / "tiny-b.id.task3.s0.done").unlink()
    shutil.rmtree(run_dir / "tiny-b" / "id" / "task3" / "s0" / "eval")
    assert [(n, c) for n, _, c in submit(sweep)[1]] == [("eval", 1), ("report", 1)]
    _wait(sweep, lambda rows: all(r["state"] == "done" for r in rows), timeout=300)
    assert (run_dir / "tiny-b" / "id" / "task3" / "s0" / "eval" / "summary.json").exists()


@pytest.mark.integration
def test_a_refused_array_leaves_the_submitted_ones_on_record(tmp_path: Path, slurm: dict) -> None:
    spec = yaml.safe_load((REPO_ROOT / "configs/sweeps/tiny-cpu.yaml").read_text())
    spec.update(name="refused", run_dir=str(tmp_path / "sweep"))
    spec["slurm"]["resources"]["report"]["mem"] = "100000G"  # more than any node: sbatch refuses the last array
    # and the submitted ones stay queued: run, prep fails at once (no models here), Slurm cancels its dependents
    # and the second submit below found nothing queued when it came a second or two later (under load). Not
    # --hold: sbatch takes a held job without checking that a node can ever run it.
    spec["slurm"]["extra"] = ["--begin=now+1hour"]
    sweep = tmp_path / "sweep.yaml"
    sweep.write_text(yaml.safe_dump(spec, sort_keys=False))
    r = run_cli("mlbench", "sweep", "submit", sweep)
    try:
        assert r.returncode == 2 and "sbatch refused report" in r.stderr
        record = json.loads((tmp_path / "sweep" / "submissions.jsonl").read_text())
        assert list(record["jobs"]) == ["prep", "train", "infer", "eval", "infer-base", "eval-base"]
        again = run_cli("mlbench", "sweep", "submit", sweep)
        assert again.returncode == 2 and "still queued or running" in again.stderr  # not submitted twice
    finally:
        for line in (tmp_path / "sweep" / "submissions.jsonl").read_text().splitlines():
            _sh("scancel", *[j["job_id"] for j in json.loads(line)["jobs"].values()])


def test_the_training_job_gives_torchrun_s_agent_time_for_the_agreed_save(tmp_path: Path) -> None:
    """torchrun's agent SIGKILLs workers 30 s after forwarding a SIGTERM by default; the job sets its handled
    signals and grace period where torch 2.13 reads them, checked by torch's own parser and launch config."""
    sweep = load_sweep(REPO_ROOT / "configs/sweeps/paper.yaml", REPO_ROOT)
    text = render(sweep, next(j for j in jobs(sweep) if j.stage == "train"))
    exports = [ln for ln in text.splitlines() if ln.startswith(("export PET_", "export TORCH_ELASTIC"))]
    assert len(exports) == 2, exports
    probe = ("import torch.distributed.run as r; from torch.distributed.launcher.api import LaunchConfig; "
             "a = r.get_args_parser().parse_args(['x.py']); "
             "print(a.signals_to_handle, LaunchConfig(1, 1, 1, shutdown_timeout=a.shutdown_timeout).shutdown_timeout)")
    script = tmp_path / "probe.sh"
    script.write_text("\n".join(exports) + f'\n"{sys.executable}" -c "{probe}"\n')
    r = subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=120,
                       env={k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCH_ELASTIC"))})
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["SIGTERM,SIGINT,SIGHUP,SIGQUIT", str(sweep.cfg.slurm.signal_before_s)]


# (where in the sweep file, the hostile value, text that finds its line): a line break in any of them ended the #SBATCH
# block (or the export) and ran the rest as a command when the job started (issue 41 item 5)
HOSTILE_SLURM = [(("slurm", "partition"), "gpu\ntouch {m}", "partition:"),
                 (("slurm", "account"), "acct\ntouch {m}", "account:"),
                 (("slurm", "resources", "infer", "time"), "00:20:00\ntouch {m}", "time: '00:20:00"),
                 (("slurm", "resources", "infer", "mem"), "6G\ntouch {m}", "mem: '6G"),
                 (("slurm", "resources", "infer", "time"), "$(touch {m})", "$(touch"),
                 (("slurm", "env", "X=$(touch {m});Y"), "1", "X=$(touch"),
                 (("slurm", "extra"), ["--exclusive\ntouch {m}"], "--exclusive"),
                 (("run_dir",), "runs/x\ntouch {m}", "run_dir: 'runs/x")]


def _hostile_sweep(tmp_path: Path, path: tuple[str, ...], value: Any, marker: Path) -> Path:
    raw = yaml.safe_load((REPO_ROOT / "configs/sweeps/tiny-cpu.yaml").read_text())
    raw["run_dir"] = str(tmp_path / "run")
    node = raw
    for k in path[:-1]:
        node = node.setdefault(k, {})
    key = path[-1].format(m=marker)
    node[key] = ([v.format(m=marker) for v in value] if isinstance(value, list) else value.format(m=marker))
    f = tmp_path / "hostile.yaml"
    f.write_text(yaml.safe_dump(raw, sort_keys=False, width=1000))
    return f


@pytest.mark.parametrize("path, value, snippet", HOSTILE_SLURM, ids=lambda x: x if isinstance(x, str) else None)
def test_a_sweep_value_that_would_run_as_shell_is_refused_at_its_line(tmp_path: Path, path: tuple[str, ...],
                                                                       value: Any, snippet: str) -> None:
    f = _hostile_sweep(tmp_path, path, value, tmp_path / "ran")
    text = f.read_text()
    line = next(i for i, ln in enumerate(text.splitlines(), 1) if snippet in ln)
    with pytest.raises(MLBenchError) as e:
        load_sweep(f, REPO_ROOT)
    assert e.value.where == f"{f}:{line}", (e.value.where, line, text)
    assert "Slurm's syntax" in e.value.what or "control character" in e.value.what, e.value.what


def _run_script(tmp_path: Path, text: str, index: int) -> subprocess.CompletedProcess:
    """The rendered script run by bash as Slurm would (its #SBATCH lines are comments to bash), "$PY" a stand-in
    that records the variables the sweep exported."""
    fake_py = tmp_path / "py"
    fake_py.write_text(f'#!/bin/bash\nprintf "%s\\0" "$A" "$B" "$C" > {shlex.quote(str(tmp_path / "seen"))}\n')
    fake_py.chmod(0o755)
    script = tmp_path / "job.sbatch"
    script.write_text(text)
    env = {**os.environ, "SLURM_ARRAY_TASK_ID": str(index), "SLURM_ARRAY_JOB_ID": "1", "MLBENCH_PYTHON": str(fake_py)}
    return subprocess.run(["bash", str(script)], capture_output=True, text=True, timeout=60, env=env)


def test_hostile_sweep_values_stay_data_in_the_rendered_script(tmp_path: Path) -> None:
    """The rendered script run with bash: values that are data (a folder, variables) hold `$(…)`, backticks, quotes
    and line breaks and run nothing; a line-breaking value that reached the renderer some other way than the checked
    sweep file (the spec refuses those) is refused there, and never runs."""
    marks = [tmp_path / f"m{i}" for i in range(6)]
    raw = yaml.safe_load((REPO_ROOT / "configs/sweeps/tiny-cpu.yaml").read_text())
    raw["run_dir"] = str(tmp_path / f"run $(touch {marks[0]}) `touch {marks[1]}` 'q\"")
    hostile_env = {"A": f"$(touch {marks[2]})", "B": f"x\ntouch {marks[3]}", "C": f"'; touch {marks[4]}; '\""}
    raw["slurm"]["env"] = hostile_env
    f = tmp_path / "s.yaml"
    f.write_text(yaml.safe_dump(raw, sort_keys=False))
    sweep = load_sweep(f, REPO_ROOT)
    job = next(j for j in jobs(sweep) if j.name == "infer-base")
    r = _run_script(tmp_path, render(sweep, job), job.units[0].index)
    assert r.returncode == 0, r.stderr
    assert (sweep.run_dir / "state" / "infer" / f"{job.units[0].key}.done").is_file()  # the script ran to its end
    assert (tmp_path / "seen").read_text().split("\0")[:3] == list(hostile_env.values())
    assert not [m for m in marks if m.exists()]
    # values that bypass the sweep file's checks: the renderer refuses them rather than write a line break
    s, res = sweep.cfg.slurm, sweep.cfg.slurm.resources["infer"]
    for i, (obj, attr, value) in enumerate([(s, "partition", "gpu\ntouch {m}"), (s, "account", "a\ntouch {m}"),
                                            (res, "time", "1\ntouch {m}"), (res, "mem", "1G\ntouch {m}"),
                                            (s, "extra", ["--exclusive\ntouch {m}"]),
                                            (s, "env", {"X=1\ntouch {m}\nY": "1"})]):
        m = tmp_path / f"late{i}"
        old = getattr(obj, attr)
        setattr(obj, attr, {k.format(m=m): v for k, v in value.items()} if isinstance(value, dict)
                else [v.format(m=m) for v in value] if isinstance(value, list) else value.format(m=m))
        try:
            text = render(sweep, job)
        except MLBenchError as exc:
            assert "line" in exc.what or "name" in exc.what, exc.what
        else:
            _run_script(tmp_path, text, job.units[0].index)
        setattr(obj, attr, old)
        assert not m.exists(), f"{attr}: the rendered script ran a command"
