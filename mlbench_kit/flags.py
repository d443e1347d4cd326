"""Every stage's command-line options, generated from its declaration (:mod:`mlbench_kit.stages`): one option per
config field declared with ``flag=`` (:func:`mlbench_kit.config.option`, read by
:func:`mlbench_kit.config.cli_options`), plus ``--config FILE``, ``--set KEY=VALUE`` and the stage's non-config
flags (``Stage.extra``).

From a key's field the generator takes the option's spelling and aliases, its type (``int``, ``float``, ``str``; a
``Literal``'s values as its choices; a list as one or more values, repeatable; a bool as a switch, or its
``negated`` spelling that turns it off), its help (with the default the config gives it), its
``choices``/``metavar`` metadata, and its old names (hidden, with a warning). A config option's own default is
None, so an option not given leaves the ``--config`` file's value (the file wins over the defaults, a flag over the
file, ``--set`` over both).

    parser = argparse.ArgumentParser(prog="mlbench infer")
    add_options(parser, stage("infer"))
    cfg = resolve(stage("infer"), parser.parse_args(argv))      # an InferConfig
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal, Union

from .config import CliOption, cli_options, load, parse_set
from .deprecation import deprecated_flag
from .errors import MLBenchError
from .stages import Flag, Stage, config_fields, flag

SET_HELP = "any config key, dotted, its value read as YAML (e.g. {example}); repeatable; wins over the other flags"


def _unwrap(tp: Any) -> Any:
    """``X | None`` -> ``X``."""
    if typing.get_origin(tp) in (Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0] if len(args) == 1 else str
    return tp


def field_type(cls: type, key: str) -> Any:
    """The annotation of a dotted key of the config dataclass ``cls``, without ``| None``."""
    *parents, last = key.split(".")
    for part in parents:
        cls = _unwrap(typing.get_type_hints(cls)[part])
    return _unwrap(typing.get_type_hints(cls)[last])


def field_default(f: dataclasses.Field) -> Any:
    """A dataclass field's default value (its factory called)."""
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None if f.default is dataclasses.MISSING else f.default


def shown(value: Any) -> str:
    """A default as a user would type it: ``[1, 2, 3]`` -> ``1 2 3``, True -> ``on``."""
    if isinstance(value, list):
        return " ".join(map(str, value)) or "none"
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def option_help(st: Stage, name: str, key: str) -> str:
    """The help of the option ``name`` (setting ``key``): the field's help, the key when it is named otherwise,
    and the config's default (unless the help already says what the default is)."""
    cls = typing.cast(type, st.config_class())
    f = config_fields(cls)[key]
    text = f.metadata.get("help")
    if not text:
        raise MLBenchError(f"{st.config}: field {key!r} has no help", None,
                           'declare it with option(default, "what it is") (mlbench_kit.config.option)')
    if st.options()[name].negated:  # --no-hf: the help says what the switch does, not the key
        return negated_help(text, key)
    if key != name:
        text += f" ({key})"
    default = field_default(f)
    if "default" not in text and default not in (None, [], False) and st.default_config is None:
        text += f" (default {shown(default)})"
    return text


def negated_help(text: str, key: str) -> str:
    """The help of a negated switch (``--no-hf``) from its key's help: what giving it turns off."""
    return f"turns off: {text} (key {key}, on by default)"


def _config_option(parser: Any, st: Stage, opt: CliOption) -> None:
    cls = typing.cast(type, st.config_class())
    name, key = opt.name, opt.key
    f = config_fields(cls)[key]
    tp = field_type(cls, key)
    meta = f.metadata
    kw: dict[str, Any] = {"dest": name, "default": None, "help": option_help(st, name, key)}
    if meta.get("metavar"):
        kw["metavar"] = meta["metavar"]
    old_kw: dict[str, Any] = {}
    if tp is bool:
        if opt.negated:  # --no-hf: the switch that turns a default-on key off
            kw["action"] = "store_false"
        elif field_default(f) is False:
            kw["action"] = "store_true"
        else:  # on by default, or unset (None) by default: --x / --no-x
            kw["action"] = argparse.BooleanOptionalAction
    else:
        item, many = tp, typing.get_origin(tp) is list
        if many:
            (item,) = typing.get_args(tp) or (str,)
            kw["action"], kw["nargs"] = "extend", meta.get("nargs", "+")
            old_kw["nargs"] = kw["nargs"]
        if typing.get_origin(item) is Literal:
            kw["choices"] = typing.get_args(item)
            item = type(kw["choices"][0])
        if meta.get("choices"):
            kw["choices"] = tuple(meta["choices"])
        kw["type"] = old_kw["type"] = item if item in (int, float) else str
    parser.add_argument(opt.spelled, *opt.aliases, **kw)
    for old in opt.old:
        deprecated_flag(parser, old, flag(name), **old_kw)


def extra_option(parser: Any, f: Flag) -> None:
    """Add one option that sets no config key (a :class:`Flag` of a stage or of a stage's command)."""
    kw: dict[str, Any] = {"dest": f.name, "help": f.help, "default": f.default}
    if f.type is bool:
        kw["action"] = "store_true"
    else:
        kw["type"] = f.type
        for attr in ("nargs", "choices", "metavar"):
            if getattr(f, attr) is not None:
                kw[attr] = getattr(f, attr)
        if f.required:
            kw["required"] = True
    parser.add_argument(flag(f.name), **kw)


def add_options(parser: argparse.ArgumentParser, st: Stage) -> None:
    """Every option of the stage ``st`` on ``parser``: ``--config``, one per declared option, ``--set``, and the
    stage's extra (non-config) flags; the stage's ``one_of`` names are mutually exclusive."""
    groups: dict[str, Any] = {}
    for names, required in st.one_of:
        g = parser.add_mutually_exclusive_group(required=required)
        groups.update(dict.fromkeys(names, g))
    cls = st.config_class()
    if cls is not None:
        default = f"default {st.default_config}" if st.default_config else "default: none, the defaults shown here"
        parser.add_argument("--config", metavar="FILE", default=None,
                            help=f"YAML of {st.name}'s config keys, e.g. a shipped one (`mlbench configs ls "
                                 f"{st.name}`; {default}); the flags win over it")
        for name, opt in st.options().items():
            if typing.get_origin(field_type(cls, opt.key)) is dict:
                continue  # a mapping: through --set KEY.SUB=VALUE or the file
            _config_option(groups.get(name, parser), st, opt)
        parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                            help=SET_HELP.format(example=set_example(cls)))
        parser.add_argument("--check", action="store_true",
                            help="validate the config (file, flags, --set) and print it resolved, without running")
    for f in st.extra:
        extra_option(groups.get(f.name, parser), f)


def set_example(cls: type) -> str:
    """``--set KEY=VALUE`` with a real key of ``cls`` (a nested one if it has any) and its default."""
    keys = [(k, f) for k, f in config_fields(cls).items() if not dataclasses.is_dataclass(field_default(f))]
    key, f = next(((k, f) for k, f in keys if "." in k), keys[0])
    return f"--set {key}={shown(field_default(f)).replace(' ', ',')}"


def args_overrides(cls: type, args: Any) -> dict[str, tuple[Any, str]]:
    """The parsed flags (``args``) that set keys of ``cls`` (its declared options), then ``--set``, as overrides
    whose origin is the flag."""
    over = {o.key: (getattr(args, name), o.spelled) for name, o in cli_options(cls).items()
            if getattr(args, name, None) is not None}
    return over | parse_set(getattr(args, "set", None) or [])


def config_path(st: Stage, args: Any) -> Path | None:
    """The config file a run reads: ``--config``, else the stage's default config (in the working folder, else
    beside this checkout's code), else none."""
    if getattr(args, "config", None):
        return Path(args.config)
    if st.default_config is None:
        return None
    own_model = getattr(args, "model", None) or any(s.startswith("model=") for s in getattr(args, "set", None) or [])
    if st.cpu_config is not None and not own_model and not _has_cuda():  # the default's 7B model on a CPU
        raise MLBenchError(f"no --config: {st.name}'s default ({st.default_config}) trains a 7B model on a GPU, and "
                           "this machine has none (torch sees no CUDA device)", "--config",
                           f"on a CPU, pass --config {st.cpu_config} with --model DIR (`mlbench configs ls "
                           f"{st.name}` lists the others)")
    here = Path(st.default_config)
    return here if here.is_file() else Path(__file__).resolve().parents[1] / st.default_config


def check_config(st: Stage, args: Any) -> int:
    """``mlbench STAGE --config F --check``: the config resolved and checked as a run would (every mistake the
    same one error), printed as YAML, and nothing run."""
    import yaml

    from .config import to_dict
    cfg = resolve(st, args)
    if hasattr(cfg, "require_inputs"):
        cfg.require_inputs(getattr(args, "config", None))
    if hasattr(cfg, "check_stages"):  # a config that chains stages (mlbench run): each stage's config too
        cfg.check_stages()
    print(yaml.safe_dump(to_dict(cfg), sort_keys=False), end="")
    path = config_path(st, args)
    print(f"{st.name}: config OK ({path or 'the defaults'} with the flags given); nothing was run", file=sys.stderr)
    return 0


def _has_cuda() -> bool:
    """Whether torch sees a CUDA device (torch imported only here: the one stage that asks trains with it)."""
    import torch
    return bool(torch.cuda.is_available())


def resolve(st: Stage, args: Any) -> Any:
    """The stage's typed config for parsed options ``args``: the ``--config`` file (else the stage's default, else
    the config's defaults), then the flags, then ``--set``."""
    cls = st.config_class()
    if cls is None:
        raise MLBenchError(f"{st.name} has no typed config", None)
    path = config_path(st, args)
    if path is not None and not path.is_file():
        raise MLBenchError("config file not found", str(path),
                           f"check the path; `mlbench configs ls {st.name}` lists the shipped ones")
    return load(cls, path, args_overrides(cls, args), user_overrides=True)
