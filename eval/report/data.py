"""What `mlbench report` reads: eval folders grouped into settings (checkpoint x task, seeds averaged), what each
checkpoint is (base, SFT, or a learning method's adapter and its round: :func:`checkpoint_of`), and published rows
quoted from a reference file."""

from __future__ import annotations

import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from mlbench_kit.config import read_yaml
from mlbench_kit.errors import MLBenchError
from mlbench_kit.hf import TRAIN_META
from mlbench_kit.records import TASKS

MAX_META = 1 << 20  # bytes of a run's small record (infer.json, config.yaml, mlbench_train.json) read at most
MAX_GENERATIONS = 256 << 20  # a generations file larger than this is not read
LEARN_METHODS = ("rft", "dpo", "grpo")  # the learn methods that write an adapter (`mlbench learn --method`)


@dataclass(frozen=True)
class Checkpoint:
    """What an eval scored, read from the runs' own files: the base model, an SFT adapter (``mlbench train``), or
    a learned one (``mlbench learn``: its method, rft's round of its rounds, dpo's and grpo's optimizer steps)."""

    kind: str  # "base", "sft", "adapter" (an adapter of unknown origin), or a method of LEARN_METHODS
    round: int | None = None
    rounds: int | None = None
    steps: int | None = None

    @property
    def label(self) -> str:
        """``base``, ``SFT``, ``rft round 1 of 2``, ``grpo, 30 steps``."""
        if self.kind in ("base", "adapter"):
            return self.kind
        if self.kind == "sft":
            return "SFT"
        if self.round is not None:
            return f"{self.kind} round {self.round}" + (f" of {self.rounds}" if self.rounds else "")
        return self.kind + (f", {self.steps} steps" if self.steps is not None else "")

    @property
    def learned(self) -> bool:
        """Whether ``mlbench learn`` made it."""
        return self.kind in LEARN_METHODS


@dataclass
class Setting:
    """One checkpoint on one task: the eval summaries of its seeds."""

    run: str
    task: int | None
    agent: str | None = None  # the policy of an agent run (`mlbench agent`): "ml-agent" or "bash"
    summaries: list[dict[str, Any]] = field(default_factory=list)
    dirs: list[str] = field(default_factory=list)
    agents: list[dict[str, Any]] = field(default_factory=list)  # the agent runs' own summary.json, one per seed
    checkpoints: list[Checkpoint | None] = field(default_factory=list)  # what each seed's eval scored (None: unknown)

    @property
    def checkpoint(self) -> str:
        """What was scored: ``base``, ``SFT``, ``rft round 1 of 1`` (seeds that differ: each, with ``/``); ``–``
        when the runs' files do not say."""
        labels = list(dict.fromkeys(c.label if c else "–" for c in self.checkpoints))
        return " / ".join(labels) if labels else "–"

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
            except (ValueError, RecursionError):  # RecursionError: nested too deeply (an untrusted file)
                return None
            if isinstance(found, dict) and isinstance(found.get("policy"), str) and "config_sha" in found:
                return found
            return None
    return None


def _small_record(path: Path) -> Any:
    """A run's small JSON or YAML record (a mapping), or None when it is missing, a link, too large or not one."""
    try:
        if path.is_symlink() or not path.is_file() or path.stat().st_size > MAX_META:
            return None
        text = path.read_text(encoding="utf-8")
        found = yaml.safe_load(text) if path.suffix == ".yaml" else json.loads(text)
    except (OSError, ValueError, RecursionError, yaml.YAMLError):
        return None
    return found if isinstance(found, dict) else None


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _run_folder(eval_dir: Path) -> Path | None:
    """The `mlbench run` folder an eval folder sits in (``OUT/eval/<model>/task<t>``, beside ``OUT/infer/`` and its
    ``OUT/run.json``), or None."""
    up = eval_dir.resolve().parents
    if len(up) > 2 and up[1].name == "eval":
        marker = up[2] / "run.json"
        if marker.is_file() and not marker.is_symlink():
            return up[2]
    return None


def generations_file(summary: dict[str, Any], eval_dir: Path) -> Path | None:
    """The generations file an eval scored (its summary's ``generations``; relative: to the working folder, else
    to the eval folder), or None when it is missing, a link, too large, not ``.jsonl``, or outside the working
    folder, the folder holding the eval folder (a run's infer/ and eval/ sit side by side there) and the
    `mlbench run` folder holding it (``OUT/eval/<model>/task<t>``): a
    summary is data, and a path it names elsewhere (``/home/me/notes.jsonl``, ``../../..``) is not read."""
    gens = summary.get("generations")
    if not isinstance(gens, str) or not gens.endswith(".jsonl") or "\x00" in gens:
        return None
    p = Path(gens)
    try:
        roots = [r for r in (Path.cwd().resolve(), eval_dir.resolve().parent, _run_folder(eval_dir))
                 if r is not None and r != Path(r.anchor)]
        for f in [p] if p.is_absolute() else [Path.cwd() / p, eval_dir / p]:
            real = f.resolve()
            if not any(real.is_relative_to(r) for r in roots):
                continue
            if f.is_file() and not f.is_symlink() and f.stat().st_size <= MAX_GENERATIONS:
                return real
    except (OSError, RuntimeError, ValueError):  # a link loop, a name the OS refuses
        return None
    return None


def checkpoint_of(summary: dict[str, Any], eval_dir: Path) -> Checkpoint | None:
    """What an eval scored, from the runs' own files: the generations file's ``infer.json`` names the adapter (None:
    the base model); an adapter in an ``mlbench learn`` folder (its ``learn.json`` and ``config.yaml``; ``OUT/adapter``
    or rft's ``OUT/round-R/train/adapter``) is that method's, with rft's round (of ``rft.rounds``) or the steps its
    ``mlbench_train.json`` records; an adapter with ``mlbench_train.json`` and no ``learned`` is SFT. None when the
    files do not say (generations moved, not written by `mlbench infer`)."""
    try:
        return _checkpoint(summary, eval_dir)
    except (OSError, ValueError):  # a name the OS refuses (too long, a NUL): the files do not say
        return None


def _checkpoint(summary: dict[str, Any], eval_dir: Path) -> Checkpoint | None:
    gens = generations_file(summary, eval_dir)
    infer = _small_record(gens.parent / "infer.json") if gens is not None else None
    if infer is None or "adapter" not in infer:
        return None
    ident = infer["adapter"]
    if ident is None:
        return Checkpoint("base")
    if not isinstance(ident, dict) or not isinstance(ident.get("name"), str) or "\x00" in ident["name"]:
        return None
    adapter = Path(ident["name"])
    meta = _small_record(adapter / TRAIN_META) or {}
    learned = meta.get("learned") if isinstance(meta.get("learned"), dict) else None
    m = re.fullmatch(r"round-([1-9][0-9]{0,5})", adapter.parent.parent.name)
    if adapter.name == "adapter" and adapter.parent.name == "train" and m:
        run, rnd = adapter.parent.parent.parent, int(m.group(1))  # an rft round's own adapter
    else:
        run, rnd = adapter.parent, None
    cfg = _small_record(run / "config.yaml") if (run / "learn.json").is_file() else None
    method = cfg.get("method") if cfg is not None else None
    if cfg is not None and method in LEARN_METHODS and (rnd is None or method == "rft") and adapter.name == "adapter":
        if method == "rft":
            section = cfg.get("rft") if isinstance(cfg.get("rft"), dict) else {}
            rounds = _count(section.get("rounds"))
            return Checkpoint("rft", rnd or _count((learned or {}).get("rounds")) or rounds, rounds)
        return Checkpoint(method, steps=_count((learned or {}).get("steps")))
    if learned is None and meta:
        return Checkpoint("sft")
    return Checkpoint("adapter")


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
        if f.stat().st_size > MAX_GENERATIONS:
            raise MLBenchError(f"summary.json is larger than {MAX_GENERATIONS} bytes", str(f),
                               "pass folders written by `mlbench eval`")
        try:
            summary = json.loads(f.read_text(encoding="utf-8"))
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            why = "nested too deeply" if isinstance(exc, RecursionError) else exc
            raise MLBenchError(f"summary.json is not JSON ({why})", str(f),
                               "pass folders written by `mlbench eval`") from None
        if not isinstance(summary, dict):
            raise MLBenchError("summary.json is not a JSON object", str(f), "pass folders written by `mlbench eval`")
        agent = agent_summary(summary, Path(path))
        policy = None if agent is None else agent["policy"] + (f" {agent['steps']}" if agent.get("steps") and
                                                               agent["policy"] == "ml-agent" else "")
        key = (name or Path(path).name, None if agent else _task_of(summary), policy)
        s = settings.setdefault(key, Setting(*key))
        s.summaries.append(summary)
        s.dirs.append(path)
        s.checkpoints.append(checkpoint_of(summary, Path(path)))
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
