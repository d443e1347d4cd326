"""Renamed options and config keys: the old name still works for one release, with one warning naming the new one;
every old name goes in :data:`REMOVED_IN`.

    p.add_argument("--max-context-tokens", type=int, default=8192)
    deprecated_flag(p, "--max-tokens", "--max-context-tokens", type=int)   # argparse: the old flag, hidden

A config field declares its old names itself (``option(8192, "...", flag=True, old=("max_seq_len",))``,
:func:`mlbench_kit.config.option`): the loader (:mod:`mlbench_kit.config`) reads the old key in files and warns with
its file:line, and the generated command line (:mod:`mlbench_kit.flags`) adds the old flag with
:func:`deprecated_flag`.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

# the release that drops every old name this module keeps working (this release: mlbench_kit.__version__, 0.1.0)
REMOVED_IN = "0.2.0"

_warned: set[str] = set()  # each warning once per process (a sweep parses each stage's command many times)
_locate: Callable[[str], str | None] | None = None  # where a flag came from, when a file wrote it (a sweep)


def warn_renamed(old: str, new: str, where: str | None = None) -> None:
    """``where: old is deprecated, use new`` on stderr, once per process for the same message (and only on the
    first rank of a distributed launch, where every rank reads the same config)."""
    if os.environ.get("RANK", "0") != "0":
        return
    msg = (f"warning: {where + ': ' if where else ''}{old} is deprecated, use {new} "
           f"({old} still works in this release and is removed in {REMOVED_IN})")
    if msg not in _warned:
        _warned.add(msg)
        print(msg, file=sys.stderr, flush=True)


class _DeprecatedFlag(argparse.Action):
    """Stores like the new flag's own action (into the same ``dest``) and warns once."""

    def __init__(self, option_strings: list[str], dest: str, new: str = "", **kw: Any) -> None:
        self.new = new
        super().__init__(option_strings, dest, **kw)

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        flag = option_string or self.option_strings[0]
        warn_renamed(flag, self.new, _locate(flag) if _locate else None)
        setattr(namespace, self.dest, values)


def deprecated_flag(parser: argparse.ArgumentParser, old: str, new: str, **kw: Any) -> None:
    """``old`` as a hidden alias of the option ``new`` (same ``dest``; ``kw``: its ``type``, ``nargs``...)."""
    parser.add_argument(old, dest=new.lstrip("-").replace("-", "_"), action=_DeprecatedFlag, new=new,
                        default=argparse.SUPPRESS, help=argparse.SUPPRESS, **kw)


@contextlib.contextmanager
def flags_from(locate: Callable[[str], str | None]) -> Iterator[None]:
    """While parsing a command line that a file wrote (a sweep's stage options), an old flag's warning names the
    file:line ``locate(flag)`` gives."""
    global _locate
    before, _locate = _locate, locate
    try:
        yield
    finally:
        _locate = before
