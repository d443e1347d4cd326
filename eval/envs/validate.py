"""Gold validation: run every dataset answer in its built environment (compat and strict) and say, per row,
why it fails when it does. Rows whose own answer passes are *gold-valid*: what a model can be credited for.

Causes, first match wins: ``check`` (the answer fails the benchmark's parameter or type check itself),
``not built`` (the repository's environment could not be built here), ``network``, ``gpu``, ``weights``,
``data`` (a file or dataset the command reads), ``missing module``, ``answer`` (the answer itself is not valid
code or misses a required flag, or its recipe lists it under ``gold_defects``), ``argument`` (exit 2, argparse),
``timeout`` (strict mode), ``other``.
"""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from mlbench_kit.markdown import md_text

_RULES = [
    # the command names a script that is not in the repository at that path: the answer (or its row's path) is wrong
    ("answer", r"can't open file '[^'\n]*\.(py|sh)'|bash: [^:\n]*\.sh: No such file or directory"),
    ("network", r"Temporary failure in name resolution|Failed to establish a new connection|Network is unreachable|"
                r"ConnectionError|MaxRetryError|urlopen error|Name or service not known|OfflineModeIsEnabled|"
                r"LocalEntryNotFoundError|cannot reach|Could not resolve host|connection (refused|reset)|"
                r"We couldn't connect to|HTTPSConnectionPool|getaddrinfo failed|Cannot connect to proxy|"
                r"unable to access 'https?://"),
    ("gpu", r"Torch not compiled with CUDA enabled|no CUDA GPUs are available|Found no NVIDIA driver|NVIDIA driver|"
            r"nvidia-smi|CUDA driver|CUDA error|CUDA_HOME|libcuda|invalid device ordinal|Invalid device id|"
            r"No module named '(pycuda|apex|spconv|cupy)|requires a GPU|cuda is not available|"
            r"CUDA is not available|device-side|nccl"),
    ("weights", r"(No such file or directory|FileNotFoundError|not found|does not exist|Unable to open|"
                r"Can't load|cannot find)[^\n]*\.(pth|pt|ckpt|bin|safetensors|h5|index|meta|npz|pkl|zip)\b|"
                r"checkpoint[^\n]*(not found|does not exist|No such file)|pretrained[^\n]*(not found|No such)|"
                r"Can't load (tokenizer|the model|weights|config)|is not a local folder and is not a valid model"),
    ("data", r"No such file or directory|FileNotFoundError|does not exist|not found:|cannot open|Unable to open "
             r"file|is not a directory|No such file|can't open file|Dataset not found|NotADirectoryError|"
             r"num_samples=0|glob\.glob\([^\n]*\)\[0\]"),
    ("missing module", r"ModuleNotFoundError|No module named|ImportError|command not found|cannot import name"),
    ("answer", r"SyntaxError|IndentationError|syntax error near unexpected token|unexpected EOF|"
               r"IllegalFlagValueError|must have a value other than None"),
    ("argument", r"error: unrecognized arguments|error: argument|error: the following arguments are required|"
                 r"usage: "),
]


def classify(rec: dict[str, Any], built: bool, build_reason: str = "", defect: str | None = None) \
        -> tuple[str | None, str]:
    """``(cause, excerpt)`` for one gold result record; ``(None, '')`` when it passed. ``defect``: why the
    recipe says this row's answer cannot pass."""
    if rec.get("passed"):
        return None, ""
    if not built:
        return "not built", build_reason
    if not (rec.get("params_ok") and rec.get("type_ok")):
        return "check", f"param hits {rec.get('param_hits')}, type ok {rec.get('type_ok')}"
    if defect:
        return "answer", f"known gold defect: {defect}"
    log = rec.get("log") or ""
    if rec.get("timed_out"):
        return "timeout", log[-300:]
    for cause, pat in _RULES:
        m = re.search(pat, log)
        if m and (cause != "argument" or rec.get("exit_code") == 2):
            start = log.rfind("\n", 0, m.start()) + 1
            end = log.find("\n", m.end())
            return cause, log[start:end if end >= 0 else None].strip()[:300]
    if rec.get("exit_code") == 2 and "usage:" in log:
        return "argument", log[-300:]
    return "other", log.strip()[-300:]


def validate(results: dict[str, list[dict[str, Any]]], rows: list[dict[str, Any]], built: dict[str, str | None],
             defects: dict[tuple[str, int], str] | None = None) -> dict[str, Any]:
    """Per-row verdicts and causes from eval result records per mode; ``built[repo]`` is None when built, else
    the reason it is not; ``defects[(repo, id)]``: the recipes' known gold defects."""
    defects = defects or {}
    by_mode = {m: {(r["github_id"], r["id"]): r for r in recs} for m, recs in results.items()}
    out_rows = []
    for row in rows:
        key = (row["github_id"], row["id"])
        entry: dict[str, Any] = {"github_id": key[0], "id": key[1], "repo": row["repo"], "type": row["type"]}
        if (row["repo"], row["id"]) in defects:
            entry["defect"] = defects[(row["repo"], row["id"])]
        for mode, recs in by_mode.items():
            rec = recs.get(key, {"passed": False})
            reason = built.get(row["repo"], "no environment")
            cause, excerpt = classify(rec, reason is None, reason or "", defects.get((row["repo"], row["id"])))
            entry[mode] = {"passed": bool(rec.get("passed")), "cause": cause, "excerpt": excerpt,
                           "exit_code": rec.get("exit_code")}
        out_rows.append(entry)
    return {"modes": list(results), "rows": out_rows, "per_repo": per_repo(out_rows, list(results))}


def per_repo(rows: list[dict[str, Any]], modes: list[str]) -> dict[str, dict[str, Any]]:
    """Pass counts and failure causes per repository and mode."""
    table: dict[str, dict[str, Any]] = defaultdict(lambda: {"rows": 0})
    for r in rows:
        t = table[r["repo"]]
        t["rows"] += 1
        for m in modes:
            t.setdefault(f"{m}_pass", 0)
            t.setdefault(f"{m}_causes", Counter())
            if r[m]["passed"]:
                t[f"{m}_pass"] += 1
            else:
                t[f"{m}_causes"][r[m]["cause"]] += 1
    return {k: {kk: dict(vv) if isinstance(vv, Counter) else vv for kk, vv in v.items()}
            for k, v in sorted(table.items())}


def validation_markdown(report: dict[str, Any], built: dict[str, str | None]) -> str:
    """The per-repository table and every failing row with its cause."""
    modes = report["modes"]
    lines = ["# Gold validation", ""]
    if report.get("settings"):
        st = report["settings"]
        lines += [f"{st['backend']} sandbox, {st['workers']} workers, "
                  + (f"a quota of {st['cpus']:g} core(s) per execution" if st["cpus"] else "no CPU quota"), ""]
    lines += ["| repository | env | rows | " + " | ".join(f"{m} pass" for m in modes)
             + " | causes of failure (" + modes[0] + ") |", "|---|---|---|" + "---|" * len(modes) + "---|"]
    for repo, t in report["per_repo"].items():
        env = "built" if built.get(repo, "no environment") is None else "not built"
        causes = ", ".join(f"{c} {n}" for c, n in sorted(t[f"{modes[0]}_causes"].items(), key=lambda x: -x[1]))
        lines.append(f"| {md_text(repo)} | {env} | {t['rows']} | " + " | ".join(str(t[f'{m}_pass']) for m in modes)
                     + f" | {causes or '–'} |")
    tot = {m: sum(t[f"{m}_pass"] for t in report["per_repo"].values()) for m in modes}
    n = sum(t["rows"] for t in report["per_repo"].values())
    lines.append(f"| **all** | | {n} | " + " | ".join(str(tot[m]) for m in modes) + " | |")
    lines += ["", "## Failing rows", "", "| github_id | id | repo | " + " | ".join(modes) + " | excerpt |",
              "|---|---|---|" + "---|" * len(modes) + "---|"]
    for r in report["rows"]:
        if all(r[m]["passed"] for m in modes) and not r.get("defect"):
            continue
        excerpt = r[modes[0]]["excerpt"] or r[modes[-1]]["excerpt"]
        if r.get("defect") and not excerpt.startswith("known gold defect"):  # passed only by compat's timeout rule
            excerpt = f"known gold defect: {r['defect']}"
        lines.append(f"| {md_text(str(r['github_id']))} | {md_text(str(r['id']))} | {md_text(r['repo'])} | "
                     + " | ".join("pass" if r[m]["passed"] else str(r[m]["cause"]) for m in modes)
                     + f" | {md_text(excerpt, 160)} |")
    return "\n".join(lines) + "\n"


def gold_valid(path: str | Path, mode: str = "compat") -> dict[tuple[int, int], str | None]:
    """From ``validation.json``: per (github_id, id), None when gold-valid, else the cause of failure. A known
    gold defect is never gold-valid, even where compat counted its run as a pass (it ran into the time limit
    before it reached its error)."""
    doc = json.loads(Path(path).read_text())
    m = mode if mode in doc["modes"] else doc["modes"][0]
    return {(r["github_id"], r["id"]): ("answer" if r.get("defect") else None if r[m]["passed"] else r[m]["cause"])
            for r in doc["rows"]}
