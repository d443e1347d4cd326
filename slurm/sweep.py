"""`mlbench sweep plan|submit|status`: run a sweep file on a Slurm cluster.

``plan`` prints every job array and what is already done; ``submit`` writes the sbatch scripts into the run
folder and submits them with their dependencies (finished work is skipped, so re-submitting after a failure
runs only what is missing); ``status`` reads the queue and the run folder.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import yaml

from mlbench_kit.errors import MLBenchError
from mlbench_kit.escape import visible
from mlbench_kit.io import AppendLog, read_jsonl_tolerant, write_atomic

from .render import ArrayJob, check_jobs, done_marker, jobs, render, write_unit_configs
from .spec import Sweep, load_sweep

ACTIVE = {"PENDING", "RUNNING", "CONFIGURING", "COMPLETING", "REQUEUED", "RESIZING", "SUSPENDED", "REQUEUE_HOLD",
          "REQUEUE_FED", "SIGNALING", "STAGE_OUT"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``mlbench sweep``."""
    sub = p.add_subparsers(dest="action", required=True)
    for name, help_ in (("plan", "print the job arrays and what is already done"),
                        ("submit", "write sbatch scripts into the run folder and submit them"),
                        ("status", "what ran, failed or waits (squeue/sacct and the run folder)")):
        a = sub.add_parser(name, help=help_, description=help_)
        a.add_argument("sweep", help="sweep file (configs/sweeps/*.yaml)")
        a.add_argument("--root", default=".", help="repository root the jobs run in (default: here)")
        if name == "plan":
            a.add_argument("--scripts", help="also write the sbatch scripts (all units) into this folder")
        if name == "status":
            a.add_argument("--json", action="store_true", help="print the status of every unit as JSON")


# what Slurm's clients print when no controller answers (no configuration, a daemon down, a wrong host or port,
# authentication that fails): not the sweep's fault
_UNREACHABLE = re.compile(r"Unable to contact slurm controller|Could not establish a configuration source|"
                          r"connect failure|Connection refused|Socket timed out|Zero Bytes were transmitted|"
                          r"Communication connection failure|Unable to resolve \"|resolve_ctls_from_dns_srv|"
                          r"Invalid authentication credential|"
                          r"[Mm]unge")
UNREACHABLE_FIX = ("check that the controller answers: `sinfo` and `scontrol ping` (on a cluster: a login node, its "
                   "Slurm module loaded, e.g. `module load slurm`, and $SLURM_CONF); the project's test cluster: "
                   "bash slurm/cluster.sh start, then export the SLURM_CONF it prints")


def unreachable(cmd: str, stderr: str, note: str = "") -> MLBenchError:
    """Slurm's clients could not reach a controller: say so, with the client's own words and what to check."""
    said = " ".join(ln.strip() for ln in stderr.strip().splitlines()[-3:])[:300]
    return MLBenchError(f"Slurm is not reachable: `{cmd}` failed ({said})",
                        f"SLURM_CONF={os.environ.get('SLURM_CONF', '(unset)')}", UNREACHABLE_FIX + note)


def warn_default_partition(sweep: Sweep) -> None:
    """One line when the sweep names no partition: its jobs go wherever the cluster's default one is."""
    if sweep.cfg.slurm.partition is None:
        print(f"sweep: warning: slurm.partition is not set ({sweep.lines.at('slurm.partition')}): jobs go to the "
              "cluster's default partition (`sinfo -s` marks it with *); set `partition: NAME` under `slurm:`",
              file=sys.stderr)


def _pending_units(sweep: Sweep, job: ArrayJob) -> list:
    if job.stage == "report":
        return job.units
    return [u for u in job.units if not done_marker(sweep, job.stage, u.key).exists()]


def plan(args: argparse.Namespace) -> int:
    sweep = load_sweep(args.sweep, args.root)
    all_jobs = jobs(sweep)
    check_jobs(sweep, all_jobs)
    warn_default_partition(sweep)
    print(f"sweep {sweep.name}: {len(sweep.models)} model(s) x splits {sweep.cfg.splits} x tasks "
          f"{sweep.cfg.tasks} x seeds {sweep.cfg.seeds} = {len(sweep.cells())} cells; run folder {sweep.run_dir}")
    for job in all_jobs:
        todo = _pending_units(sweep, job)
        deps = ", ".join(f"{k}:{n}" for k, n in job.deps) or "none"
        r = sweep.resources(job.stage)
        print(f"\n{job.name}: {len(job.units)} task(s), {len(job.units) - len(todo)} done; after {deps}; "
              f"{r.nodes} node(s) x {r.gpus_per_node} GPU, {r.cpus} CPUs, {r.time}")
        for u in job.units:
            mark = "todo" if u in todo else "done"
            print(f"  [{u.index:>3}] {mark}  {u.key}  -> {u.out}")
        if args.scripts:
            scripts = Path(args.scripts).resolve()  # the jobs run in the root, not here
            write_unit_configs(scripts, job)
            write_atomic(scripts / f"{job.name}.sbatch", render(sweep, job, scripts))
    if args.scripts:
        print(f"\nscripts: {args.scripts}")
    return 0


def _run(cmd: list[str]) -> subprocess.CompletedProcess:
    if not shutil.which(cmd[0]):
        raise MLBenchError(f"`{cmd[0]}` not found: this needs a Slurm client", None,
                           "run on a cluster login node, or start a test cluster: bash slurm/cluster.sh start")
    return subprocess.run(cmd, capture_output=True, text=True)


def _queue() -> dict[str, tuple[str, str]]:
    """``{"123_4": (state, reason)}`` for this user's jobs Slurm still knows about."""
    r = _run(["squeue", "--me", "-h", "-r", "-t", "all", "-o", "%i|%T|%r"])
    if r.returncode != 0:
        raise unreachable("squeue", r.stderr)
    out = {}
    for line in r.stdout.splitlines():
        jid, state, reason = (line.split("|") + ["", ""])[:3]
        out[jid.strip()] = (state.strip(), reason.strip())
    return out


def _accounting(ids: list[str]) -> dict[str, str]:
    """Final states from sacct where the cluster keeps accounting (empty otherwise)."""
    if not ids or not shutil.which("sacct"):
        return {}
    r = subprocess.run(["sacct", "-n", "-P", "-X", "-j", ",".join(sorted({i.split("_")[0] for i in ids})),
                        "-o", "JobID,State"], capture_output=True, text=True)
    if r.returncode != 0:
        return {}
    return {line.split("|")[0]: line.split("|")[1].split()[0] for line in r.stdout.splitlines() if "|" in line}


def _submissions(sweep: Sweep) -> list[dict[str, Any]]:
    return read_jsonl_tolerant(sweep.run_dir / "submissions.jsonl")


def unit_status(sweep: Sweep) -> list[dict[str, Any]]:
    """One record per (job array, unit): done, pending, running, failed, cancelled or not submitted."""
    subs = _submissions(sweep)
    latest: dict[tuple[str, int], str] = {}
    for s in subs:
        for name, j in s["jobs"].items():
            for idx in j["units"]:
                latest[(name, int(idx))] = f"{j['job_id']}_{idx}"
    queue = _queue() if latest else {}
    acct = _accounting(list(latest.values()))
    rows = []
    for job in jobs(sweep):
        for u in job.units:
            row = {"job": job.name, "stage": job.stage, "index": u.index, "key": u.key, "out": u.out,
                   "slurm_id": None, "state": "not submitted", "reason": "", "log": None}
            jid = latest.get((job.name, u.index))
            log = sweep.run_dir / "logs" / f"{job.name}-{jid}.out"  # read only when the job has an id
            if jid:
                row.update(slurm_id=jid, log=str(log) if log.exists() else None)
            state, reason = queue.get(jid, (acct.get(jid, ""), "")) if jid else ("", "")
            if state in ACTIVE:  # queued or running now, whatever an earlier run left
                row["state"], row["reason"] = _classify(state, reason, True)
            elif done_marker(sweep, job.stage, u.key).exists():
                row["state"] = "done"
            elif jid:
                row["state"], row["reason"] = _classify(state, reason, log.exists())
            rows.append(row)
    return rows


def _classify(state: str, reason: str, has_log: bool) -> tuple[str, str]:
    if state in ("PENDING", "REQUEUED", "REQUEUE_HOLD", "CONFIGURING"):
        return "pending", reason
    if state in ACTIVE:
        return "running", reason
    if state == "COMPLETED":
        return "done", ""  # its command succeeded (the marker is written right after)
    if state:
        return ("cancelled" if state == "CANCELLED" else "failed"), f"{state} {reason}".strip()
    return ("failed", "ended without finishing (see log)") if has_log else ("cancelled", "never started")


def status(args: argparse.Namespace) -> int:
    sweep = load_sweep(args.sweep, args.root)
    rows = unit_status(sweep)
    if args.json:
        print(json.dumps(rows, indent=1))
        return 0
    states = ("done", "running", "pending", "failed", "cancelled", "not submitted")
    print(f"sweep {sweep.name} ({sweep.run_dir})")
    print(f"{'job':<12}" + "".join(f"{s:>15}" for s in states))
    for job in jobs(sweep):
        c = Counter(r["state"] for r in rows if r["job"] == job.name)
        print(f"{job.name:<12}" + "".join(f"{c.get(s, 0):>15}" for s in states))
    bad = [r for r in rows if r["state"] in ("failed", "cancelled")]
    for r in bad:
        tail = ""
        if r["log"]:
            lines = [ln for ln in Path(r["log"]).read_text(errors="replace").splitlines() if ln.strip()]
            tail = f"\n      last log line: {visible(lines[-1][:200], keep='')}" if lines else ""
        print(f"  {r['state']}: {r['job']} {r['key']} ({r['slurm_id']}, {r['reason']}); log: {r['log']}{tail}")
    if bad:
        print("fix the cause, then re-submit: finished work is skipped")
    return 0


def submit(args: argparse.Namespace) -> int:
    sweep = load_sweep(args.sweep, args.root)
    _queue()  # Slurm answers, before anything is written
    warn_default_partition(sweep)
    rows = unit_status(sweep)
    busy = sorted({r["slurm_id"] for r in rows if r["state"] in ("pending", "running")})
    if busy:
        raise MLBenchError(f"{len(busy)} job(s) of this sweep are still queued or running: {busy[:6]}",
                           str(sweep.run_dir), "wait for them (mlbench sweep status) or scancel them, then re-submit")
    n = len(_submissions(sweep)) + 1
    folder = sweep.run_dir / "submissions" / str(n)
    (sweep.run_dir / "logs").mkdir(parents=True, exist_ok=True)
    all_jobs = jobs(sweep)
    check_jobs(sweep, all_jobs)  # before anything is written or submitted
    write_atomic(sweep.run_dir / "sweep.yaml", yaml.safe_dump(sweep.to_dict(), sort_keys=False))
    todo = {j.name: _pending_units(sweep, j) for j in all_jobs}
    if not any(todo[name] for name in todo if name != "report") and (sweep.run_dir / "report" / "report.md").exists():
        print(f"sweep {sweep.name}: everything is done; report: {sweep.run_dir / 'report' / 'report.md'}")
        return 0
    submitted: dict[str, dict[str, Any]] = {}
    try:
        for job in all_jobs:
            units = todo[job.name]
            if not units:
                continue
            job.units = units
            script = folder / f"{job.name}.sbatch"
            write_unit_configs(folder, job)  # each unit's resolved config: its job runs `mlbench STAGE --config` it
            write_atomic(script, render(sweep, job, folder))
            deps = [f"{kind}:{submitted[name]['job_id']}" for kind, name in job.deps if name in submitted]
            cmd = ["sbatch", "--parsable", "--kill-on-invalid-dep=yes"]
            cmd += [f"--dependency={','.join(deps)}"] if deps else []
            r = _run(cmd + [str(script)])
            if r.returncode != 0:
                so_far = f"; jobs submitted so far: {[j['job_id'] for j in submitted.values()]}"
                if _UNREACHABLE.search(r.stderr):
                    raise unreachable("sbatch", r.stderr, so_far)
                raise MLBenchError(f"sbatch refused {job.name}: {r.stderr.strip()}", str(script),
                                   f"fix the sweep's slurm section ({sweep.lines.at('slurm')}: partition, account, "
                                   f"resources.{job.stage}){so_far}")
            job_id = r.stdout.strip().split(";")[0]
            submitted[job.name] = {"job_id": job_id, "stage": job.stage, "script": str(script),
                                   "dependency": ",".join(deps), "units": {str(u.index): u.key for u in units}}
            print(f"{job.name:<11} job {job_id}: {len(units)} task(s)" + (f", after {','.join(deps)}" if deps else ""))
    finally:
        # record what reached Slurm even when a later sbatch failed: `status` and the next `submit` must see it
        if submitted:
            with AppendLog(sweep.run_dir / "submissions.jsonl") as log:
                log.append({"n": n, "time": dt.datetime.now().isoformat(timespec="seconds"), "sweep": sweep.source,
                            "jobs": submitted})
    print(f"scripts: {folder}; logs: {sweep.run_dir / 'logs'}; follow with: mlbench sweep status {args.sweep}")
    return 0


def run(args: argparse.Namespace) -> int:
    """Entry point of ``mlbench sweep``."""
    return {"plan": plan, "submit": submit, "status": status}[args.action](args)

