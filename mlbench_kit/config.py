"""One typed configuration path for every stage: YAML -> dataclasses, every mistake with its file:line.

    cfg = load(TrainConfig, "configs/train/tiny-cpu.yaml", {"data.task": (3, "--task")})

Each config is a tree of dataclasses with defaults. :func:`load` reads the YAML file (remembering where each key
is), applies dotted overrides (each with its own origin, e.g. ``--task`` or ``--set``), and builds the tree: an
unknown key, or a value of the wrong type or outside a ``Literal``, is one :class:`MLBenchError` naming the file
and line (or the flag). A dataclass may define ``check(self, at)`` for rules across fields; ``at("data.task")``
gives the location of that key for its error.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from pathlib import Path
from typing import Any, Callable, Literal, TypeVar, Union

import yaml

from .errors import MLBenchError

T = TypeVar("T")


class Lines:
    """Where each key of a YAML file is: dotted path -> ``file:line``."""

    def __init__(self, source: str, text: str | None = None) -> None:
        self.source, self.lines = source, {}
        if text:
            try:
                root = yaml.compose(text)
                if root is not None:
                    self.lines[()] = f"{source}:{root.start_mark.line + 1}"
                self._walk(root, ())
            except yaml.YAMLError as exc:
                mark = getattr(exc, "problem_mark", None)
                raise MLBenchError(f"bad YAML: {getattr(exc, 'problem', exc)}",
                                   f"{source}:{mark.line + 1}" if mark else source) from None

    def _walk(self, node: Any, path: tuple[str, ...]) -> None:
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
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
         raw: dict[str, Any] | None = None, lines: Lines | None = None) -> T:
    """Build ``cls`` from a YAML file (or an already read mapping) plus ``{dotted key: (value, origin)}``."""
    if raw is None:
        raw, lines = read_yaml(path) if path is not None else ({}, Lines("defaults"))
    lines = lines or Lines(str(path or "defaults"))
    for dotted, (value, origin) in (overrides or {}).items():
        if value is None:
            continue
        _set(raw, dotted, value)
        lines.lines[tuple(dotted.split("."))] = origin
    obj = build(cls, raw, lines)
    _check(obj, lines, ())
    return obj


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
        obj.check(lambda key: lines.at(path + tuple(key.split("."))))


def build(cls: type[T], raw: Any, lines: Lines, path: tuple[str, ...] = ()) -> T:
    """``raw`` (nested mappings) as an instance of the dataclass ``cls``, checked field by field."""
    here = ".".join(path) or "the file"
    if not isinstance(raw, dict):
        raise MLBenchError(f"{here} must be a mapping, got {type(raw).__name__}", lines.at(path))
    hints = typing.get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    for k in raw:
        if k not in names:
            raise MLBenchError(f"unknown key {'.'.join(path + (str(k),))!r}", lines.at(path + (str(k),)),
                               f"known keys here: {sorted(names)}")
    required = [f.name for f in dataclasses.fields(cls)
                if f.init and f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    for k in required:
        if k not in raw:
            raise MLBenchError(f"missing key {'.'.join(path + (k,))!r}", lines.at(path), f"add `{k}:`")
    kwargs = {k: _value(hints[k], v, lines, path + (k,)) for k, v in raw.items()}
    return cls(**kwargs)


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
    where, name = lines.at(path), ".".join(path)

    def bad() -> MLBenchError:
        return MLBenchError(f"{name} must be {_describe(tp)}, got {v!r}", where)

    origin = typing.get_origin(tp)
    if tp is Any:
        return v
    if origin in (Union, types.UnionType):
        for arg in typing.get_args(tp):
            if arg is type(None):
                if v is None:
                    return None
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
    if dataclasses.is_dataclass(tp):
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


Check = Callable[[str], str]  # what ``check(self, at)`` receives: a key -> its location
