"""`mlbench run`: one command from a model to a score, prep -> infer -> eval -> report in one folder.

Each stage is called through the stage table (its ``call``: the entry on a typed config) with the config its own
command line would build (:func:`mlbench_kit.stages.load_stage_config`, from the stage's config file and the run's
options), so the core imports no stage. The run's folder:

    OUT/run.json            the run's resolved options (another run may not reuse the folder)
    OUT/stages.json         the stages finished, written after each one: a stage listed there is kept
    OUT/prep/               mlbench prep
    OUT/infer/<model>/      mlbench infer (base, and one folder per adapter)
    OUT/eval/<model>/task<t>/  mlbench eval
    OUT/report/             mlbench report
    OUT/summary.json        the numbers printed at the end

A stage not listed in ``stages.json`` (never run, interrupted, failed) is run again; infer and eval resume from
what they wrote, prep publishes its folder whole.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

from .config import save_resolved, to_dict
from .envspec import default_cache
from .errors import MLBenchError, Terminated, raise_terminated
from .flags import resolve
from .io import claim_run_folder, read_json, write_json_atomic
from .run_config import RunConfig
from .stages import load_stage_config, stage

CHECKOUT = Path(__file__).resolve().parents[1]  # shipped configs are found here when not in the working folder
BASE = "base"  # the folder (and report name) of the model without an adapter


def run(args: argparse.Namespace) -> int:
    """``mlbench run``: the options resolved into a :class:`RunConfig`, then :func:`run_all`."""
    cfg = resolve(stage("run"), args)
    cfg.require_inputs(args.config)
    return run_all(cfg)


def _config_file(path: str | None, flag: str) -> str | None:
    """A stage's config file: as given (relative to the working folder), else the shipped one beside the code."""
    if path is None:
        return None
    p = Path(path)
    if p.is_file():
        return str(p)
    if not p.is_absolute() and (CHECKOUT / p).is_file():
        return str(CHECKOUT / p)
    raise MLBenchError("config file not found", flag, "check the path (`mlbench configs ls` lists the shipped ones)")


def models(cfg: RunConfig) -> list[str]:
    """The names scored: ``base`` and each adapter's (``with_base`` off: the adapters alone)."""
    named = [spec.partition("=")[0] for spec in cfg.adapters]
    return ([BASE] if cfg.with_base or not named else []) + named


def stage_options(cfg: RunConfig, out: Path) -> dict[str, Any]:
    """Each stage's options (its command line's names) as this run sets them: ``prep``, ``infer``, one
    ``eval:<model>:<task>`` per model and task, ``report``."""
    prep = {"config": _config_file(cfg.prep_config, "--prep-config"), "data": cfg.data, "splits": [cfg.split],
            "tasks": cfg.tasks, "tokenizer": cfg.model, "hf": False, "out": str(out / "prep")}
    for key in ("readmes", "repos_dir", "checkout", "template"):
        if getattr(cfg, key) is not None:
            prep[key] = getattr(cfg, key)
    infer: dict[str, Any] = {"config": _config_file(cfg.infer_config, "--infer-config"), "model": cfg.model,
                             "prompts": str(out / "prep"), "split": cfg.split, "tasks": cfg.tasks,
                             "out": str(out / "infer"), "limit": cfg.limit}
    if cfg.adapters:
        infer.update(adapters=cfg.adapters, with_base=cfg.with_base)
    options: dict[str, Any] = {"prep": prep, "infer": infer}
    envs = cfg.envs or str(default_cache() / "envs.yaml")
    for name in models(cfg):
        folder = out / "infer" / name if cfg.adapters else out / "infer"
        for t in cfg.tasks:
            ev = {"config": _config_file(cfg.eval_config, "--eval-config"), "data": cfg.data, "split": cfg.split,
                  "generations": str(folder / f"task{t}.jsonl"), "envs": envs, "mode": cfg.mode,
                  "out": str(out / "eval" / name / f"task{t}")}
            if cfg.repos_dir is not None:
                ev["repos_dir"] = cfg.repos_dir
            options[f"eval:{name}:{t}"] = ev
    return options


CONFIG_KEYS = ("prep_config", "infer_config", "eval_config", "reference")
PATHS = ("model", "data", "readmes", "repos_dir", "checkout", "envs", "prep_config", "infer_config", "eval_config",
         "reference")


def identity(cfg: RunConfig) -> dict[str, Any]:
    """What a run folder is for: the options, with paths that exist made absolute (the same run resumes from
    another working folder, or named another way) and without the folder itself (a moved folder resumes)."""
    d = to_dict(cfg)
    d.pop("out", None)
    for key in PATHS:
        if isinstance(d.get(key), str):
            p = Path(d[key])
            if not p.exists() and key in CONFIG_KEYS and (CHECKOUT / p).is_file():
                p = CHECKOUT / p  # a shipped config, found beside the code (_config_file)
            d[key] = str(p.resolve()) if p.exists() else d[key]
    d["adapters"] = [f"{n}={Path(p).resolve() if Path(p).exists() else p}"
                     for n, _, p in (a.partition("=") for a in d.get("adapters") or [])]
    return d


WHERE = {"tokenizer": "--model", "splits": "--split", "prompts": "--out", "generations": "--out"}


def _where(name: str) -> str:
    """The run's flag behind a stage option (an error in it names what the user typed)."""
    return WHERE.get(name, "--" + name.replace("_", "-"))


def _read_done(path: Path) -> dict[str, float]:
    """The stages ``stages.json`` lists as finished (none when it is missing); a damaged one is an error naming it
    (file:line), never a traceback: the run would otherwise redo or skip stages on a guess."""
    if not path.exists() and not path.is_symlink():
        return {}
    done = read_json(path)
    if not isinstance(done, dict) or not all(isinstance(k, str) and isinstance(v, (int, float))
                                             and not isinstance(v, bool) for k, v in done.items()):
        raise MLBenchError("stages.json is not an object of stage names and seconds", str(path),
                           "delete it to run every stage again (infer and eval resume from what they wrote)")
    return done


def stage_configs(cfg: RunConfig, out: Path) -> dict[str, Any]:
    """Each stage's typed config for a run into ``out`` (:func:`stage_options`), built and checked as that stage's
    command line would: a bad option raises here."""
    return {key: load_stage_config(stage(key.split(":")[0]), {k: v for k, v in opts.items() if v is not None},
                                   _where) for key, opts in stage_options(cfg, out).items()}


def run_all(cfg: RunConfig) -> int:
    """Run every stage not finished yet, print one summary; returns the exit status (a stage's own, when one
    fails; 130 when interrupted, 143 on SIGTERM)."""
    out = Path(str(cfg.out))
    # every stage's config built (and checked) before any work: a bad option fails now, not after inference
    configs = stage_configs(cfg, out)
    done_file = out / "stages.json"
    done: dict[str, float] = _read_done(done_file)  # a damaged one fails before anything is written
    out.mkdir(parents=True, exist_ok=True)
    claim_run_folder(out / "run.json", identity(cfg))
    save_resolved(cfg, out / "config.yaml")  # `mlbench run --config OUT/config.yaml` resumes the run
    current = ""
    # Ctrl-C (and the SIGTERM the CLI raises as Terminated) is noted before it is raised: a library may wrap the
    # KeyboardInterrupt it caught (transformers' lazy imports raise a RuntimeError naming it), and the run must
    # still say what was kept
    signals: list[int] = []

    def note(signum: int, frame: Any) -> None:
        signals.append(signum)
        if signum == signal.SIGTERM:
            raise_terminated(signum, frame)
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGINT, note)
    takes_term = signal.getsignal(signal.SIGTERM) is raise_terminated
    if takes_term:
        signal.signal(signal.SIGTERM, note)
    try:
        for key, stage_cfg in configs.items():
            current = key
            name = key.split(":")[0]
            shown = "eval {} task {}".format(*key.split(":")[1:]) if name == "eval" else key
            if key in done:
                print(f"run: {shown}: kept (finished in an earlier run)", file=sys.stderr)
                continue
            print(f"run: {shown} ...", file=sys.stderr)
            t0 = time.monotonic()
            rc = int(stage(name).entry_function()(stage_cfg))
            if signals:  # a signal the stage's libraries swallowed: the run stops, the stage is not taken as done
                raise Terminated if signal.SIGTERM in signals else KeyboardInterrupt
            if rc != 0:
                print(f"run: {shown} exited {rc}; fix what it said and re-run the same command (finished stages "
                      "are kept)", file=sys.stderr)
                return rc
            done[key] = round(time.monotonic() - t0, 1)
            write_json_atomic(done_file, done)
        current = "report"
        if "report" in done:
            print("run: report: kept (finished in an earlier run)", file=sys.stderr)
        else:
            print("run: report ...", file=sys.stderr)
            _report(cfg, out)
            done["report"] = 0.0
            write_json_atomic(done_file, done)
    except BaseException as exc:
        if not (isinstance(exc, KeyboardInterrupt) or signals):
            raise
        kept = ", ".join(k for k in done) or "nothing"
        term = isinstance(exc, Terminated) or signal.SIGTERM in signals
        print(f"\nrun: {'terminated (SIGTERM)' if term else 'interrupted'} during {current}; kept: {kept}. Re-run "
              "the same command to resume (the interrupted stage is redone from what it wrote)", file=sys.stderr)
        return 128 + signal.SIGTERM if term else 130
    finally:
        signal.signal(signal.SIGINT, previous)
        if takes_term and signal.SIGTERM not in signals:  # after one, a second stays ignored until the CLI returns
            signal.signal(signal.SIGTERM, raise_terminated)
    summary = summarize(cfg, out)
    write_json_atomic(out / "summary.json", summary)
    print_summary(summary)
    print(f"run: every file in {out}; the report: {out / 'report' / 'report.md'} (every row: "
          f"{out / 'report' / 'report.html'})", file=sys.stderr)
    return 0


def _report(cfg: RunConfig, out: Path) -> None:
    """``mlbench report`` over the run's eval folders (a model's tasks under one name)."""
    runs = [f"{name}={out / 'eval' / name / f'task{t}'}" for name in models(cfg) for t in cfg.tasks]
    reference = _config_file(cfg.reference, "--reference")
    report = stage("report").module()
    # through report's own options, so each of them (one added later included) has its default here too
    parser = argparse.ArgumentParser(prog="mlbench report")
    report.add_arguments(parser)
    args = parser.parse_args([*runs, "--out", str(out / "report"), *(["--reference", reference] if reference else [])])
    rc = int(report.run(args))
    if rc != 0:
        raise MLBenchError(f"report exited {rc}", str(out / "report"))


def summarize(cfg: RunConfig, out: Path) -> dict[str, Any]:
    """Each model's and task's overall metrics, read from its eval folder's ``summary.json``."""
    scores: dict[str, dict[str, Any]] = {}
    for name in models(cfg):
        for t in cfg.tasks:
            folder = out / "eval" / name / f"task{t}"
            overall = json.loads((folder / "summary.json").read_text())["metrics"]["overall"]
            scores.setdefault(name, {})[f"task{t}"] = overall
    return {"model": cfg.model, "data": cfg.data, "split": cfg.split, "mode": cfg.mode, "scores": scores}


def print_summary(summary: dict[str, Any]) -> None:
    """The run's one table on stdout: a row per model and task."""
    first = next(iter(next(iter(summary["scores"].values())).values()))
    ks = sorted(int(k.split("@")[1]) for k in first if k.startswith("pass@") and "_" not in k)
    head = f"{'model':<16}{'task':>5}{'samples':>8}" + "".join(f"{f'Pass@{k}':>9}" for k in ks) + \
        f"{'param hit':>11}{'type acc':>10}"
    print(f"{summary['mode']} mode, {summary['split']} split of {summary['data']}")
    print(head)
    for name, tasks in summary["scores"].items():
        for task, m in tasks.items():
            print(f"{name:<16}{task.removeprefix('task'):>5}{m['samples']:>8}"
                  + "".join(f"{m[f'pass@{k}']:>9.3f}" for k in ks)
                  + f"{m.get('param_hit_precision', 0.0):>11.3f}{m.get('type_accuracy', 0.0):>10.3f}")
