"""One CLI vocabulary across stages, read from the parsers `mlbench` really builds: every option has help, every
option of a stage with a typed config sets a key of it, and the shared names (--tasks, --out, --split) mean the
same everywhere."""

import argparse
from pathlib import Path

import pytest

from mlbench_kit import __version__
from mlbench_kit.cli import build_parser, main, stage_parser
from mlbench_kit.records import TASKS
from mlbench_kit.stages import STAGES, config_fields


def _walk(parser: argparse.ArgumentParser, prog: str):
    """(command, action) of every option of ``parser`` and of its sub-commands, at any depth."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _walk(sub, f"{prog} {name}")
        else:
            yield prog, action


def test_every_option_of_every_command_has_help() -> None:
    missing = [f"{prog} {'/'.join(a.option_strings) or a.dest}" for prog, a in _walk(build_parser(), "mlbench")
               if not a.help]
    assert missing == [], "options without help text: " + ", ".join(missing)


def test_the_walk_sees_an_option_without_help() -> None:
    p = argparse.ArgumentParser()
    sub = p.add_subparsers()
    sub.add_parser("x").add_subparsers().add_parser("y").add_argument("--bare")
    assert [a.option_strings for _, a in _walk(p, "p") if not a.help] == [["--bare"]]


@pytest.mark.parametrize("st", [s for s in STAGES if s.config], ids=lambda s: s.name)
def test_a_stage_s_options_are_its_config_s_keys(st) -> None:
    flags, keys = st.flags(), config_fields(st.config_class())
    if not flags:
        pytest.skip(f"{st.name} declares no FLAGS")
    for option, key in flags.items():
        assert key in keys or key == "set", (st.name, option, key)
    renamed = getattr(st.config_class(), "OLD_FLAGS", {})
    for action in stage_parser(st.name)._actions:
        if not action.option_strings or action.dest in ("help", "config", "resume"):
            continue
        dest = renamed.get(action.dest, action.dest)
        assert dest in flags, f"mlbench {st.name} {action.option_strings[0]} sets no key of {st.config}"


def test_one_vocabulary() -> None:
    opts = {st.name: {s: a for a in stage_parser(st.name)._actions for s in a.option_strings} for st in STAGES}
    for name in ("prep", "train", "infer"):
        assert tuple(opts[name]["--tasks"].choices) == TASKS, name
    assert opts["train"]["--task"] is opts["train"]["--tasks"] and opts["infer"]["--task"] is opts["infer"]["--tasks"]
    for name in ("prep", "train", "infer", "agent", "eval", "report"):
        assert "--out" in opts[name], name
    assert "--output-dir" in opts["train"]  # the old spelling, hidden, with a warning
    # the evaluating stages read the same split by default
    from mlbench_kit.eval_config import EvalConfig
    from mlbench_kit.infer_config import InferConfig
    assert InferConfig().split == EvalConfig().split == opts["agent"]["--split"].default == "full"


def test_version(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"mlbench-kit {__version__}"


def test_configs_ls_and_cp(tmp_path: Path, capsys) -> None:
    assert main(["configs", "ls"]) == 0
    listed = capsys.readouterr().out.split()
    assert "train/tiny-cpu.yaml" in listed and "sweeps/paper.yaml" in listed
    assert main(["configs", "ls", "infer"]) == 0
    assert all(p.startswith("infer/") for p in capsys.readouterr().out.split())
    assert main(["configs", "cp", "train/tiny-cpu", str(tmp_path)]) == 0
    root = Path(__file__).resolve().parents[2]
    assert (tmp_path / "tiny-cpu.yaml").read_text() == (root / "configs/train/tiny-cpu.yaml").read_text()
    assert main(["configs", "cp", "train/tiny-cpu.yaml", str(tmp_path)]) == 2  # never overwrites
    assert "the destination exists" in capsys.readouterr().err
    assert main(["configs", "cp", "train/nope.yaml", str(tmp_path / "x.yaml")]) == 2
    assert "no shipped config 'train/nope.yaml'" in capsys.readouterr().err
