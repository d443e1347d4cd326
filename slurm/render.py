"""From a sweep to job arrays: the units of each stage, their commands, their sbatch scripts.

A job array per stage and kind of chain. Fine-tuned cells run prep → train → infer → eval; base-model cells
(split ``none``) run prep → infer-base → eval-base. Within a chain, array task *i* of a stage waits for task
*i* of the stage before it (``aftercorr``, Slurm's per-task ``afterok``), so one failed cell stops only its
own chain. The report runs after everything else has ended, whatever the outcome.
"""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import jinja2
import yaml

from mlbench_kit.config import to_dict
from mlbench_kit.errors import MLBenchError
from mlbench_kit.hf import model_positions
from mlbench_kit.io import write_atomic
from mlbench_kit.stages import load_stage_config, stage

from .spec import Cell, Sweep


@dataclass
class Unit:
    """One array task: an index, a key naming its done-marker, its output folder, its stage options (the cell's
    own, then the sweep file's), the command they make, and (once :func:`check_jobs` ran) the stage's typed config
    they resolve to, which the job runs from a file: ``mlbench STAGE --config unit.yaml``."""

    index: int
    key: str
    out: str
    opts: dict[str, Any]
    argv: list[str]
    config: Any = None


@dataclass
class ArrayJob:
    """One job array: a stage's units and the arrays it depends on (``(kind, job name)``)."""

    name: str
    stage: str
    units: list[Unit]
    deps: list[tuple[str, str]] = field(default_factory=list)


def options(opts: dict[str, Any]) -> list[str]:
    """``{max_context_tokens: 8192, no_hf: true, set: [a=1, b=2]}`` → ``--max-context-tokens 8192 --no-hf --set a=1
    --set b=2``."""
    argv: list[str] = []
    for k, v in opts.items():
        flag = "--" + k.replace("_", "-")
        if v is None or v is False:
            continue
        if v is True:
            argv.append(flag)
        elif k == "set":
            for item in v if isinstance(v, list) else [v]:
                argv += [flag, str(item)]
        elif isinstance(v, list):
            argv += [flag, *map(str, v)]
        else:
            argv += [flag, str(v)]
    return argv


def cell_dir(sweep: Sweep, cell: Cell) -> Path:
    return sweep.run_dir / cell.rel_dir


def prep_dir(sweep: Sweep, model: str) -> Path:
    return sweep.run_dir / "prep" / model


def _cli(stage: str) -> list[str]:
    return ["$PY", "-m", "mlbench_kit.cli", stage]


def prep_opts(sweep: Sweep, model: str) -> dict[str, Any]:
    m = sweep.models[model]
    base = {"data": sweep.cfg.data, "tasks": sweep.cfg.tasks, "tokenizer": m.tokenizer or m.path,
            "out": str(prep_dir(sweep, model))}
    return {**base, **sweep.options("prep", model)}


def train_opts(sweep: Sweep, cell: Cell) -> dict[str, Any]:
    m = sweep.models[cell.model]
    base = {"config": m.train_config, "model": m.path, "prep_dir": str(prep_dir(sweep, cell.model)),
            "tasks": cell.task, "split": cell.split, "seed": cell.seed, "out": str(cell_dir(sweep, cell) / "train")}
    return {**base, **sweep.options("train", cell.model)}


def infer_opts(sweep: Sweep, cell: Cell) -> dict[str, Any]:
    m = sweep.models[cell.model]
    adapter = None if cell.split == "none" else str(cell_dir(sweep, cell) / "train" / "adapter")
    base = {"model": m.path, "adapter": adapter, "prompts": str(prep_dir(sweep, cell.model)), "tasks": [cell.task],
            "seed": cell.seed, "out": str(cell_dir(sweep, cell) / "infer")}
    return {**base, **sweep.options("infer", cell.model)}


def eval_opts(sweep: Sweep, cell: Cell) -> dict[str, Any]:
    d = cell_dir(sweep, cell)
    base = {"data": sweep.cfg.data, "generations": str(d / "infer" / f"task{cell.task}.jsonl"),
            "out": str(d / "eval")}
    return {**base, **sweep.options("eval", cell.model)}


def command(stage_name: str, opts: dict[str, Any]) -> list[str]:
    """The job's command line for a unit's options (training: the recipe, for the launcher)."""
    return (["train/lora.py"] if stage_name == "train" else _cli(stage_name)) + options(opts)


def report_cmd(sweep: Sweep) -> list[str]:
    runs = [f"{c.model}/{c.split}={cell_dir(sweep, c) / 'eval'}" for c in sweep.cells()]
    return (_cli("report") + ["--skip-missing", *runs, "--out", str(sweep.run_dir / "report")]
            + options(sweep.cfg.report))


_CELL_OPTS = {"train": train_opts, "infer": infer_opts, "eval": eval_opts}


def _cell_job(sweep: Sweep, name: str, stage_name: str, cells: list[tuple[int, Cell]],
              deps: list[tuple[str, str]]) -> ArrayJob:
    units = []
    for i, c in cells:
        opts = _CELL_OPTS[stage_name](sweep, c)
        units.append(Unit(i, c.key, str(cell_dir(sweep, c) / stage_name), opts, command(stage_name, opts)))
    return ArrayJob(name, stage_name, units, deps)


def jobs(sweep: Sweep) -> list[ArrayJob]:
    """Every job array of the sweep, in submission order, with all units (done or not)."""
    cells = list(enumerate(sweep.cells()))
    tuned = [(i, c) for i, c in cells if c.split != "none"]
    base = [(i, c) for i, c in cells if c.split == "none"]
    preps = [(i, m, prep_opts(sweep, m)) for i, m in enumerate(sweep.models)]
    out = [ArrayJob("prep", "prep", [Unit(i, m, str(prep_dir(sweep, m)), o, command("prep", o))
                                     for i, m, o in preps])]
    if tuned:
        out += [_cell_job(sweep, "train", "train", tuned, [("afterok", "prep")]),
                _cell_job(sweep, "infer", "infer", tuned, [("afterok", "prep"), ("aftercorr", "train")]),
                _cell_job(sweep, "eval", "eval", tuned, [("aftercorr", "infer")])]
    if base:
        out += [_cell_job(sweep, "infer-base", "infer", base, [("afterok", "prep")]),
                _cell_job(sweep, "eval-base", "eval", base, [("aftercorr", "infer-base")])]
    report = {"skip_missing": True, "out": str(sweep.run_dir / "report"), **sweep.cfg.report}
    out.append(ArrayJob("report", "report", [Unit(0, "report", str(sweep.run_dir / "report"), report,
                                                  report_cmd(sweep))],
                        [("afterany", j.name) for j in out]))
    return out


def _unit_model(sweep: Sweep, job: ArrayJob, unit: Unit) -> str | None:
    if job.stage == "report":
        return None
    if job.stage == "prep":
        return unit.key
    return max((m for m in sweep.models if unit.key.startswith(f"{m}.")), key=len)  # keys: model.split.taskT.sS


REPORT_OPTIONS = ("reference", "all_reference")  # what a sweep's report section may set (`mlbench report`'s)


def check_jobs(sweep: Sweep, all_jobs: list[ArrayJob]) -> None:
    """Every unit's options loaded as its stage's typed config (:mod:`mlbench_kit.stages`), before anything is
    submitted: a typo that would fail only when its jobs start (after prep, train and infer ran) fails here, at
    the sweep file's line (or the stage config file's). Also: the room prep leaves for generation must fit in the
    model's positions (read from a local model folder, or the hub cache, by the same
    :func:`~mlbench_kit.hf.model_positions` prep uses) and hold infer's new tokens (Llama-2's 4,096 positions
    otherwise refuse the task-1 prompts)."""
    room: dict[str, int] = {}
    root = Path(sweep.root)
    unknown = sorted(set(sweep.cfg.report) - set(REPORT_OPTIONS))
    if unknown:
        raise MLBenchError(f"report has no option {unknown[0]!r}", sweep.where("report", None, unknown[0]),
                           f"its options here: {', '.join(REPORT_OPTIONS)}")
    for job in all_jobs:
        if job.stage == "report":
            continue
        for unit in job.units:
            model = _unit_model(sweep, job, unit)

            def where(key: str, stage_name: str = job.stage, model: str | None = model) -> str:
                return sweep.where(stage_name, model, key)
            try:
                cfg = unit.config = load_stage_config(stage(job.stage), unit.opts, where, root)
            except MLBenchError as exc:
                raise MLBenchError(f"{job.name} [{unit.key}]: {exc.what}", exc.where,
                                   exc.fix or f"`mlbench {job.stage} --help` lists its options") from None
            if job.stage == "prep" and model is not None:
                room[model] = cfg.max_new_tokens
                tokenizer = cfg.tokenizer
                if tokenizer and (root / tokenizer).exists():
                    tokenizer = str(root / tokenizer)  # the jobs run in the root: a local model is relative to it
                positions = model_positions(tokenizer, local_only=True) if tokenizer else None
                if positions and cfg.max_new_tokens >= positions:
                    raise MLBenchError(
                        f"prep leaves {cfg.max_new_tokens} new tokens of room, but {model} ({cfg.tokenizer}) "
                        f"has {positions} positions: no room for a prompt",
                        sweep.where("prep", model, "max_new_tokens"),
                        f"set prep max_new_tokens below {positions}")
            elif job.stage == "infer" and model is not None and room.get(model):
                new = cfg.sampling.max_new_tokens
                if new > room[model]:
                    raise MLBenchError(
                        f"infer generates up to {new} new tokens, but prep left room for "
                        f"{room[model]} in {model}'s prompts", sweep.where("prep", model, "max_new_tokens"),
                        f"set prep max_new_tokens: {new} (or lower infer's max_new_tokens)")


def state_dir(sweep: Sweep, stage: str) -> Path:
    """Where a stage's jobs leave ``<unit key>.done`` when their command succeeded."""
    return sweep.run_dir / "state" / stage


def done_marker(sweep: Sweep, stage: str, key: str) -> Path:
    return state_dir(sweep, stage) / f"{key}.done"


def _env() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(Path(__file__).parent / "templates"),
                             undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    env.filters["q"] = lambda s: shlex.quote(str(s))
    # "$PY" stays a variable (the job's interpreter); everything else is quoted literally
    env.filters["join_q"] = lambda argv: " ".join('"$PY"' if a == "$PY" else shlex.quote(a) for a in argv)
    return env


def unit_config_file(folder: Path, job: ArrayJob, unit: Unit) -> Path:
    """Where a unit's resolved config is written, beside its job's sbatch script."""
    return folder / job.name / f"{unit.key}.yaml"


def write_unit_configs(folder: Path, job: ArrayJob) -> None:
    """Each unit's resolved config (:func:`check_jobs` filled them) as a file its job runs from; ``mlbench STAGE
    --config FILE`` replays the unit by hand."""
    for unit in job.units:
        if unit.config is not None:
            write_atomic(unit_config_file(folder, job, unit), yaml.safe_dump(to_dict(unit.config), sort_keys=False))


def render(sweep: Sweep, job: ArrayJob, folder: Path | None = None) -> str:
    """The sbatch script of one job array (only its ``units``). With ``folder`` (where
    :func:`write_unit_configs` wrote them), each unit runs from its resolved config file; else from its options."""
    s = sweep.cfg.slurm
    r = sweep.resources(job.stage)
    train = job.stage == "train"
    procs = r.processes_per_node or max(1, r.gpus_per_node)
    # by default DDP on one node (LoRA's frozen base fits on every GPU), FSDP2 across nodes
    acc = r.accelerate_config or ("configs/accelerate/fsdp2.yaml" if r.nodes > 1
                                  else "configs/accelerate/ddp.yaml" if procs > 1 else "configs/accelerate/single.yaml")
    unit = {"prep": "model", "report": "sweep"}.get(job.stage, "(model, split, task, seed) cell")
    return _env().get_template("stage.sbatch.j2").render(
        sweep=sweep.name, job=job.name, stage=job.stage, unit=unit, source=sweep.source, run_dir=sweep.run_dir,
        array=",".join(str(u.index) for u in job.units), logs=sweep.run_dir / "logs", r=r,
        partition=s.partition, account=s.account, requeue=s.requeue, signal_before_s=s.signal_before_s,
        max_requeues=s.max_requeues, extra=s.extra, env=s.env, setup=s.setup, root=sweep.root,
        python=sys.executable, units=job.units, done_dir=state_dir(sweep, job.stage),
        cmds={u.index: u.argv if folder is None or u.config is None
              else command(job.stage, {"config": str(unit_config_file(folder, job, u))}) for u in job.units},
        skip_done=job.stage != "report",
        train=train, procs_per_node=procs, accelerate_config=acc)
