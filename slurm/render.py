"""From a sweep to job arrays: the units of each stage, their commands, their sbatch scripts.

A job array per stage and kind of chain. Fine-tuned cells run prep → train → infer → eval; base-model cells
(split ``none``) run prep → infer-base → eval-base. A sweep with an ``agent:`` section adds, per cell,
agent → eval-agent (after train) and agent-base → eval-agent-base (after prep): the agent's generations, scored
like infer's. A sweep with a ``learn:`` section adds, per fine-tuned cell, learn → infer-learn → eval-learn (after
train): `mlbench learn` from the cell's SFT adapter on its training split, then the learned adapter through infer
and eval as train's. Within a chain, array task *i* of a stage waits for task
*i* of the stage before it (``aftercorr``, Slurm's per-task ``afterok``), so one failed cell stops only its
own chain. The report runs after everything else has ended, whatever the outcome.
"""

from __future__ import annotations

import re
import shlex
import sys
from collections.abc import Callable
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

from .spec import LEARN_SPLITS, Cell, Sweep


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
    base = {**_cell_inputs(sweep, cell), "prompts": str(prep_dir(sweep, cell.model)), "tasks": [cell.task],
            "seed": cell.seed, "out": str(cell_dir(sweep, cell) / "infer")}
    return {**base, **sweep.options("infer", cell.model)}


def eval_opts(sweep: Sweep, cell: Cell, source: str = "infer") -> dict[str, Any]:
    """The eval of the cell's generations: infer's (into ``eval/``), the learned adapter's (``infer-learn`` into
    ``eval-learn/``) or the agent's (into ``eval-agent/``)."""
    d = cell_dir(sweep, cell)
    gens, out = {"infer": (d / "infer" / f"task{cell.task}.jsonl", d / "eval"),
                 "infer-learn": (d / "infer-learn" / f"task{cell.task}.jsonl", d / "eval-learn"),
                 "agent": (d / "agent" / "generations.jsonl", d / "eval-agent")}[source]
    base = {"data": sweep.cfg.data, "generations": str(gens), "out": str(out)}
    return {**base, **sweep.options("eval", cell.model)}


def agent_opts(sweep: Sweep, cell: Cell) -> dict[str, Any]:
    """The cell's agent run: its model (and adapter), seed and folder; its rows are those of infer's prompts (prep's
    file of the cell's task in infer's split); its environments eval's. The sweep's agent options on top."""
    base = {**_agent_cell_opts(sweep, cell), "tokenizer": sweep.models[cell.model].tokenizer,
            "rows_of": str(prep_dir(sweep, cell.model) / _infer_split(sweep, cell.model) / f"task{cell.task}.jsonl"),
            "envs": sweep.options("eval", cell.model).get("envs")}
    return {**base, **sweep.options("agent", cell.model)}


def _agent_cell_opts(sweep: Sweep, cell: Cell) -> dict[str, Any]:
    """The agent options that are the cell's own (checked by :func:`check_jobs`: the section may not change them)."""
    return {**_cell_inputs(sweep, cell), "data": sweep.cfg.data, "seed": cell.seed,
            "out": str(cell_dir(sweep, cell) / "agent")}


def _cell_inputs(sweep: Sweep, cell: Cell) -> dict[str, Any]:
    """What the cell's model is: the model and (tuned cells) the adapter its train unit writes."""
    adapter = None if cell.split == "none" else str(cell_dir(sweep, cell) / "train" / "adapter")
    return {"model": sweep.models[cell.model].path, "adapter": adapter}


def learn_opts(sweep: Sweep, cell: Cell) -> dict[str, Any]:
    """The cell's learning run: from its SFT adapter, on the training split its adapter was tuned on, the leak check
    against the split infer scores, the checker's rows and environments eval's. The sweep's learn options on top."""
    ev = sweep.options("eval", cell.model)
    base = {**_learn_cell_opts(sweep, cell), "envs": ev.get("envs"), "backend": ev.get("backend"),
            "timeout": _eval_timeout(sweep, cell)}
    return {**base, **sweep.options("learn", cell.model)}


def _eval_timeout(sweep: Sweep, cell: Cell) -> float | None:
    """The time limit per execution eval scores the model with (its option, else its config file's; None: the
    benchmark's, and learn's config may set its own): learn's rewards are verdicts under the same limit. A broken
    eval section is reported by :func:`check_jobs` at its units."""
    try:
        return load_stage_config(stage("eval"), eval_opts(sweep, cell), lambda key: key, sweep.root).timeout
    except MLBenchError:
        return None


def _learn_cell_opts(sweep: Sweep, cell: Cell) -> dict[str, Any]:
    """The learn options that are the cell's own (checked by :func:`check_jobs`: the section may not change them)."""
    return {**_cell_inputs(sweep, cell), "prep_dir": str(prep_dir(sweep, cell.model)),
            "split": LEARN_SPLITS[cell.split], "eval_split": _infer_split(sweep, cell.model), "task": cell.task,
            "data": sweep.cfg.data, "seed": cell.seed, "out": str(cell_dir(sweep, cell) / "learn")}


def learned_infer_opts(sweep: Sweep, cell: Cell) -> dict[str, Any]:
    """The learned adapter through infer, as the cell's SFT adapter: the same options, into ``infer-learn/``."""
    d = cell_dir(sweep, cell)
    return {**infer_opts(sweep, cell), "adapter": str(d / "learn" / "adapter"), "out": str(d / "infer-learn")}


def _learn_method(sweep: Sweep, model: str) -> str:
    """The method the model's learn units run (its option, else its config file's, else the default), to name the
    report's checkpoint; a broken learn section is reported by :func:`check_jobs` at the learn units."""
    opts = {k: v for k, v in sweep.options("learn", model).items() if k in ("config", "method")}
    try:
        return str(load_stage_config(stage("learn"), opts, lambda key: key, sweep.root).method)
    except MLBenchError:
        return "learn"


def _infer_split(sweep: Sweep, model: str) -> str:
    """The prep split infer's prompts come from (its option, else its config file's, else its default); a broken
    infer section is reported by :func:`check_jobs` at the infer units."""
    opts = {k: v for k, v in sweep.options("infer", model).items() if k in ("config", "split")}
    try:
        cfg = load_stage_config(stage("infer"), opts, lambda key: key, sweep.root)
    except MLBenchError:
        return "full"
    return str(cfg.split)


def command(stage_name: str, opts: dict[str, Any]) -> list[str]:
    """The job's command line for a unit's options (training: the recipe, for the launcher)."""
    return (["train/lora.py"] if stage_name == "train" else _cli(stage_name)) + options(opts)


def report_cmd(sweep: Sweep) -> list[str]:
    runs = [f"{c.model}/{c.split}={cell_dir(sweep, c) / 'eval'}" for c in sweep.cells()]
    if sweep.has_agent:  # an eval of agent generations is an agent setting of its checkpoint (the same NAME)
        runs += [f"{c.model}/{c.split}={cell_dir(sweep, c) / 'eval-agent'}" for c in sweep.cells()]
    if sweep.has_learn:  # a learned checkpoint: a run of its own (the report names its method and round)
        runs += [f"{c.model}/{c.split}+{_learn_method(sweep, c.model)}={cell_dir(sweep, c) / 'eval-learn'}"
                 for c in sweep.cells() if c.split != "none"]
    return (_cli("report") + ["--skip-missing", *runs, "--out", str(sweep.run_dir / "report")]
            + options(sweep.cfg.report))


_CELL_OPTS: dict[str, Callable[[Sweep, Cell], dict[str, Any]]] = {
    "train": train_opts, "infer": infer_opts, "eval": eval_opts, "agent": agent_opts,
    "eval-agent": lambda sweep, cell: eval_opts(sweep, cell, "agent"), "learn": learn_opts,
    "infer-learn": learned_infer_opts, "eval-learn": lambda sweep, cell: eval_opts(sweep, cell, "infer-learn")}


def _cell_job(sweep: Sweep, name: str, stage_name: str, cells: list[tuple[int, Cell]],
              deps: list[tuple[str, str]], kind: str | None = None) -> ArrayJob:
    """A stage's units over ``cells``; ``kind`` (eval-agent, infer-learn, eval-learn) names the options, the folder
    and the key's suffix (its done-marker sits beside the stage's own)."""
    kind = kind or stage_name
    units = []
    for i, c in cells:
        opts = _CELL_OPTS[kind](sweep, c)
        key = c.key if kind == stage_name else f"{c.key}.{kind.removeprefix(stage_name + '-')}"
        units.append(Unit(i, key, str(cell_dir(sweep, c) / kind), opts, command(stage_name, opts)))
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
    if sweep.has_agent:  # the agent needs the cell's model (and adapter); its generations are scored as infer's
        for cs, suffix, first in ((tuned, "", [("afterok", "prep"), ("aftercorr", "train")]),
                                  (base, "-base", [("afterok", "prep")])):
            if cs:
                out += [_cell_job(sweep, f"agent{suffix}", "agent", cs, first),
                        _cell_job(sweep, f"eval-agent{suffix}", "eval", cs, [("aftercorr", f"agent{suffix}")],
                                  "eval-agent")]
    if sweep.has_learn and tuned:  # from the cell's SFT adapter; the learned one scored as train's
        out += [_cell_job(sweep, "learn", "learn", tuned, [("afterok", "prep"), ("aftercorr", "train")]),
                _cell_job(sweep, "infer-learn", "infer", tuned, [("aftercorr", "learn")], "infer-learn"),
                _cell_job(sweep, "eval-learn", "eval", tuned, [("aftercorr", "infer-learn")], "eval-learn")]
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
    _check_agent(sweep, all_jobs)
    _check_learn(sweep, all_jobs)


# what a sweep's learn unit can run: a method that learns from the cell's own adapter and samples (data writes no
# adapter; dpo needs the training split's generations and verdicts, which no unit of a sweep makes)
SWEEP_METHODS = ("rft", "grpo")


def _check_learn(sweep: Sweep, all_jobs: list[ArrayJob]) -> None:
    """The learn units against their cells and evals (configs already loaded): learning starts from the cell's
    model and SFT adapter, on its training split, is leak-checked against the split infer scores, reads eval's
    rows, environments, sandbox and time limit (a reward is eval's verdict), writes into the folder its infer
    reads, runs a method that writes an adapter, and names files that exist where the jobs run."""
    by_name = {j.name: j for j in all_jobs}
    if "learn" not in by_name:
        return
    evals = {u.index: u for u in by_name["eval"].units}
    for unit in by_name["learn"].units:
        model = _unit_model(sweep, by_name["learn"], unit)
        cfg, ev = unit.config, evals[unit.index].config
        given = sweep.options("learn", str(model))

        def fail(what: str, key: str, fix: str, unit: Unit = unit, given: dict[str, Any] = given,
                 model: str | None = model) -> MLBenchError:
            at = sweep.where("learn", model, key) if key in given else sweep.lines.at("learn")
            return MLBenchError(f"learn [{unit.key}]: {what}", at, fix)
        if cfg.method not in SWEEP_METHODS:
            raise fail(f"method {cfg.method!r} writes no adapter from the cell's own samples" if cfg.method == "data"
                       else f"method {cfg.method!r} needs the training split's generations and their verdicts, "
                       "which no sweep unit makes", "method" if "method" in given else "config",
                       f"a sweep learns with {' or '.join(SWEEP_METHODS)}; run `mlbench learn --method "
                       f"{cfg.method}` by hand (docs/learn.md)")
        ours = _learn_cell_opts(sweep, sweep.cells()[unit.index])
        for key, value in (("model", cfg.model), ("adapter", cfg.adapter), ("prep_dir", cfg.prep_dir),
                           ("split", cfg.split), ("eval_split", cfg.eval_split), ("task", cfg.task),
                           ("data", cfg.data), ("seed", cfg.seed), ("out", cfg.out)):
            if value != ours[key]:
                raise fail(f"learn's {key} is the cell's ({ours[key]}), not {value}", key if key in given else "set",
                           f"leave {key} out of the learn section: the sweep sets it for each cell")
        # eval's time limit when it sets one (without one, learn's config may choose its own, as the tiny one does)
        if cfg.envs != ev.envs or cfg.backend != ev.backend or ev.timeout not in (None, cfg.timeout):
            key = "envs" if cfg.envs != ev.envs else "backend" if cfg.backend != ev.backend else "timeout"
            raise fail(f"learn's rewards would come from other {key} ({getattr(cfg, key)}) than eval scores with "
                       f"({getattr(ev, key)})", key, f"leave {key} out of the learn section: it takes eval's")
        try:
            cfg.require_inputs()
        except MLBenchError as exc:
            raise fail(exc.what, "set", "set them under eval: (envs) and at the top (data)") from None
        for key in ("rft.train_config", "rft.infer_config"):
            rel = cfg.rft.train_config if key == "rft.train_config" else cfg.rft.infer_config
            if cfg.method == "rft" and rel is not None and not (Path(sweep.root) / rel).is_file():
                raise fail(f"{key} not found: {rel}", "set" if "set" in given else "config",
                           f"a path relative to {sweep.root}, where the jobs run")


def _check_agent(sweep: Sweep, all_jobs: list[ArrayJob]) -> None:
    """The agent units against their cells and their evals (configs already loaded): the agent runs the cell's
    model, adapter, seed and rows into the folder its eval reads; it has checkouts; its bash actions run in the
    environments, and the sandbox, that eval scores in; eval looks its rows up in the same data split."""
    by_name = {j.name: j for j in all_jobs}
    for job in (j for j in all_jobs if j.stage == "agent"):
        evals = {u.index: u for u in by_name[job.name.replace("agent", "eval-agent", 1)].units}
        for unit in job.units:
            model = _unit_model(sweep, job, unit)
            cfg, ev = unit.config, evals[unit.index].config

            given = sweep.options("agent", str(model))

            def fail(what: str, key: str, fix: str, unit: Unit = unit, given: dict[str, Any] = given,
                     job: ArrayJob = job, model: str | None = model) -> MLBenchError:
                at = sweep.where("agent", model, key) if key in given else sweep.lines.at("agent")
                return MLBenchError(f"{job.name} [{unit.key}]: {what}", at, fix)
            ours = _agent_cell_opts(sweep, sweep.cells()[unit.index])
            for key, value in (("model", cfg.model), ("adapter", cfg.adapter), ("data", cfg.data), ("out", cfg.out),
                               ("seed", cfg.sampling.seed)):
                if value != ours[key]:
                    raise fail(f"the agent's {key} is the cell's ({ours[key]}), not {value}",
                               key if key in given else "set",
                               f"leave {key} out of the agent section: the sweep sets it for each cell")
            if cfg.repos_dir is None and cfg.tarballs is None:
                raise fail("the agent needs the repositories' pristine checkouts", "repos_dir",
                           "set repos_dir (a folder of <repo>/ checkouts) or tarballs (<repo>.tar.gz) under agent:")
            if cfg.split != ev.split:
                raise fail(f"the agent reads rows of split {cfg.split!r}, eval looks them up in {ev.split!r}",
                           "split", "set the same split under agent: and eval:")
            if cfg.policy == "bash" and cfg.envs != ev.envs:
                raise fail(f"the agent's actions would run in other environments ({cfg.envs}) than eval scores in "
                           f"({ev.envs})", "envs", "leave envs out of the agent section: it takes eval's")
            if cfg.policy == "bash" and ev.backend in ("bwrap", "podman") and cfg.bash.sandbox != ev.backend:
                raise fail(f"the agent's actions run in {cfg.bash.sandbox}, eval's checks in {ev.backend}", "set",
                           f"set: [bash.sandbox={ev.backend}] under agent: (or the same backend under eval:)")


def state_dir(sweep: Sweep, stage: str) -> Path:
    """Where a stage's jobs leave ``<unit key>.done`` when their command succeeded."""
    return sweep.run_dir / "state" / stage


def done_marker(sweep: Sweep, stage: str, key: str) -> Path:
    return state_dir(sweep, stage) / f"{key}.done"


def _one_line(value: Any) -> str:
    """A value for an #SBATCH directive or a comment line: nothing that ends the line (the spec refuses such values
    at their sweep file's line; this catches one from elsewhere, such as the folder the sweep runs in)."""
    text = str(value)
    if _LINE_BREAK.search(text):
        raise MLBenchError(f"{text!r} holds a control character and cannot go on a line of the sbatch script",
                           "mlbench sweep", "use paths and values without line breaks or control characters")
    return text


def _shell_name(value: Any) -> str:
    if not _NAME.fullmatch(str(value)):
        raise MLBenchError(f"{str(value)!r} is not a shell variable's name", "slurm.env", "e.g. NCCL_SOCKET_IFNAME")
    return str(value)


_LINE_BREAK = re.compile(r"[\x00-\x1f\x7f]")
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _env() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(Path(__file__).parent / "templates"),
                             undefined=jinja2.StrictUndefined, keep_trailing_newline=True)
    env.filters["q"] = lambda s: shlex.quote(str(s))
    env.filters["line"] = _one_line
    env.filters["name"] = _shell_name
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
