"""Execution checker throughput and workspace cost, against baselines measured in the same run.

1. Workspace: per-execution cost of the old private copy (copytree + rmtree of the checkout) against the
   overlay (a trivial command on dgl's 2,097-file checkout minus the same command on a one-file repository).
2. Throughput: `mlbench eval --gold` (bwrap sandbox, N workers) against a sequential re-implementation of the
   benchmark's loop (same checks and verdict rules, no isolation, one shared working copy per repository), on
   the real gold answers of External-Attention-pytorch, PyTorch-GAN and Time-Series-Library, each in its built
   environment, each execution with the same compute in both (``--cpus``, default one core: compat's "still
   running at the limit passes" makes a verdict depend on it) and a warm page cache (from a cold cache one
   PyTorch-GAN answer took 7 s instead of 4; both warm each environment before its first verdict, timed).
   Verdicts must be identical.

    python bench/eval_speed.py --cache ~/.cache/mlbench --shared ../shared/mlbench [--workers 2 --cpus 1]

Build the environments first: mlbench env build External-Attention-pytorch PyTorch-GAN Time-Series-Library
--tarballs ../shared/mlbench/repos
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from mlbench_kit.cli import main as mlbench
from mlbench_kit.dataset import load_samples, prefix_exports
from mlbench_kit.eval.checks import check_output, runs_as_shell
from mlbench_kit.eval.envs import EnvConfig
from mlbench_kit.eval.scoring import reference_timeout
from mlbench_kit.io import read_jsonl_tolerant
from mlbench_kit.sandbox import (
    WARM_MODULES,
    Env,
    Job,
    Limits,
    Sandbox,
    thread_vars,
    warm_code,
)

REPOS = ["External-Attention-pytorch", "PyTorch-GAN", "Time-Series-Library"]


def workspace(dgl_tar: Path) -> None:
    tmp = Path(tempfile.mkdtemp())
    subprocess.run(["tar", "-xzf", str(dgl_tar), "-C", str(tmp)], check=True)
    dgl = tmp / "dgl"
    copies = []
    for _ in range(5):
        t0 = time.perf_counter()
        shutil.copytree(dgl, tmp / "w", symlinks=True)
        shutil.rmtree(tmp / "w")
        copies.append(time.perf_counter() - t0)
    tiny = tmp / "tiny"
    tiny.mkdir()
    (tiny / "a.txt").write_text("a")
    med = {}
    with Sandbox("bwrap") as sb:
        for env in (Env("tiny", tiny), Env("dgl", dgl)):
            sb.run(Job("true", True, env, "./"), Limits())  # stage the checkout once (as the run does)
            ts = []
            for _ in range(15):
                t0 = time.perf_counter()
                assert sb.run(Job("true", True, env, "./"), Limits()).exit_code == 0
                ts.append(time.perf_counter() - t0)
            med[env.name] = statistics.median(ts)
        staged = sb.staged_s
    shutil.rmtree(tmp)
    copy_ms = statistics.median(copies) * 1000
    over_ms = (med["dgl"] - med["tiny"]) * 1000
    print(f"workspace, dgl (2,097 files): private copy {copy_ms:.0f} ms per execution; overlay {over_ms:+.1f} ms over "
          f"a one-file repository (whole execution of `true`: {med['dgl'] * 1000:.0f} ms); staging once per run "
          f"{staged:.2f} s")


def baseline(samples, envs: EnvConfig, cpus: int | None) -> tuple[dict, float]:
    """The benchmark's loop: one row after another, the command run in the repository with its environment's
    interpreter first on PATH, stdout to a pipe nobody reads, exit 0 or still running at the limit passes.
    Each command is pinned to ``cpus`` cores (taskset) with as many threads: the compute one execution gets in
    the measured run, so that the wall-clock limit means the same in both. ``None``: as the benchmark runs it,
    every core and the libraries' default thread counts."""
    work = Path(tempfile.mkdtemp())
    verdicts = {}
    t0 = time.perf_counter()
    for repo in sorted({s.repo for s in samples}):  # the warm-up mlbench eval does (timed in both)
        subprocess.run([f"{envs.for_repo(repo).prefix}/bin/python", "-c", warm_code(WARM_MODULES)],
                       capture_output=True,
                       env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1"})
    for s in samples:
        env = envs.for_repo(s.repo)
        repo = work / s.repo
        if not repo.exists():
            shutil.copytree(env.checkout, repo, symlinks=True)
        ch = check_output(s.output, s.arguments, s.type, "compat")
        if not (ch.params_ok and ch.type_ok):
            verdicts[s.key] = False
            continue
        shell = runs_as_shell(s.output)
        cwd = repo / s.path
        vars_ = {"PATH": f"{env.prefix}/bin:/usr/bin:/bin", "HOME": str(work), "LANG": "C.UTF-8",
                 "PYTHONUNBUFFERED": "1", "PYTHONDONTWRITEBYTECODE": "1", "MPLBACKEND": "Agg",
                 **(thread_vars(Limits(threads=cpus)) if cpus else {}), **dict(prefix_exports(s.prefix_code))}
        if shell:
            argv = ["bash", "-c", s.output]
        else:
            (cwd / "temp.py").write_text(s.output)
            argv = ["python", "temp.py"]
        if cpus:
            argv = ["taskset", "-c", f"0-{cpus - 1}", *argv]
        p = subprocess.Popen(argv, cwd=cwd, env=vars_, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                             stdin=subprocess.DEVNULL, start_new_session=True)
        try:
            verdicts[s.key] = p.wait(timeout=reference_timeout(s.github_id, shell)) == 0
        except subprocess.TimeoutExpired:
            verdicts[s.key] = True
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        p.wait()
    took = time.perf_counter() - t0
    shutil.rmtree(work, ignore_errors=True)
    return verdicts, took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cache", default=os.environ.get("MLBENCH_CACHE", str(Path.home() / ".cache" / "mlbench")))
    ap.add_argument("--shared", default=str(Path(__file__).resolve().parents[2] / "shared" / "mlbench"))
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--cpus", type=int, default=1,
                    help="cores per execution in both runs (compat's wall-clock limit makes verdicts depend on it)")
    ap.add_argument("--skip-workspace", action="store_true")
    ap.add_argument("--unpinned-baseline", action="store_true",
                    help="also time the baseline as the benchmark runs it (every core, default threads), to show "
                         "that pinning it does not slow it down")
    a = ap.parse_args()
    shared = Path(a.shared)
    if not a.skip_workspace:
        workspace(shared / "repos" / "dgl.tar.gz")
    envs_file = Path(a.cache) / "envs.yaml"
    envs = EnvConfig(envs_file)
    samples = [s for s in load_samples(shared / "full.jsonl") if s.repo in REPOS]
    base, base_s = baseline(samples, envs, a.cpus)
    out = Path(tempfile.mkdtemp()) / "eval"
    t0 = time.perf_counter()
    rc = mlbench(["eval", "--data", str(shared / "full.jsonl"), "--gold", "--envs", str(envs_file), "--repos",
                  *REPOS, "--out", str(out), "--workers", str(a.workers), "--cpus", str(a.cpus), "--no-ci"])
    ours_s = time.perf_counter() - t0
    assert rc == 0, rc
    ours = {(r["github_id"], r["id"]): r["passed"] for r in read_jsonl_tolerant(out / "results.jsonl")}
    diff = sorted(k for k in base if base[k] != ours.get(k))
    both = sum(v and ours.get(k, False) for k, v in base.items())
    print(f"throughput, {len(samples)} gold rows of {', '.join(REPOS)} on {os.cpu_count()} cores: baseline "
          f"(sequential, no isolation, {a.cpus} core(s)) {base_s:.1f} s; mlbench eval (bwrap, {a.workers} workers "
          f"of {a.cpus} core(s)) {ours_s:.1f} s: "
          f"{base_s / ours_s:.2f}x; verdicts identical: {not diff} ({both} pass in both)"
          + (f"; differing rows: {diff}" if diff else ""))
    if a.unpinned_baseline:
        free, free_s = baseline(samples, envs, None)
        moved = sorted(k for k in base if base[k] != free.get(k))
        print(f"baseline unpinned (every core, default threads): {free_s:.1f} s (pinned: {base_s:.1f} s); "
              f"mlbench eval is {free_s / ours_s:.2f}x it; {len(moved)} verdicts differ from the pinned run's"
              + (f": {moved}" if moved else ""))
    shutil.rmtree(out.parent, ignore_errors=True)


if __name__ == "__main__":
    main()
