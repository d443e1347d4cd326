"""The stages, declared once: name, help, typed config and entry. ``mlbench`` builds its sub-commands from this
table and ``mlbench sweep`` checks a cell's stage options against the same configs.

Entries and configs are named by dotted path (``module`` or ``module:Name``), as torchtune's recipe registry
does, so the core imports no stage (``tests/core/test_layout.py`` checks it): a stage's module is imported only
when that stage runs.

A stage with a typed config declares its options on the config's fields, each once
(:func:`mlbench_kit.config.option`): its help, whether it is an option and how it is spelled (``flag=``), its other
spellings (``alias=``), a negated switch (``negated="--no-hf"``) and its old names (``old=``), which
:func:`mlbench_kit.config.cli_options` reads. Options that set no key are :class:`Flag` rows of the stage. The
command line (:mod:`mlbench_kit.flags` generates it) and a sweep file's stage section use the same names. The
entry module has ``run(args) -> int`` (``mlbench_kit.flags.resolve(stage, args)`` gives its config); a stage
without a config has ``add_arguments(parser)`` too.
"""

from __future__ import annotations

import dataclasses
import importlib
import typing
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from .config import CliOption, cli_options, load, option_name, parse_set, spelling
from .deprecation import warn_renamed
from .errors import MLBenchError


@dataclass(frozen=True)
class Flag:
    """A command-line option of a stage that sets no config key (train's ``--resume``)."""

    name: str  # repos_dir: --repos-dir, args.repos_dir
    help: str
    type: Any = str  # bool: a switch
    default: Any = None
    nargs: str | None = None
    choices: tuple[Any, ...] | None = None
    metavar: str | None = None
    required: bool = False


@dataclass(frozen=True)
class Command:
    """A sub-command of a stage (``mlbench agent show RUN``): a tool over the stage's outputs, not a run of it."""

    name: str
    help: str
    entry: str  # "module:function", called with the parsed arguments; returns the exit status
    positionals: tuple[tuple[str, str], ...] = ()  # (name, help), in order
    options: tuple[Flag, ...] = ()

    def function(self) -> typing.Callable[[Any], int]:
        """The command's entry function (its module imported now)."""
        module, _, name = self.entry.partition(":")
        return typing.cast(typing.Callable[[Any], int], getattr(importlib.import_module(module), name))


@dataclass(frozen=True)
class Stage:
    """One stage of the toolkit."""

    name: str
    help: str
    entry: str  # module with run(args) (and add_arguments(parser) when the stage has no config)
    config: str | None = None  # "module:Class": the stage's typed options (None: the stage takes flags only)
    extra: tuple[Flag, ...] = ()  # options that set no config key
    one_of: tuple[tuple[tuple[str, ...], bool], ...] = ()  # (options, required): at most (exactly) one of them
    default_config: str | None = None  # the config file read without --config (relative to the checkout)
    cpu_config: str | None = None  # the one to name instead when default_config needs a GPU and there is none
    commands: tuple[Command, ...] = ()  # `mlbench STAGE COMMAND ...`: tools over the stage's outputs
    call: str | None = None  # "module:function" taking the stage's typed config (what `mlbench run` chains)
    # SIGTERM (kill, scancel, a job's time limit) is raised as an interrupt, so the stage's `finally` blocks close
    # its engines and sandboxes and what it wrote is kept; False: the stage handles it itself (train saves a
    # checkpoint on it, and its launchers and learn's child stages must get it, not be killed by an exception)
    sigterm_interrupts: bool = True

    def module(self) -> ModuleType:
        """The stage's entry module (imported now: the first time the stage is needed)."""
        return importlib.import_module(self.entry)

    def config_class(self) -> type | None:
        """The stage's config dataclass, or None."""
        if self.config is None:
            return None
        module, _, name = self.config.partition(":")
        return typing.cast(type, getattr(importlib.import_module(module), name))

    def entry_function(self) -> typing.Callable[..., int]:
        """The stage's entry on a resolved config (``call``: prep's ``prepare(cfg)``, eval's ``score(cfg)``)."""
        if self.call is None:
            raise MLBenchError(f"{self.name} has no entry on a config", None)
        module, _, name = self.call.partition(":")
        return typing.cast(typing.Callable[..., int], getattr(importlib.import_module(module), name))

    def flags(self) -> dict[str, str]:
        """Option name (``max_new_tokens``) -> the config key it sets (``sampling.max_new_tokens``)."""
        return {name: o.key for name, o in self.options().items()}

    def options(self) -> dict[str, CliOption]:
        """The options its config's fields declare, by name (none without a config)."""
        cls = self.config_class()
        return cli_options(cls) if cls is not None else {}


STAGES: tuple[Stage, ...] = (
    Stage("run", "one command from a model to a score: prep -> infer -> eval -> report in one folder, resumable",
          "mlbench_kit.pipeline", "mlbench_kit.run_config:RunConfig"),
    Stage("prep", "render tasks 1-3 into prompts", "mlbench_kit.data_prep.prepare",
          "mlbench_kit.prep_config:PrepConfig", call="mlbench_kit.data_prep.prepare:prepare"),
    Stage("train", "LoRA/QLoRA fine-tuning: one process, or several through accelerate's launcher (--nproc, "
          "--accelerate-config; or accelerate launch train/lora.py)",
          "mlbench_kit.train.cli", "mlbench_kit.train_config:TrainConfig",
          extra=(Flag("resume", "auto (newest complete checkpoint, default), none, or a path", default="auto"),
                 Flag("nproc", "processes to launch through accelerate's launcher, e.g. one per GPU (wins over "
                      "--accelerate-config's num_processes); default: train in this one process", type=int),
                 Flag("accelerate_config", "accelerate config to launch with (configs/accelerate/*.yaml: DDP, "
                      "FSDP2, DeepSpeed ZeRO-2/3)", metavar="FILE")),
          default_config="configs/train/codellama-7b-instruct.yaml",  # the paper's main open model (the card's)
          cpu_config="configs/train/tiny-cpu.yaml", sigterm_interrupts=False),
    Stage("infer", "sample n responses per prompt (vLLM, HF or an OpenAI-compatible endpoint)",
          "mlbench_kit.infer.run", "mlbench_kit.infer_config:InferConfig", call="mlbench_kit.infer.run:infer"),
    Stage("agent", "agent episodes per row (ML-Agent, or bash actions in the sandbox) -> generations to score",
          "mlbench_kit.agent.run", "mlbench_kit.agent_config:AgentConfig",
          one_of=((("repos_dir", "tarballs"), False),),  # one of them is required: AgentConfig.require_inputs
          commands=(Command("show", "render one episode of an agent run in the terminal: each turn's messages, the "
                            "reply, what the harness did, the end", "mlbench_kit.agent.show:run",
                            positionals=(("run", "the agent run's folder (its --out)"),),
                            options=(Flag("row", "the row: ID or GITHUB_ID-ID (default: the run's first)",
                                          metavar="ID"),
                                     Flag("episode", "the episode, from 0", type=int, default=0, metavar="K"),
                                     Flag("full", "every message whole (default: each cut to 4,000 characters, "
                                          "head and tail)", type=bool, default=False))),)),
    Stage("eval", "execute generations in a sandbox and score them", "mlbench_kit.eval.run",
          "mlbench_kit.eval_config:EvalConfig", one_of=((("generations", "gold"), False),),
          call="mlbench_kit.eval.run:score"),
    Stage("learn", "learn from execution verdicts: SFT records and pairs from verdicts (data), rejection-sampling "
          "fine-tuning (rft), DPO, GRPO with sandboxed execution rewards",
          "mlbench_kit.learn.run", "mlbench_kit.learn_config:LearnConfig", sigterm_interrupts=False),
    Stage("report", "eval runs side by side: markdown, CSV, PNG", "mlbench_kit.eval.report.cli"),
    Stage("env", "build, check and gold-validate the repositories' execution environments", "mlbench_kit.eval.envcli"),
    Stage("sweep", "plan, submit and follow a Slurm sweep (train -> infer -> eval -> report)",
          "mlbench_kit.slurm.sweep"),
)


def stage(name: str) -> Stage:
    """The stage called ``name``; an unknown name is an error listing the stages."""
    for s in STAGES:
        if s.name == name:
            return s
    raise MLBenchError(f"unknown stage {name!r}", None, f"stages: {', '.join(s.name for s in STAGES)}")


flag = spelling  # an option's command-line spelling: max_new_tokens -> --max-new-tokens


def option_overrides(st: Stage, options: dict[str, Any], where: typing.Callable[[str], str]
                     ) -> dict[str, tuple[Any, str]]:
    """Stage options written in a file (a sweep's stage section: ``{max_new_tokens: 512, set: [lora.r=64]}``) as
    the config's dotted overrides, each located by ``where(option)``. An option the stage does not have is an
    error at its line."""
    opts = st.options()
    flags = st.flags()
    renamed = {option_name(o): name for name, opt in opts.items() for o in opt.old}
    aliases = {option_name(a): name for name, opt in opts.items() for a in opt.aliases}
    negated = {option_name(opt.spelled): name for name, opt in opts.items() if opt.negated}
    out: dict[str, tuple[Any, str]] = {}
    for old, value in options.items():
        name = aliases.get(old, old)
        if name in renamed:
            warn_renamed(flag(name), flag(renamed[name]), where(name))
            if renamed[name] in options:
                raise MLBenchError(f"{name} and {renamed[name]} are both set ({name} is the old name)", where(name),
                                   f"keep only {renamed[name]}")
            name = renamed[name]
        if name == "set":
            for k, (v, _) in parse_set(value if isinstance(value, list) else [value]).items():
                out[k] = (v, where(old))
        elif name in negated:  # `no_hf: true` is --no-hf, which sets hf: false
            if not isinstance(value, bool):
                raise MLBenchError(f"{name} is true or false, got {value!r}", where(old))
            out[flags[negated[name]]] = (not value, where(old))
        elif name in flags:
            out[flags[name]] = (value, where(old))
        elif name != "config":
            known = sorted({n for n in flags if n not in negated.values()} | set(negated) | {"set"})
            raise MLBenchError(f"{st.name} has no option {name!r}", where(old), f"its options: {', '.join(known)} "
                               f"(`mlbench {st.name} --help`)")
    return out


def load_stage_config(st: Stage, options: dict[str, Any], where: typing.Callable[[str], str],
                      root: Path | None = None, default_config: str | Path | None = None) -> Any:
    """The stage's typed config from options written in a file (``config:`` names its YAML, relative to ``root``),
    as the stage itself would resolve them; every mistake is one error at the option's (or the YAML's) line."""
    cls = st.config_class()
    if cls is None:
        raise MLBenchError(f"{st.name} has no typed config", None)
    over = option_overrides(st, options, where)
    path = options.get("config") or default_config
    if path is not None:
        p = Path(path)
        if root is not None and not p.is_absolute():
            p = root / p
        if not p.is_file():
            raise MLBenchError(f"{st.name} config not found: {path}", where("config"),
                               f"check the path (relative to {root or 'here'})")
        return load(cls, p, over)
    return load(cls, None, over)


def config_fields(cls: type, prefix: str = "") -> dict[str, dataclasses.Field]:
    """Every dotted key of a config dataclass and its field (nested sections walked)."""
    out: dict[str, dataclasses.Field] = {}
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        key = prefix + f.name
        out[key] = f
        if dataclasses.is_dataclass(hints[f.name]):
            out.update(config_fields(hints[f.name], key + "."))
    return out
