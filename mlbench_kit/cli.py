"""The `mlbench` command: one sub-command per stage (the table in mlbench_kit/stages.py), plus `configs`."""

from __future__ import annotations

import argparse
import difflib
import os
import signal
import sys
import threading
from pathlib import Path
from typing import Any, NoReturn

from . import __version__
from .errors import MLBenchError, Terminated, raise_terminated
from .flags import add_options, check_config, extra_option, resolve
from .stages import STAGES, Command, Stage, stage

# the shipped configs: configs/ beside the package (an editable install, the way setup.sh installs)
CONFIGS = Path(__file__).resolve().parents[1] / "configs"
CONFIGS_HELP = "list the shipped configs and copy one to edit (like torchtune's `tune ls` / `tune cp`)"
DESCRIPTION = ("ML-Bench from the rows to a score: prep -> train -> infer (or agent) -> eval -> report. "
               "`mlbench STAGE --help` lists a stage's options; `mlbench configs ls` the shipped configs.")


def suggestions(message: str, known: list[str]) -> str:
    """``message`` of argparse with a "did you mean" for each unrecognized option close to a ``known`` one."""
    if not message.startswith("unrecognized arguments:"):
        return message
    hints = []
    for word in message.split(":", 1)[1].split():
        close = difflib.get_close_matches(word.split("=", 1)[0], known, n=1, cutoff=0.6) if word.startswith("--") \
            else []
        if close:
            hints.append(f"{word}: did you mean {close[0]}?")
    return "; ".join([message, *hints])


class HintingParser(argparse.ArgumentParser):
    """A stage's parser: a wrong option prints this stage's usage and a "did you mean"."""

    def error(self, message: str) -> NoReturn:
        known = [o for a in self._actions if a.help != argparse.SUPPRESS for o in a.option_strings]
        self.print_usage(sys.stderr)
        self.exit(2, f"{self.prog}: error: {suggestions(message, known)}\n")


class _RaisingParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise MLBenchError(message)


def stage_parser(name: str, raising: bool = False) -> argparse.ArgumentParser:
    """The parser of one stage, as ``mlbench NAME`` builds it (``raising``: a bad option raises
    :class:`MLBenchError` instead of exiting)."""
    cls: type[argparse.ArgumentParser] = _RaisingParser if raising else HintingParser
    if name == "configs":
        parser = cls(prog="mlbench configs", description=CONFIGS_HELP, add_help=not raising)
        _configs_args(parser)
        return parser
    st = stage(name)
    if st.commands:
        cls = _with_commands(cls, st, raising)
    parser = cls(prog=f"mlbench {name}", description=st.help, add_help=not raising, epilog=_commands_epilog(st))
    add_stage_options(parser, st)
    return parser


def stage_config(name: str, argv: list[str]) -> Any:
    """The typed config ``mlbench NAME ARGV...`` runs with: its options parsed by the stage's generated parser and
    resolved (``--config`` file, flags, ``--set``) and checked as the stage does; a bad option or value raises
    :class:`MLBenchError`."""
    return resolve(stage(name), stage_parser(name, raising=True).parse_args(argv))


def _commands_epilog(st: Stage) -> str | None:
    return "commands: " + "; ".join(f"`mlbench {st.name} {c.name}`: {c.help}" for c in st.commands) \
        if st.commands else None


def command_parser(st: Stage, cmd: Command, raising: bool = False) -> argparse.ArgumentParser:
    """The parser of ``mlbench STAGE COMMAND``, from the command's declaration in the stage table."""
    cls = _RaisingParser if raising else argparse.ArgumentParser
    parser = cls(prog=f"mlbench {st.name} {cmd.name}", description=cmd.help, add_help=not raising)
    for name, help_ in cmd.positionals:
        parser.add_argument(name, help=help_)
    for f in cmd.options:
        extra_option(parser, f)
    return parser


def _with_commands(cls: type[argparse.ArgumentParser], st: Stage, raising: bool) -> type[argparse.ArgumentParser]:
    """A stage parser that hands ``COMMAND ...`` to that command's parser (so ``mlbench agent show RUN`` parses
    wherever the stage's commands are parsed: here, the docs' test)."""
    commands = {c.name: c for c in st.commands}

    class WithCommands(cls):  # type: ignore[valid-type,misc]
        def parse_known_args(self, args: Any = None, namespace: Any = None) -> Any:
            words = list(sys.argv[1:] if args is None else args)
            if words and words[0] in commands:
                ns, rest = command_parser(st, commands[words[0]], raising).parse_known_args(words[1:], namespace)
                ns.command = words[0]
                return ns, rest
            return super().parse_known_args(words, namespace)
    return WithCommands


def _command(words: list[str]) -> tuple[Stage, Command] | None:
    """The stage command ``words`` ask for (``agent show ...``), if any."""
    names = {st.name: st for st in STAGES}
    i = next((i for i, w in enumerate(words) if not w.startswith("-")), None)
    if i is None or words[i] not in names or i + 1 >= len(words):
        return None
    st = names[words[i]]
    return next(((st, c) for c in st.commands if c.name == words[i + 1]), None)


def add_stage_options(parser: argparse.ArgumentParser, st: Stage) -> None:
    """A stage's options: generated from its config declaration (:mod:`mlbench_kit.flags`; no stage imported),
    or its own ``add_arguments`` for a stage without a config."""
    if st.config is not None:
        add_options(parser, st)
    else:
        st.module().add_arguments(parser)


def shipped_configs() -> list[Path]:
    """Every shipped config file, relative to ``configs/``."""
    if not CONFIGS.is_dir():
        raise MLBenchError("no shipped configs here", str(CONFIGS), "run mlbench from a checkout (scripts/setup.sh "
                           "installs it editable)")
    return sorted(p.relative_to(CONFIGS) for p in CONFIGS.rglob("*") if p.is_file() and p.suffix in (".yaml", ".yml"))


FOLDER_USE = {  # what reads each folder of configs/
    "accelerate": "mlbench train --accelerate-config FILE", "agent": "mlbench agent --config FILE",
    "eval": "mlbench eval --config FILE (run/); --envs FILE (the rest)", "infer": "mlbench infer --config FILE",
    "learn": "mlbench learn --config FILE",
    "prep": "mlbench prep --config FILE", "report": "mlbench report --reference FILE",
    "sweeps": "mlbench sweep plan FILE", "train": "mlbench train --config FILE",
}


def describe(path: Path, width: int = 90) -> str:
    """A config's one-line description: the first comment line of its header that is not a command."""
    for line in path.read_text(errors="replace").splitlines()[:6]:
        if not line.startswith("#"):
            break
        text = line.lstrip("#").strip()
        if text and not text.startswith("`"):
            text = text.split(". ", 1)[0]  # its first sentence
            return text if len(text) <= width else text[: width - 3].rstrip() + "..."
    return ""


def _configs_args(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="configs_cmd", required=True)
    ls = sub.add_parser("ls", help="list the shipped configs (NAME: its path under configs/)",
                        description="list the shipped configs")
    ls.add_argument("folder", nargs="?", help="only this folder of configs/ (e.g. train, infer, sweeps)")
    cp = sub.add_parser("cp", help="copy a shipped config to edit it", description="copy a shipped config to edit it")
    cp.add_argument("name", help="NAME as `mlbench configs ls` lists it, e.g. train/tiny-cpu.yaml")
    cp.add_argument("dest", help="file or folder to copy it to (an existing file is not overwritten)")


def _configs(args: argparse.Namespace) -> int:
    found = shipped_configs()
    if args.configs_cmd == "ls":
        shown = [p for p in found if args.folder is None or p.parts[0] == args.folder]
        if not shown:
            raise MLBenchError(f"no shipped configs under {args.folder!r}", "folder",
                               f"folders: {', '.join(sorted({p.parts[0] for p in found}))}")
        width = max(len(str(p)) for p in shown)
        for folder in dict.fromkeys(p.parts[0] for p in shown):
            used = FOLDER_USE.get(folder, "")
            print(f"{folder}{f'  ({used})' if used else ''}")
            for p in (p for p in shown if p.parts[0] == folder):
                print(f"  {str(p):<{width}}  {describe(CONFIGS / p)}")
        return 0
    name = Path(args.name)
    if name not in found:
        name = next((p for p in found if p.with_suffix("") == name), name)
    if name not in found:
        raise MLBenchError(f"no shipped config {args.name!r}", "name", "`mlbench configs ls` lists them")
    dest = Path(args.dest)
    if dest.is_dir():
        dest = dest / name.name
    dest.parent.mkdir(parents=True, exist_ok=True)
    data = (CONFIGS / name).read_bytes()
    try:  # O_EXCL: a file that appears at dest at any moment before this is never overwritten
        fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # the umask applies
    except FileExistsError:
        raise MLBenchError("the destination exists", str(dest), "choose another name, or remove it first") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
    except BaseException:
        dest.unlink(missing_ok=True)  # ours (O_EXCL made it): no half-written copy is left
        raise
    print(f"configs: copied {name} to {dest}", file=sys.stderr)
    return 0


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    """``mlbench`` with every stage's sub-command; with ``only``, that stage's options alone are added (the others
    are listed by name and help), so a command imports only its own stage (training imports torch, the report
    matplotlib...)."""
    parser = argparse.ArgumentParser(prog="mlbench", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"mlbench-kit {__version__}",
                        help="print the version and exit")
    sub = parser.add_subparsers(dest="stage", required=True)
    for st in STAGES:
        p = sub.add_parser(st.name, help=st.help, description=st.help)
        if only is None or only == st.name:
            add_stage_options(p, st)
    _configs_args(sub.add_parser("configs", help=CONFIGS_HELP, description=CONFIGS_HELP))
    return parser


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``mlbench``; bad input exits with status 2 and one clear message."""
    from .progress import bars_only_on_tty
    bars_only_on_tty()  # before any stage imports tqdm: no progress bars in a log, a pipe or a Slurm file
    words = sys.argv[1:] if argv is None else argv
    chosen = next((w for w in words if not w.startswith("-")), None)
    cmd = _command(words)
    if cmd is not None:  # `mlbench STAGE COMMAND ...`
        i = words.index(cmd[0].name)
        args = command_parser(*cmd).parse_args(words[i + 2:])
        args.stage, args.command = cmd[0].name, cmd[1].name
    elif words and words[0] == chosen and chosen in {st.name for st in STAGES} | {"configs"}:
        # the stage's own parser: a wrong option gets this stage's usage and a "did you mean", not mlbench's
        args = stage_parser(chosen).parse_args(words[1:])
        args.stage = chosen
    else:
        args = build_parser(chosen if chosen in {st.name for st in STAGES} else "").parse_args(argv)
    previous = signal.getsignal(signal.SIGTERM)
    takes_term = (args.stage not in {st.name for st in STAGES} or stage(args.stage).sigterm_interrupts) \
        and previous is signal.SIG_DFL and threading.current_thread() is threading.main_thread()
    try:
        if takes_term:
            signal.signal(signal.SIGTERM, raise_terminated)
        if cmd is not None:
            return int(cmd[1].function()(args))
        if args.stage == "configs":
            return _configs(args)
        if getattr(args, "check", False):
            return check_config(stage(args.stage), args)
        return int(stage(args.stage).module().run(args))
    except MLBenchError as exc:
        print(f"error: {exc.render()}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as exc:
        how = "terminated (SIGTERM)" if isinstance(exc, Terminated) else "interrupted"
        if args.stage == "prep":  # its folder appears whole at the end, or not at all
            print(f"{how}: prep wrote nothing; re-run the same command", file=sys.stderr)
        else:
            print(f"{how}: results written so far are kept; re-run the same command to resume", file=sys.stderr)
        return 128 + signal.SIGTERM if isinstance(exc, Terminated) else 130
    finally:
        if takes_term:
            signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
