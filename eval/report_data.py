"""What `mlbench report` reads: eval folders grouped into settings (checkpoint x task, seeds averaged) and
published rows quoted from a reference file."""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from mlbench_kit.errors import MLBenchError
from mlbench_kit.records import TASKS


@dataclass
class Setting:
    """One checkpoint on one task: the eval summaries of its seeds."""

    run: str
    task: int | None
    summaries: list[dict[str, Any]] = field(default_factory=list)
    dirs: list[str] = field(default_factory=list)

    @property
    def label(self) -> str:
        return self.run if self.task is None else f"{self.run} · task {self.task}"

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
    """A published row, quoted from a paper: never recomputed."""

    name: str
    task: int | None
    source: str
    values: dict[str, float]


def _task_of(summary: dict[str, Any]) -> int | None:
    if summary.get("task") in TASKS:
        return summary["task"]
    m = re.search(r"task([123])\.jsonl$", str(summary.get("generations", "")))
    return int(m.group(1)) if m else None


def load_settings(specs: list[str], skip_missing: bool = False) -> list[Setting]:
    """Group eval folders into (run name, task) settings, in the order first given."""
    settings: dict[tuple[str, int | None], Setting] = {}
    for spec in specs:
        name, _, path = spec.rpartition("=") if "=" in spec else ("", "", spec)
        f = Path(path) / "summary.json"
        if not f.is_file():
            if skip_missing:
                print(f"report: skipped {path} (no summary.json)", file=sys.stderr)
                continue
            raise MLBenchError("no summary.json in this run folder", str(f), "pass folders written by `mlbench eval`")
        summary = json.loads(f.read_text())
        key = (name or Path(path).name, _task_of(summary))
        s = settings.setdefault(key, Setting(*key))
        s.summaries.append(summary)
        s.dirs.append(path)
    if not settings:
        raise MLBenchError("no eval results to report", " ".join(specs[:3]), "run `mlbench eval` first")
    return list(settings.values())


def load_reference(path: str) -> list[Reference]:
    """Rows from a reference YAML: ``source`` and ``rows: [{name, task, pass@1, ...}]``."""
    p = Path(path)
    if not p.is_file():
        raise MLBenchError("reference file not found", path, "see configs/report/paper-rows.yaml for the format")
    doc = yaml.safe_load(p.read_text()) or {}
    source = doc.get("source")
    if not source:
        raise MLBenchError("a reference file needs `source:` (where the numbers are quoted from)", path)
    refs = []
    for i, row in enumerate(doc.get("rows") or []):
        if not isinstance(row, dict) or "name" not in row:
            raise MLBenchError(f"rows[{i}] needs `name`", path)
        values = {k: float(v) for k, v in row.items() if k not in ("name", "task", "table") and v is not None}
        bad = [k for k, v in values.items() if not 0 <= v <= 1]
        if bad:
            raise MLBenchError(f"rows[{i}] ({row['name']}): {bad} outside [0, 1]", path,
                               "write rates as fractions (0.3382), not percentages")
        table = f", table {row['table']}" if row.get("table") else ""
        refs.append(Reference(row["name"], row.get("task"), f"{source}{table}", values))
    return refs
