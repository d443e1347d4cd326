"""One CLI vocabulary across stages, read from the parsers `mlbench` really builds: every option has help, every
option of a stage with a typed config sets a key of it, and the shared names (--tasks, --out, --split) mean the
same everywhere."""

import argparse
import dataclasses
import types
import typing
from pathlib import Path

import pytest

from mlbench_kit import __version__
from mlbench_kit.cli import build_parser, main, stage_parser
from mlbench_kit.config import OPTION, cli_options, option
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


def _annotation(cls: type, key: str):
    *parents, last = key.split(".")
    for part in parents:
        cls = typing.get_type_hints(cls)[part]
    tp = typing.get_type_hints(cls)[last]
    inner = [a for a in typing.get_args(tp) if a is not type(None)]
    return inner[0] if typing.get_origin(tp) in (typing.Union, types.UnionType) and len(inner) == 1 else tp


@pytest.mark.parametrize("st", [s for s in STAGES if s.config], ids=lambda s: s.name)
def test_every_field_of_a_stage_config_carries_its_help(st) -> None:
    bare = [key for key, f in config_fields(st.config_class()).items()
            if not dataclasses.is_dataclass(_annotation(st.config_class(), key)) and not f.metadata.get("help")]
    assert bare == [], f"{st.config}: fields without help"


def _declared(cls: type) -> dict[str, tuple[str, str, object]]:
    """Option name -> (key, spelling, facts), read straight from the fields' ``option(..., flag=...)``."""
    out = {}
    for key, f in config_fields(cls).items():
        facts = f.metadata.get(OPTION)
        if facts is None or not (facts.flag or facts.negated):
            continue
        spelled = facts.negated or (facts.flag if isinstance(facts.flag, str) else
                                    "--" + key.rsplit(".", 1)[-1].replace("_", "-"))
        name = key.rsplit(".", 1)[-1] if facts.negated else spelled[2:].replace("-", "_")
        assert name not in out, f"{cls.__name__}: two options named {name}"
        out[name] = (key, spelled, facts)
    return out


@pytest.mark.parametrize("st", [s for s in STAGES if s.config], ids=lambda s: s.name)
def test_a_stage_s_options_are_its_declared_config_keys(st) -> None:
    # every option of `mlbench STAGE` walked: its name, spelling, help, choices and defaults are its field's
    # declaration (option(..., flag=...)), and the class keeps no option table beside its fields
    cls = st.config_class()
    assert not {"FLAGS", "OLD_FLAGS", "ALIASES", "FLAG_SPELLING"} & set(dir(cls)), cls
    fields_ = config_fields(cls)
    declared = _declared(cls)
    assert {n: k for n, (k, _, _) in declared.items()} == st.flags()
    spelled = {name: s for name, (_, s, facts) in declared.items() if facts.negated}
    actions = [a for a in stage_parser(st.name)._actions if a.option_strings]
    shown = {a.dest: a for a in actions if a.help != argparse.SUPPRESS}
    for name, key in st.flags().items():
        f, tp = fields_[key], _annotation(cls, key)
        if typing.get_origin(tp) is dict:  # a mapping: --set KEY.SUB=VALUE
            assert name not in shown, name
            continue
        a = shown.pop(name)
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        both = tp is bool and name not in spelled and default is not False  # on (or unset) by default: --x/--no-x
        assert a.option_strings == [declared[name][1], *(["--no-" + name.replace("_", "-")] if both else []),
                                    *declared[name][2].alias], name
        assert a.default is None, name  # an option not given leaves the --config file's value
        says_default = "(default " in a.help or "(default: " in a.help
        if name in spelled:  # --no-hf: its help says what giving it does, forwards
            assert a.help == f"turns off: {f.metadata['help']} (key {key}, on by default)", (name, a.help)
        else:
            assert f.metadata["help"] and a.help.startswith(f.metadata["help"]), (name, a.help)
        if st.default_config is not None:  # train: the default config file's values, not the dataclass's
            assert not says_default or "(default" in f.metadata["help"], (name, a.help)
        elif name not in spelled and default not in (None, [], False) and "default" not in f.metadata["help"]:
            text = " ".join(map(str, default)) if isinstance(default, list) else (
                {True: "on", False: "off"}[default] if isinstance(default, bool) else str(default))
            assert a.help.endswith(f"(default {text})"), (name, a.help)
        item = typing.get_args(tp)[0] if typing.get_origin(tp) is list else tp
        if typing.get_origin(item) is typing.Literal:
            assert tuple(a.choices) == typing.get_args(item), name
        else:
            assert tuple(a.choices or ()) == tuple(f.metadata.get("choices", ())), name
        if tp is bool:
            assert a.nargs == 0, name  # a switch
        elif typing.get_origin(tp) is list:
            assert a.nargs in ("+", "*") and a.type is (int if item is int else str), name
        else:
            assert a.nargs is None and a.type is (tp if tp in (int, float) else str), name
    hidden = {a.option_strings[0]: a for a in actions if a.help == argparse.SUPPRESS}
    for name, (_, _, facts) in declared.items():  # each old spelling: hidden, into the new option
        for old in facts.old:
            assert hidden.pop(old if old.startswith("-") else "--" + old.replace("_", "-")).dest == name, old
    assert hidden == {}
    extra = {f.name: f for f in st.extra}
    assert set(shown) == {"help", "config", "set", "check", *extra}, \
        f"mlbench {st.name}: options that set no config key"
    for name, f in extra.items():
        assert (shown[name].help, shown[name].default, shown[name].required) == (f.help, f.default, f.required)


def test_an_option_declared_twice_or_half_declared_is_refused() -> None:
    @dataclasses.dataclass
    class Inner:
        seed: int = option(1, "inner seed", flag=True)

    @dataclasses.dataclass
    class Outer:
        seed: int = option(0, "outer seed", flag=True)
        inner: Inner = dataclasses.field(default_factory=Inner)

    with pytest.raises(ValueError, match=r"Outer: option --seed of inner.seed is also seed's"):
        cli_options(Outer)
    with pytest.raises(ValueError, match="pass flag= too"):
        option(1, "an alias of no option", alias=("--y",))
    with pytest.raises(ValueError, match="--lowercase-words"):
        option(1, "a spelling argparse would not parse as a long option", flag="-X")


def test_a_sweep_section_takes_the_options_the_fields_declare(capsys) -> None:
    # a sweep's stage section (its keys: option names) through the path `sweep plan` takes: aliases, old names
    # (warned at their line) and negated switches, as on the command line
    from mlbench_kit import deprecation
    from mlbench_kit.stages import load_stage_config, stage
    deprecation._warned.clear()
    where = "sweep.yaml:{}".format
    cfg = load_stage_config(stage("train"), {"task": 2, "output_dir": "runs/x", "model": "m", "max_seq_len": 512},
                            where)
    assert (cfg.data.task, cfg.output_dir, cfg.data.max_context_tokens) == (2, "runs/x", 512)
    err = capsys.readouterr().err
    assert "sweep.yaml:output_dir: --output-dir is deprecated, use --out" in err
    assert "sweep.yaml:max_seq_len: --max-seq-len is deprecated, use --max-context-tokens" in err
    assert load_stage_config(stage("prep"), {"no_hf": True, "out": "o"}, where).hf is False
    # learn's --seed is its training seed: the sampling section it shares with the agent brings no options
    learn = load_stage_config(stage("learn"), {"seed": 7, "reward_mode": "compat", "rounds": 3}, where)
    assert (learn.seed, learn.sampling.seed, learn.reward.mode, learn.rft.rounds) == (7, 42, "compat", 3)
    agent = load_stage_config(stage("agent"), {"seed": 7, "max_turns": 4}, where)
    assert (agent.sampling.seed, agent.limits.max_turns) == (7, 4)
    deprecation._warned.clear()


def test_one_vocabulary() -> None:
    opts = {st.name: {s: a for a in stage_parser(st.name)._actions for s in a.option_strings} for st in STAGES}
    for name in ("prep", "train", "infer"):
        assert tuple(opts[name]["--tasks"].choices) == TASKS, name
    assert opts["train"]["--task"] is opts["train"]["--tasks"] and opts["infer"]["--task"] is opts["infer"]["--tasks"]
    for name in ("prep", "train", "infer", "agent", "eval", "report"):
        assert "--out" in opts[name], name
    assert "--output-dir" in opts["train"]  # the old spelling, hidden, with a warning
    # the evaluating stages read the same split by default
    from mlbench_kit.agent_config import AgentConfig
    from mlbench_kit.eval_config import EvalConfig
    from mlbench_kit.infer_config import InferConfig
    assert InferConfig().split == EvalConfig().split == AgentConfig().split == "full"


def test_version(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == f"mlbench-kit {__version__}"


def test_configs_ls_and_cp(tmp_path: Path, capsys) -> None:
    assert main(["configs", "ls"]) == 0
    listed = capsys.readouterr().out.split()
    assert "train/tiny-cpu.yaml" in listed and "sweeps/paper.yaml" in listed
    assert main(["configs", "ls", "infer"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "infer  (mlbench infer --config FILE)" and all(x.startswith("  infer/") for x in lines[1:])
    assert main(["configs", "cp", "train/tiny-cpu", str(tmp_path)]) == 0
    root = Path(__file__).resolve().parents[2]
    assert (tmp_path / "tiny-cpu.yaml").read_text() == (root / "configs/train/tiny-cpu.yaml").read_text()
    assert main(["configs", "cp", "train/tiny-cpu.yaml", str(tmp_path)]) == 2  # never overwrites
    assert "the destination exists" in capsys.readouterr().err
    assert main(["configs", "cp", "train/nope.yaml", str(tmp_path / "x.yaml")]) == 2
    assert "no shipped config 'train/nope.yaml'" in capsys.readouterr().err


def test_configs_cp_never_overwrites_a_file_that_appears_after_the_check(tmp_path: Path, monkeypatch,
                                                                        capsys) -> None:
    # the destination is created between any check and the copy (here: every existence check says "no"): the
    # copy is refused, and the file that appeared keeps its content
    dest = tmp_path / "mine.yaml"
    dest.write_text("my edits\n")
    real_exists = Path.exists
    monkeypatch.setattr(Path, "exists", lambda self, *a, **kw: False if self == dest else real_exists(self, *a, **kw))
    assert main(["configs", "cp", "train/tiny-cpu.yaml", str(dest)]) == 2
    assert "the destination exists" in capsys.readouterr().err
    assert dest.read_text() == "my edits\n"
    # a link at the destination is not followed, even one whose target does not exist yet
    (tmp_path / "link.yaml").symlink_to(tmp_path / "elsewhere.yaml")
    assert main(["configs", "cp", "train/tiny-cpu.yaml", str(tmp_path / "link.yaml")]) == 2
    assert not (tmp_path / "elsewhere.yaml").exists()


def test_configs_ls_is_grouped_by_stage_with_one_line_each(capsys) -> None:
    """`tune ls`-like: a heading per folder saying what reads it, then each file and its description."""
    assert main(["configs", "ls"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert "train  (mlbench train --config FILE)" in lines and "sweeps  (mlbench sweep plan FILE)" in lines
    tiny = next(x for x in lines if x.strip().startswith("train/tiny-cpu.yaml"))
    assert tiny.split("  ", 2)[-1].strip().startswith("A tiny random-init Llama on CPU")
    paper = next(x for x in lines if x.strip().startswith("eval/run/paper.yaml"))  # its header's first line is a
    assert "The benchmark's own checker" in paper and "`mlbench" not in paper     # command: the next one is shown
    assert all(len(x) <= 140 for x in lines)


def test_a_mistyped_flag_gets_the_stage_s_usage_and_a_suggestion(capsys) -> None:
    with pytest.raises(SystemExit) as e:
        main(["infer", "--temprature", "0.2"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("usage: mlbench infer ")
    assert "unrecognized arguments: --temprature 0.2; --temprature: did you mean --temperature?" in err
    with pytest.raises(SystemExit):
        main(["prep", "--tsks", "3"])  # the stage's own usage, not mlbench's
    assert capsys.readouterr().err.startswith("usage: mlbench prep ")


def test_a_mistyped_config_key_gets_a_suggestion(tmp_path) -> None:
    from mlbench_kit.config import load
    from mlbench_kit.errors import MLBenchError
    from mlbench_kit.eval_config import EvalConfig
    cfg = tmp_path / "eval.yaml"
    cfg.write_text("mode: strict\nworker: 4\n")
    with pytest.raises(MLBenchError, match=r"eval.yaml:2: unknown key 'worker'\n  fix: did you mean 'workers'\?"):
        load(EvalConfig, cfg)


def test_the_top_level_help_speaks_to_users(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    second = capsys.readouterr().out.split("\n\n")[1]  # the paragraph under the usage
    assert second.startswith("ML-Bench from the rows to a score") and "stages.py" not in second


def test_train_without_config_on_a_cpu_names_the_cpu_config(monkeypatch) -> None:
    from mlbench_kit import flags
    from mlbench_kit.errors import MLBenchError
    from mlbench_kit.stages import stage
    monkeypatch.setattr(flags, "_has_cuda", lambda: False)
    args = argparse.Namespace(config=None, model=None, set=[])
    with pytest.raises(MLBenchError, match=r"needs|GPU") as e:
        flags.config_path(stage("train"), args)
    assert e.value.where == "--config" and "--config configs/train/tiny-cpu.yaml" in str(e.value.fix)
    # one's own model: the default config's settings apply to it, on any machine
    assert flags.config_path(stage("train"), argparse.Namespace(config=None, model="m", set=[])) is not None
    monkeypatch.setattr(flags, "_has_cuda", lambda: True)
    assert str(flags.config_path(stage("train"), args)).endswith("configs/train/codellama-7b-instruct.yaml")


def test_check_validates_a_config_without_running(tmp_path: Path, capsys) -> None:
    cfg = tmp_path / "eval.yaml"
    cfg.write_text("mode: strict\nworkers: 3\n")
    out = tmp_path / "never"
    assert main(["eval", "--config", str(cfg), "--data", "rows.jsonl", "--gold", "--out", str(out), "--check"]) == 0
    got = capsys.readouterr()
    assert "\nmode: strict\n" in got.out and "\nworkers: 3\n" in got.out and "eval: config OK" in got.err
    assert not out.exists()
    cfg.write_text("mode: strict\nworkers: 0\n")  # the same error a run gives, with its line
    assert main(["eval", "--config", str(cfg), "--data", "rows.jsonl", "--gold", "--out", str(out), "--check"]) == 2
    assert "`workers` must be at least 1" in capsys.readouterr().err and not out.exists()
    assert main(["infer", "--config", "configs/infer/tiny-cpu.yaml", "--check"]) == 2  # no model, prompts, out
    assert "missing --model" in capsys.readouterr().err
    # `mlbench run --check` checks each stage's config the run would build, not its own options alone: eval's bad
    # value was found only after prep and inference had run
    run = ["run", "--model", "M", "--data", "rows.jsonl", "--out", str(out), "--eval-config", str(cfg), "--check"]
    assert main(run) == 2
    err = capsys.readouterr().err
    assert "`workers` must be at least 1" in err and str(cfg) in err and not out.exists()
    cfg.write_text("mode: strict\nworkers: 3\n")
    assert main(run) == 0 and "run: config OK" in capsys.readouterr().err and not out.exists()


def test_every_stage_takes_split_singular_prep_its_splits_too(tmp_path: Path, capsys) -> None:
    """One vocabulary: `--split` is what every stage takes, so prep takes it too (beside `--splits`, which loads
    several); before, prep refused it as ambiguous (`--splits` or `--splitter`)."""
    out = tmp_path / "never"
    assert main(["prep", "--data", "rows.jsonl", "--split", "test", "--out", str(out), "--check"]) == 0
    assert "\nsplits:\n- test\n" in capsys.readouterr().out and not out.exists()
