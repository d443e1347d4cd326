"""One typed configuration path for every stage: YAML -> dataclasses, every mistake with its file:line.

    cfg = load(TrainConfig, "configs/train/tiny-cpu.yaml", {"data.task": (3, "--task")})

Each config is a tree of dataclasses with defaults. :func:`load` reads the YAML file (remembering where each key
is), applies dotted overrides (each with its own origin, e.g. ``--task`` or ``--set``), and builds the tree: an
unknown key, or a value of the wrong type or outside a ``Literal``, is one :class:`MLBenchError` naming the file
and line (or the flag). A dataclass may define ``check(self, at)`` for rules across fields; ``at("data.task")``
gives the location of that key for its error.

Each field is declared once, with every fact of its option (:func:`option`): its help, its command-line spelling
and aliases (read by :mod:`mlbench_kit.flags` and a sweep's stage sections, :func:`cli_options`), and the names it
had before. A renamed field (``option(8192, "...", old=("max_seq_len",))``) keeps its old names for one release
(:mod:`mlbench_kit.deprecation`): the old key, in the file or in an override, loads as the new one with one warning
naming the new name and the old key's file:line; both names at once are an error.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import re
import types
import typing
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, TypeVar, Union

import yaml

from .deprecation import warn_renamed
from .errors import MLBenchError

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")


MAX_NODES = 100_000  # a config's nodes with every alias expanded (configs hold hundreds; a 406-byte "billion
#                      laughs" expands to 10^9 and took 36 s and 3.7 GB before it was refused)


def _bounded(root: Any, source: str) -> None:
    """Refuse YAML whose aliases expand beyond :data:`MAX_NODES` nodes. Counted on the composed graph, where an
    alias is a shared node: linear in the file, whatever the expansion."""
    size: dict[int, int] = {}
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        if id(node) in size:
            continue
        kids = ([c for kv in node.value for c in kv] if isinstance(node, yaml.MappingNode)
                else list(node.value) if isinstance(node, yaml.SequenceNode) else [])
        if done:
            size[id(node)] = 1 + sum(size.get(id(c), 0) for c in kids)
            if size[id(node)] > MAX_NODES:
                raise MLBenchError(f"YAML that expands to more than {MAX_NODES} nodes through its aliases (*name)",
                                   f"{source}:{node.start_mark.line + 1}", "write the values out; aliases may "
                                   "repeat a value, not multiply a document") from None
            continue
        stack.append((node, True))
        stack.extend((c, False) for c in kids if id(c) not in size)


class Lines:
    """Where each key of a YAML file is: dotted path -> ``file:line``."""

    def __init__(self, source: str, text: str | None = None) -> None:
        self.source = source
        self.lines: dict[tuple[str, ...], str] = {}
        self.given: set[tuple[str, ...]] = set()  # keys the user gave on the command line (load's user_overrides)
        if text:
            try:
                root = yaml.compose(text)
                if root is not None:
                    self.lines[()] = f"{source}:{root.start_mark.line + 1}"
                    _bounded(root, source)
                self._walk(root, ())
            except yaml.YAMLError as exc:
                mark = getattr(exc, "problem_mark", None)
                raise MLBenchError(f"bad YAML: {getattr(exc, 'problem', exc)}",
                                   f"{source}:{mark.line + 1}" if mark else source) from None

    def _walk(self, node: Any, path: tuple[str, ...]) -> None:
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                if k.tag == "tag:yaml.org,2002:merge":  # `<<:` would hide where a key came from (the endpoint rule)
                    raise MLBenchError("YAML merge keys (<<) are not accepted in a config file",
                                       f"{self.source}:{k.start_mark.line + 1}", "write the keys out in full")
                self.lines[path + (str(k.value),)] = f"{self.source}:{k.start_mark.line + 1}"
                self._walk(v, path + (str(k.value),))
        elif isinstance(node, yaml.SequenceNode):
            for i, v in enumerate(node.value):
                self.lines[path + (str(i),)] = f"{self.source}:{v.start_mark.line + 1}"
                self._walk(v, path + (str(i),))

    def at(self, dotted: str | tuple[str, ...]) -> str:
        """The location of ``dotted`` (or of its nearest enclosing key)."""
        path = tuple(dotted.split(".")) if isinstance(dotted, str) else dotted
        for n in range(len(path), 0, -1):
            if path[:n] in self.lines:
                return self.lines[path[:n]]
        return self.lines.get((), self.source)


def read_yaml(path: str | Path) -> tuple[dict[str, Any], Lines]:
    """A YAML mapping and the lines of its keys; a missing file or a non-mapping is an error."""
    p = Path(path)
    if not p.is_file():
        raise MLBenchError("config file not found", str(p), "check the path")
    text = p.read_text()
    lines = Lines(str(p), text)
    raw = yaml.safe_load(text) or {}
    if not isinstance(raw, dict):
        raise MLBenchError("a config file is a YAML mapping", str(p))
    return raw, lines


def _set(raw: dict[str, Any], dotted: str, value: Any) -> None:
    node = raw
    *parents, last = dotted.split(".")
    for k in parents:
        node = node.setdefault(k, {})
        if not isinstance(node, dict):
            raise MLBenchError(f"{dotted}: {k} is not a mapping", dotted)
    node[last] = value


def load(cls: type[T], path: str | Path | None = None, overrides: dict[str, tuple[Any, str]] | None = None,
         raw: dict[str, Any] | None = None, lines: Lines | None = None, user_overrides: bool = False) -> T:
    """Build ``cls`` from a YAML file (or an already read mapping) plus ``{dotted key: (value, origin)}``;
    ``user_overrides``: those came from the user's command line, not from a file (a sweep's), which
    :meth:`At.from_file` tells ``check`` apart."""
    if raw is None:
        raw, lines = read_yaml(path) if path is not None else ({}, Lines("defaults"))
    lines = lines or Lines(str(path or "defaults"))
    rename_old_keys(cls, raw, lines)
    for dotted, (value, origin) in (overrides or {}).items():
        if value is None:
            continue
        dotted = _new_name(cls, dotted, origin)
        _set(raw, dotted, value)
        lines.lines[tuple(dotted.split("."))] = origin
        if user_overrides:
            lines.given.add(tuple(dotted.split(".")))
    obj = build(cls, raw, lines)
    _check(obj, lines, ())
    return obj


def _nested(tp: Any) -> tuple[Any, bool]:
    """The dataclass inside an annotation (``X``, ``X | None``, ``dict[str, X]``), and whether it is a dict's."""
    if dataclasses.is_dataclass(tp):
        return tp, False
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (Union, types.UnionType):
        found = [a for a in args if dataclasses.is_dataclass(a)]
        return (found[0], False) if len(found) == 1 else (None, False)
    if origin is dict and len(args) == 2 and dataclasses.is_dataclass(args[1]):
        return args[1], True
    return None, False


def rename_old_keys(cls: Any, raw: Any, lines: Lines | None = None, path: tuple[str, ...] = ()) -> None:
    """Old names of renamed fields (their ``old`` keys, :func:`option`) in ``raw`` become the new ones, in place. With
    ``lines`` (a config being loaded) each is one warning with its file:line; without, silently (a record written
    before the rename, read back)."""
    if not isinstance(raw, dict) or not dataclasses.is_dataclass(cls):
        return
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        for old in old_keys(f):
            if old not in raw:
                continue
            old_name, new_name = ".".join(path + (old,)), ".".join(path + (f.name,))
            if lines is not None:
                where = lines.at(path + (old,))
                if f.name in raw:
                    raise MLBenchError(f"{old_name} and {new_name} are both set ({old} is the old name of "
                                       f"{f.name})", where, f"keep only {new_name}")
                warn_renamed(old_name, new_name, where)
                for key in [k for k in lines.lines if k[:len(path) + 1] == path + (old,)]:
                    lines.lines[path + (f.name,) + key[len(path) + 1:]] = lines.lines[key]
            value = raw.pop(old)
            raw.setdefault(f.name, value)  # a record holding both (never written so): the new name's value
        inner, is_dict = _nested(hints.get(f.name))
        value = raw.get(f.name)
        if inner is not None and isinstance(value, dict):
            for k, v in (value.items() if is_dict else [(None, value)]):
                rename_old_keys(inner, v, lines, path + ((f.name, str(k)) if is_dict else (f.name,)))


def _new_name(cls: Any, dotted: str, origin: str) -> str:
    """An override's dotted key with old field names replaced by the new ones (one warning each)."""
    parts, tp = dotted.split("."), cls
    i = 0
    while i < len(parts) and dataclasses.is_dataclass(tp):
        fields = {f.name: f for f in dataclasses.fields(tp)}
        renamed = {old: f.name for f in fields.values() for old in old_keys(f)}
        if parts[i] in renamed and parts[i] not in fields:
            new = parts[:i] + [renamed[parts[i]]]
            warn_renamed(".".join(parts[:i + 1]), ".".join(new), origin)
            parts[i] = renamed[parts[i]]
        if parts[i] not in fields:
            break
        tp, is_dict = _nested(typing.get_type_hints(tp).get(parts[i]))
        i += 2 if is_dict else 1
    return ".".join(parts)


def with_old_names(cls: Any, data: dict[str, Any]) -> dict[str, Any]:
    """``data`` (as :func:`to_dict` gives it) with each renamed field under its old name again: what the same
    config looked like before the rename (to recognise what an older run recorded)."""
    out = dict(data)
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        before = old_keys(f)
        inner, is_dict = _nested(hints.get(f.name))
        value = out.get(f.name)
        if inner is not None and isinstance(value, dict):
            value = ({k: with_old_names(inner, v) if isinstance(v, dict) else v for k, v in value.items()}
                     if is_dict else with_old_names(inner, value))
        if f.name in out:
            out.pop(f.name)
            out[before[0] if before else f.name] = value
    return out


def _check(obj: Any, lines: Lines, path: tuple[str, ...]) -> None:
    if not dataclasses.is_dataclass(obj):
        return
    for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if dataclasses.is_dataclass(v):
            _check(v, lines, path + (f.name,))
        elif isinstance(v, dict):
            for k, item in v.items():
                _check(item, lines, path + (f.name, str(k)))
        elif isinstance(v, list):
            for i, item in enumerate(v):
                _check(item, lines, path + (f.name, str(i)))
    if hasattr(obj, "check"):
        obj.check(At(lines, path))


def build(cls: type[T], raw: Any, lines: Lines, path: tuple[str, ...] = ()) -> T:
    """``raw`` (nested mappings) as an instance of the dataclass ``cls``, checked field by field."""
    here = ".".join(path) or "the file"
    if not isinstance(raw, dict):
        raise MLBenchError(f"{here} must be a mapping, got {type(raw).__name__}", lines.at(path))
    hints = _hints(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    for k in raw:
        if k not in names:
            close = difflib.get_close_matches(str(k), sorted(names), n=1, cutoff=0.6)
            raise MLBenchError(f"unknown key {'.'.join(path + (str(k),))!r}", lines.at(path + (str(k),)),
                               (f"did you mean {'.'.join(path + (close[0],))!r}? " if close else "")
                               + f"known keys here: {sorted(names)}")
    required = [f.name for f in dataclasses.fields(cls)
                if f.init and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    for k in required:
        if k not in raw:
            raise MLBenchError(f"missing key {'.'.join(path + (k,))!r}", lines.at(path), f"add `{k}:`")
    kwargs = {k: _value(hints[k], v, lines, path + (k,)) for k, v in raw.items()}
    return cls(**kwargs)


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    """A dataclass's field types, evaluated once (a JSONL file of records builds one per line)."""
    return typing.get_type_hints(cls)


def _describe(tp: Any) -> str:
    origin = typing.get_origin(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " or ".join(_describe(a) for a in typing.get_args(tp))
    if tp is type(None):
        return "null"
    if origin in (list, tuple):
        return "a list"
    if origin is dict or dataclasses.is_dataclass(tp):
        return "a mapping"
    return getattr(tp, "__name__", str(tp))


def _value(tp: Any, v: Any, lines: Lines, path: tuple[str, ...]) -> Any:
    """``v`` checked (and built) against the annotation ``tp``."""
    def bad() -> MLBenchError:
        return MLBenchError(f"{'.'.join(path)} must be {_describe(tp)}, got {v!r}", lines.at(path))

    origin = typing.get_origin(tp)
    if tp is Any:
        return v
    if origin in (Union, types.UnionType):
        if v is None and type(None) in typing.get_args(tp):
            return None
        for arg in typing.get_args(tp):
            if arg is type(None):
                continue
            try:
                return _value(arg, v, lines, path)
            except MLBenchError as exc:
                if isinstance(v, dict) and dataclasses.is_dataclass(arg):
                    raise exc  # a mapping meant as this section: its own error says which key is wrong
                continue
        raise bad()
    if origin is Literal:
        if any(v == a and type(v) is type(a) for a in typing.get_args(tp)):
            return v
        raise bad()
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        return build(tp, v, lines, path)
    if origin is list:
        if not isinstance(v, list):
            raise bad()
        (item,) = typing.get_args(tp) or (Any,)
        return [_value(item, x, lines, path + (str(i),)) for i, x in enumerate(v)]
    if origin is dict:
        if not isinstance(v, dict):
            raise bad()
        _, item = typing.get_args(tp) or (Any, Any)
        return {k: _value(item, x, lines, path + (str(k),)) for k, x in v.items()}
    if tp is float:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise bad()
        return float(v)
    if tp is int:
        if isinstance(v, bool) or not isinstance(v, int):
            raise bad()
        return v
    if tp in (str, bool):
        if not isinstance(v, tp):
            raise bad()
        return v
    return v


def parse_set(items: list[str], flag: str = "--set") -> dict[str, tuple[Any, str]]:
    """``--set a.b=value`` flags (values read as YAML) as overrides."""
    out: dict[str, tuple[Any, str]] = {}
    for item in items or []:
        if "=" not in item:
            raise MLBenchError(f"{flag} needs key=value, got {item!r}", flag)
        k, v = item.split("=", 1)
        out[k.strip()] = (yaml.safe_load(v), f"{flag} {item}")
    return out


def to_dict(obj: Any) -> dict[str, Any]:
    """A config as plain data (for saving beside a run, or comparing with the one a folder was made with)."""
    return dataclasses.asdict(obj)


class At:
    """What ``check(self, at)`` receives: ``at("data.task")`` is that key's location (file:line, or the flag);
    ``at.from_file("openai.base_url")`` whether a file set it (the config's or a sweep's), not the command line."""

    def __init__(self, lines: Lines, path: tuple[str, ...]) -> None:
        self.lines, self.path = lines, path

    def __call__(self, key: str) -> str:
        return self.lines.at(self.path + tuple(key.split(".")))

    def from_file(self, key: str) -> bool:
        full = self.path + tuple(key.split("."))
        if any(full[:n] in self.lines.given for n in range(1, len(full) + 1)):
            return False
        return any(full[:n] in self.lines.lines for n in range(len(self.path) + 1, len(full) + 1))


Check = At  # the type of ``check``'s argument


OPTION = "mlbench_option"  # the key of a field's metadata that holds its :class:`Facts`
_FLAG = re.compile(r"--[a-z0-9]+(-[a-z0-9]+)*")


@dataclasses.dataclass(frozen=True)
class Facts:
    """What :func:`option` was told about a field's option (its spelling, old names, aliases)."""

    flag: bool | str = False
    old: tuple[str, ...] = ()
    alias: tuple[str, ...] = ()
    negated: str | None = None


def option(default: Any = dataclasses.MISSING, help: str = "", *, factory: Callable[[], Any] | None = None,
           flag: bool | str = False, old: tuple[str, ...] = (), alias: tuple[str, ...] = (),
           negated: str | None = None, **meta: Any) -> Any:
    """A config field with every fact of its option, declared once::

        task: int = option(3, "the task", flag="--tasks", alias=("--task",), choices=TASKS)

    ``help`` is what ``--help`` shows; ``factory`` gives a list's default. ``flag``: the field is a command-line
    option (and a sweep section's key) of every stage whose config holds it: True names it after the field
    (``max_new_tokens`` -> ``--max-new-tokens``), a string spells it (``--out``). ``alias``: other spellings of
    the same option. ``negated``: the option is the switch that turns a default-on field off (``--no-hf``).
    ``old``: names it had before, each working for one release with a warning (:mod:`mlbench_kit.deprecation`): a
    bare name (``max_seq_len``) is an old key of the field in files and overrides and, when the field is an
    option, an old flag too (``--max-seq-len``); a ``--`` name is an old flag only (``--output-dir``). ``meta``:
    the option's ``choices``, ``metavar`` or ``nargs`` where the type does not say them."""
    for spelled in (*alias, *([flag] if isinstance(flag, str) else []), *([negated] if negated else []),
                    *(o for o in old if o.startswith("-"))):
        if not _FLAG.fullmatch(spelled):
            raise ValueError(f"option spelling {spelled!r}: --lowercase-words")
    if (alias or any(o.startswith("-") for o in old)) and not (flag or negated):
        raise ValueError("aliases and old flags belong to an option: pass flag= too")
    metadata = {"help": help, **meta, OPTION: Facts(flag, tuple(old), tuple(alias), negated)}
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=metadata)
    return dataclasses.field(default=default, metadata=metadata)


def old_keys(f: dataclasses.Field) -> tuple[str, ...]:
    """The field's old names as a config key (``old`` entries that are not flags)."""
    facts = f.metadata.get(OPTION)
    return tuple(o for o in facts.old if not o.startswith("-")) if facts else ()


def spelling(name: str) -> str:
    """An option's command-line spelling: ``max_new_tokens`` -> ``--max-new-tokens``."""
    return "--" + name.replace("_", "-")


def option_name(spelled: str) -> str:
    """An option's name (its ``args`` attribute and its key in a sweep file's stage section): ``--no-hf`` ->
    ``no_hf``."""
    return spelled.lstrip("-").replace("-", "_")


@dataclasses.dataclass(frozen=True)
class CliOption:
    """One command-line option of a config, as its field declares it."""

    name: str  # args.<name>; a sweep section's key (max_new_tokens)
    key: str  # the dotted config key it sets (sampling.max_new_tokens)
    spelled: str  # --max-new-tokens; a negated switch's --no-hf (which sets hf: false)
    aliases: tuple[str, ...] = ()  # other spellings (--task)
    old: tuple[str, ...] = ()  # old spellings, hidden and warned (--max-tokens)
    negated: bool = False


@functools.cache
def cli_options(cls: type) -> dict[str, CliOption]:
    """The options a config dataclass declares (its fields' ``flag=``), by name: the top level's fields first,
    then each section's, in field order. Two options of one name, or an option whose spelling another one
    already has, is an error in the declaration."""
    out: dict[str, CliOption] = {}
    seen: dict[str, str] = {}
    queue: list[tuple[type, str]] = [(cls, "")]
    while queue:
        tp, prefix = queue.pop(0)
        hints = typing.get_type_hints(tp)
        for f in dataclasses.fields(tp):
            if dataclasses.is_dataclass(hints[f.name]):
                queue.append((hints[f.name], prefix + f.name + "."))
                continue
            facts = f.metadata.get(OPTION)
            if facts is None or not (facts.flag or facts.negated):
                continue
            key = prefix + f.name
            spelled = facts.negated or (facts.flag if isinstance(facts.flag, str) else spelling(f.name))
            name = f.name if facts.negated else option_name(spelled)
            old = tuple(o if o.startswith("-") else spelling(o) for o in facts.old)
            opt = CliOption(name, key, spelled, facts.alias, old, bool(facts.negated))
            for s in (spelled, *opt.aliases, *opt.old):
                other = seen.get(s) or (out[name].key if name in out else None)
                if other is not None:
                    raise ValueError(f"{cls.__name__}: option {s} of {key} is also {other}'s")
                seen[s] = key
            out[name] = opt
    return out


def save_resolved(cfg: Any, path: Path) -> None:
    """A stage's resolved config beside its outputs (written atomically, under the umask): ``mlbench STAGE --config
    path`` replays the run."""
    from .io import write_atomic
    write_atomic(path, yaml.safe_dump(to_dict(cfg), sort_keys=False))
