"""What `mlbench report` reads: eval folders grouped into settings (checkpoint x task, seeds averaged) and
published rows quoted from a reference file."""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mlbench_kit.config import read_yaml
from mlbench_kit.errors import MLBenchError
from mlbench_kit.records import TASKS


@dataclass
class Setting:
    """One checkpoint on one task: the eval summaries of its seeds."""

    run: str
    task: int | None
    agent: str | None = None  # the policy of an agent run (`mlbench agent`): "ml-agent" or "bash"
    summaries: list[dict[str, Any]] = field(default_factory=list)
    dirs: list[str] = field(default_factory=list)
    agents: list[dict[str, Any]] = field(default_factory=list)  # the agent runs' own summary.json, one per seed

    @property
    def label(self) -> str:
        if self.agent is not None:
            return f"{self.run} · agent {self.agent}"
        return self.run if self.task is None else f"{self.run} · task {self.task}"

    @property
    def setting(self) -> str:
        """The settings table's task column: the task, ``agent: <policy>``, or a dash."""
        return f"agent: {self.agent}" if self.agent is not None else str(self.task or "–")

    @property
    def not_scored(self) -> tuple[int, int]:
        """Over its seeds: generations that hit environment or sandbox faults, and samples left unscored. Its
        Pass@k is over what was scored only, so a report shows these beside it (INCOMPLETE)."""
        return (sum(int(s.get("faults") or 0) for s in self.summaries),
                sum(len(s.get("unscored") or []) for s in self.summaries))

    @property
    def incomplete(self) -> str:
        """"" when everything was scored, else e.g. "INCOMPLETE: 2 faults, 1 unscored sample"."""
        faults, unscored = self.not_scored
        parts = [f"{faults} fault{'s' * (faults != 1)}" if faults else "",
                 f"{unscored} unscored sample{'s' * (unscored != 1)}" if unscored else ""]
        return "INCOMPLETE: " + ", ".join(p for p in parts if p) if faults or unscored else ""

    def metric(self, name: str, group: tuple[str, str] | None = None) -> tuple[float | None, tuple | None]:
        """Mean over seeds, and a range: the bootstrap 95% CI for one seed, min–max over several."""
        vals = []
        for s in self.summaries:
            m = s["metrics"]["overall"] if group is None else s["metrics"][group[0]].get(group[1])
            if m is not None and m.get(name) is not None:
                vals.append((m[name], m.get(f"{name}_ci95")))
        if not vals:
            return None, None
        mean = sum(v for v, _ in vals) / len(vals)
        if len(vals) == 1:
            return mean, tuple(vals[0][1]) if vals[0][1] else None
        return mean, (min(v for v, _ in vals), max(v for v, _ in vals))


@dataclass
class Reference:
    """A published row, quoted from a paper: never recomputed. Values are fractions (a ``unit: percent`` file is
    divided by 100 on load); ``per_type`` holds the row's Bash Script / Python Code split where the paper gives one."""

    name: str
    task: int | None
    source: str
    values: dict[str, float]
    per_type: dict[str, dict[str, float]] = field(default_factory=dict)
    agent: str | None = None  # a quoted agent row (the paper's ML-Agent, AutoGen): the policy it compares with
    per_repo: dict[str, dict[str, float]] = field(default_factory=dict)  # by the paper's repository names

    @property
    def setting(self) -> str:
        return f"agent: {self.agent}" if self.agent is not None else str(self.task or "–")


def _task_of(summary: dict[str, Any]) -> int | None:
    if summary.get("task") in TASKS:
        return summary["task"]
    m = re.search(r"task([123])\.jsonl$", str(summary.get("generations", "")))
    return int(m.group(1)) if m else None


def agent_summary(summary: dict[str, Any], eval_dir: Path) -> dict[str, Any] | None:
    """The `mlbench agent` run behind an eval of its generations: its ``summary.json`` (policy, exits, turns,
    tokens, the openhands rule's rate), found beside the generations file the eval read (a summary with
    ``policy`` and ``config_sha`` marks an agent run); None for generations of `mlbench infer` or gold answers."""
    gens = summary.get("generations")
    if not gens or gens == "gold":
        return None
    p = Path(gens)
    for folder in ([p.parent] if p.is_absolute() else [Path.cwd() / p.parent, eval_dir / p.parent]):
        f = folder / "summary.json"
        if f.is_file() and f.stat().st_size < 2**20:
            try:
                found = json.loads(f.read_text())
            except ValueError:
                return None
            if isinstance(found, dict) and isinstance(found.get("policy"), str) and "config_sha" in found:
                return found
            return None
    return None


def load_settings(specs: list[str], skip_missing: bool = False) -> list[Setting]:
    """Group eval folders into (run name, task or agent policy) settings, in the order first given."""
    settings: dict[tuple[str, int | None, str | None], Setting] = {}
    for spec in specs:
        name, _, path = spec.rpartition("=") if "=" in spec else ("", "", spec)
        f = Path(path) / "summary.json"
        if not f.is_file():
            if skip_missing:
                print(f"report: skipped {path} (no summary.json)", file=sys.stderr)
                continue
            raise MLBenchError("no summary.json in this run folder", str(f), "pass folders written by `mlbench eval`")
        summary = json.loads(f.read_text())
        agent = agent_summary(summary, Path(path))
        policy = None if agent is None else agent["policy"] + (f" {agent['steps']}" if agent.get("steps") and
                                                               agent["policy"] == "ml-agent" else "")
        key = (name or Path(path).name, None if agent else _task_of(summary), policy)
        s = settings.setdefault(key, Setting(*key))
        s.summaries.append(summary)
        s.dirs.append(path)
        if agent is not None:
            s.agents.append(agent)
    if not settings:
        raise MLBenchError("no eval results to report", " ".join(specs[:3]), "run `mlbench eval` first")
    return list(settings.values())


_ROW_KEYS = ("name", "task", "table", "paper_row", "per_type", "agent", "per_repo")


def _rates(row: dict[str, Any], skip: tuple[str, ...], scale: float, where: str, hint: str) -> dict[str, float]:
    out = {}
    for k, v in row.items():
        if k in skip or v is None or isinstance(v, dict):
            continue
        if not re.fullmatch(r"pass@\d+|param_hit_precision|param_all_hit_rate|type_accuracy", str(k)):
            raise MLBenchError(f"unknown metric {k!r} in a quoted row", where,
                               "use pass@k, param_hit_precision, param_all_hit_rate or type_accuracy")
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= scale:
            raise MLBenchError(f"{k}: {v!r} is not a rate in [0, {scale:g}]", where, hint)
        out[str(k)] = float(v) / scale
    return out


def load_reference(path: str) -> list[Reference]:
    """Rows from a reference YAML (format: configs/report/paper-rows.yaml): ``source``, optional ``version`` and
    ``unit`` (``fraction``, the default, or ``percent`` as papers print), and ``rows: [{name, task, table,
    paper_row, pass@1, ..., per_type: {<type>: {pass@1: ...}}}]``."""
    raw, lines = read_yaml(path)
    source = raw.get("source")
    if not source:
        raise MLBenchError("a reference file needs `source:` (where the numbers are quoted from)", lines.at("rows"))
    unit = raw.get("unit", "fraction")
    if unit not in ("fraction", "percent"):
        raise MLBenchError(f"unit: {unit!r} is neither `fraction` nor `percent`", lines.at("unit"))
    scale = 100.0 if unit == "percent" else 1.0
    hint = ("values are percentages as printed (33.82)" if unit == "percent"
            else "write rates as fractions (0.3382), or add `unit: percent` to quote percentages as printed")
    if raw.get("version"):
        source = f"{source} ({raw['version']})"
    refs = []
    for i, row in enumerate(raw.get("rows") or []):
        refs.append(_reference(row, i, "rows", lines, source, scale, hint))
    for i, row in enumerate(raw.get("agent_rows") or []):
        ref = _reference(row, i, "agent_rows", lines, source, scale, hint)
        if not ref.agent:
            raise MLBenchError(f"agent_rows[{i}] ({ref.name}) needs `agent:` (the policy it compares with)",
                               lines.at(("agent_rows", str(i))), "e.g. agent: ml-agent")
        refs.append(ref)
    return refs


def _reference(row: Any, i: int, key: str, lines: Any, source: str, scale: float, hint: str) -> Reference:
    """One quoted row of ``rows`` or ``agent_rows``."""
    where = lines.at((key, str(i)))
    if not isinstance(row, dict) or "name" not in row:
        raise MLBenchError(f"{key}[{i}] needs `name`", where)
    if row.get("task") is not None and row["task"] not in TASKS:
        raise MLBenchError(f"{key}[{i}] ({row['name']}): task {row['task']!r} is not one of {list(TASKS)}", where)
    values = _rates(row, _ROW_KEYS, scale, where, hint)
    def nested(field: str, what: str) -> tuple[dict[str, Any], dict[str, dict[str, float]]]:
        """``per_type`` / ``per_repo``: a mapping of ``what`` -> rates, beside its own ``table``/``paper_row``."""
        given = row.get(field) or {}
        if not isinstance(given, dict):
            raise MLBenchError(f"{key}[{i}] ({row['name']}): {field} is a mapping of {what} -> rates", where)
        out = {}
        for name, rates in given.items():
            if name in ("table", "paper_row"):
                continue
            if not isinstance(rates, dict):
                raise MLBenchError(f"{key}[{i}] ({row['name']}): {field}.{name} is a mapping of rates", where)
            out[str(name)] = _rates(rates, (), scale, where, hint)
        return given, out

    pt, per_type = nested("per_type", "type")
    pr, per_repo = nested("per_repo", "repository")
    table = f", table {row['table']}" if row.get("table") else ""
    if pt.get("table"):
        table += f" (per type: table {pt['table']})"
    if pr.get("table"):
        table += f" (per repository: table {pr['table']})"
    agent = row.get("agent")
    if agent is not None and not isinstance(agent, str):
        raise MLBenchError(f"{key}[{i}] ({row['name']}): agent is a policy name", where)
    return Reference(row["name"], row.get("task"), f"{source}{table}", values, per_type, agent, per_repo)
