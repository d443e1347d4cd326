"""Same verdicts on every engine (issue 24): `mlbench env validate` on the gold rows with bwrap and with podman,
under the same --workers/--cpus, row by row.

For each repository, bwrap then podman (one after the other, so both see the same load on this shared machine),
each run in its own folder; a finished run is never redone, so the command resumes after an interruption and
a later call with more --repos adds to the table. Then every (row, mode) verdict is compared. A row whose
verdicts differ is listed with both durations, exit codes and causes: it is *timing-sensitive* when both sides
ended at the limit (one still running there, which compat passes, the other within --margin seconds of it),
otherwise a *defect* to fix.

    python bench/engine_verdicts.py --data ../shared/mlbench/full.jsonl --out runs/engine-verdicts \\
        --md bench/results/engine-verdicts.md [--repos bert dgl ...] [--workers 2 --cpus 1]

Needs the environments and their images: mlbench env build --image --tarballs ../shared/mlbench/repos
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from mlbench_kit.envspec import load_recipes
from mlbench_kit.eval.envcli import RECIPES
from mlbench_kit.io import read_jsonl_tolerant

BACKENDS = ("bwrap", "podman")


def run_one(repo: str, backend: str, a: argparse.Namespace) -> dict:
    """`mlbench env validate` of one repository on one backend (skipped when already done)."""
    out = Path(a.out) / backend / repo
    done = out / "validation.json"
    meta_f = out / "bench.json"
    if done.is_file() and meta_f.is_file():
        return json.loads(meta_f.read_text())
    argv = [sys.executable, "-m", "mlbench_kit.cli", "env", "validate", repo, "--data", a.data, "--out", str(out),
            "--backend", backend, "--workers", str(a.workers), "--cpus", str(a.cpus), "--modes", *a.modes]
    t0 = time.monotonic()
    r = subprocess.run(argv, capture_output=True, text=True)
    meta = {"repo": repo, "backend": backend, "seconds": round(time.monotonic() - t0, 1), "exit": r.returncode,
            "argv": argv[2:], "stderr_tail": r.stderr[-1500:]}
    out.mkdir(parents=True, exist_ok=True)
    meta_f.write_text(json.dumps(meta, indent=2))
    print(f"{repo:28} {backend:7} {meta['seconds']:7.1f} s exit {r.returncode}", file=sys.stderr, flush=True)
    return meta


def _verdicts(out: Path, modes: list[str]) -> dict[tuple[int, str], dict]:
    rows = {}
    for mode in modes:
        f = out / f"gold-{mode}" / "results.jsonl"
        if not f.is_file():
            continue
        for r in read_jsonl_tolerant(f):
            rows[(r["id"], mode)] = r
    return rows


def compare(repos: list[str], a: argparse.Namespace, metas: dict) -> str:
    """The markdown comparison."""
    limit_of = {}
    lines = ["# Same verdicts on every engine: bwrap vs podman on the gold rows", "",
             (f"`python bench/engine_verdicts.py --workers {a.workers} --cpus {a.cpus} --modes {' '.join(a.modes)}` "
             f"(`mlbench env validate` per repository, bwrap then podman, same settings; podman runs each "
             f"repository's image from `mlbench env build --image`). Margin for timing-sensitive rows: "
             f"{a.margin} s of the limit."), "",
             ("*both timed out*: rows still running at the limit on both engines (compat passes them), so their "
             "verdicts say little about the engines; *CPU s*: the executions' CPU seconds summed, which shows how much "
             "of the wall time they got on this shared machine."), "",
             ("| repository | rows | mode | bwrap pass | podman pass | identical | differing | both timed out | "
             "bwrap s (CPU s) | podman s (CPU s) |"),
             "|---|---|---|---|---|---|---|---|---|---|"]
    diffs = []
    totals = {m: [0, 0, 0, 0, 0, 0] for m in a.modes}
    for repo in repos:
        v = {b: _verdicts(Path(a.out) / b / repo, a.modes) for b in BACKENDS}
        for mode in a.modes:
            keys = sorted(k for k in v["bwrap"] if k[1] == mode)
            same = [k for k in keys if k in v["podman"] and v["bwrap"][k]["passed"] == v["podman"][k]["passed"]]
            missing = [k for k in keys if k not in v["podman"]]
            bp = sum(v["bwrap"][k]["passed"] for k in keys)
            pp = sum(v["podman"][k]["passed"] for k in v["podman"] if k[1] == mode)
            differ = [k for k in keys if k in v["podman"] and k not in same]
            secs = [metas.get((repo, b), {}).get("seconds", "") for b in BACKENDS]
            cpu = [round(sum((r.get("usage") or {}).get("cpu_s") or 0 for k, r in v[b].items() if k[1] == mode))
                   for b in BACKENDS]
            both_to = sum(1 for k in keys if k in v["podman"] and v["bwrap"][k].get("timed_out")
                          and v["podman"][k].get("timed_out"))
            lines.append(f"| {repo} | {len(keys)} | {mode} | {bp} | {pp} | {len(same)} | {len(differ)}"
                         f"{f' (+{len(missing)} missing)' if missing else ''} | {both_to} | {secs[0]} ({cpu[0]}) | "
                         f"{secs[1]} ({cpu[1]}) |")
            t = totals[mode]
            for i, n in enumerate((len(keys), bp, pp, len(same), len(differ), both_to)):
                t[i] += n
            for k in differ:
                diffs.append((repo, k, v["bwrap"][k], v["podman"][k]))
    for mode, t in totals.items():
        lines.append(f"| **all** | {t[0]} | {mode} | {t[1]} | {t[2]} | {t[3]} | {t[4]} | {t[5]} | | |")
    lines += ["", "## Rows whose verdicts differ", ""]
    if not diffs:
        lines.append("None.")
    else:
        lines += [("| repository | id | mode | bwrap: passed, class, exit, duration | podman: passed, class, exit, "
                  "duration | kind |"), "|---|---|---|---|---|---|"]
        for repo, (rid, mode), b, p in diffs:
            lim = limit_of.get(repo) or _limit(b, p)
            # both sides at the limit: one still running there, the other ending within the margin of it
            timing = all(x.get("timed_out") or abs((x.get("duration") or 0) - lim) <= a.margin for x in (b, p))
            lines.append(f"| {repo} | {rid} | {mode} | {_fmt(b)} | {_fmt(p)} | "
                         f"{'timing-sensitive' if timing else 'DEFECT'} |")
    ident_causes = _cause_differences(repos, a)
    lines += ["", "## Same verdict, other error class or cause", ""]
    lines += ident_causes or ["None."]
    return "\n".join(lines) + "\n"


def _limit(b: dict, p: dict) -> float:
    """The time limit of this row: the longest duration of a timed-out side, else 10 s (the benchmark's)."""
    t = [x["duration"] for x in (b, p) if x.get("timed_out") and x.get("duration")]
    return max(t) if t else 10.0


def _fmt(r: dict) -> str:
    return (f"{'pass' if r['passed'] else 'fail'}, {r.get('error_class')}, {r.get('exit_code')}, "
            f"{r.get('duration')} s{' (timed out)' if r.get('timed_out') else ''}")


def _cause_differences(repos: list[str], a: argparse.Namespace) -> list[str]:
    out = []
    for repo in repos:
        vals = {}
        for b in BACKENDS:
            f = Path(a.out) / b / repo / "validation.json"
            if f.is_file():
                vals[b] = {r["id"]: r for r in json.loads(f.read_text())["rows"]}
        if len(vals) < 2:
            continue
        for rid, br in sorted(vals["bwrap"].items()):
            pr = vals["podman"].get(rid)
            for mode in a.modes:
                if pr is None or mode not in br or mode not in pr:
                    continue
                if br[mode]["passed"] == pr[mode]["passed"] and br[mode].get("cause") != pr[mode].get("cause"):
                    out.append(f"- {repo} {rid} {mode}: bwrap `{br[mode].get('cause')}` "
                               f"({(br[mode].get('excerpt') or '')[:90]!r}), podman `{pr[mode].get('cause')}` "
                               f"({(pr[mode].get('excerpt') or '')[:90]!r})")
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True)
    p.add_argument("--out", default="runs/engine-verdicts")
    p.add_argument("--md", default="bench/results/engine-verdicts.md")
    p.add_argument("--repos", nargs="*", help="default: every recipe")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--cpus", type=float, default=1.0)
    p.add_argument("--modes", nargs="+", default=["compat", "strict"])
    p.add_argument("--margin", type=float, default=1.5)
    p.add_argument("--compare-only", action="store_true", help="write the table from the runs done so far")
    a = p.parse_args()
    repos = a.repos or [r.repo for r in load_recipes(RECIPES)]
    metas = {}
    for repo in repos:
        for b in BACKENDS:
            f = Path(a.out) / b / repo / "bench.json"
            if not a.compare_only:
                metas[(repo, b)] = run_one(repo, b, a)
            elif f.is_file():
                metas[(repo, b)] = json.loads(f.read_text())
    done = [r for r in repos if all((Path(a.out) / b / r / "validation.json").is_file() for b in BACKENDS)]
    Path(a.md).parent.mkdir(parents=True, exist_ok=True)
    Path(a.md).write_text(compare(done, a, metas))
    print(f"engine verdicts: {len(done)} repositories compared; {a.md}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
