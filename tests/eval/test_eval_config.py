"""`mlbench eval`'s options as one typed config (issue 23): flags, a --config file and gold validation build the
same EvalConfig, every mistake is one error with its file:line or flag, and nothing mutates the options."""

import dataclasses
from pathlib import Path

import pytest

from mlbench_kit.cli import stage_parser
from mlbench_kit.errors import MLBenchError
from mlbench_kit.eval import execution
from mlbench_kit.eval import run as eval_run
from mlbench_kit.eval_config import BACKENDS, EvalConfig


def _resolve(*argv: str):
    args = stage_parser("eval").parse_args(list(argv))
    return args, eval_run.resolve_config(args)


def test_flags_override_the_config_file_which_overrides_the_defaults(tmp_path: Path) -> None:
    f = tmp_path / "eval.yaml"
    f.write_text("mode: strict\nworkers: 4\nk: [1, 5]\ntimeout_pass: true\nmem_mb: 4096\n")
    _, cfg = _resolve("--config", str(f), "--data", "rows.jsonl", "--gold", "--out", "o", "--workers", "8",
                      "--no-ci")
    assert (cfg.mode, cfg.workers, cfg.k, cfg.timeout_pass, cfg.mem_mb) == ("strict", 8, [1, 5], True, 4096)
    assert (cfg.gold, cfg.ci, cfg.pids, cfg.backend) == (True, False, EvalConfig.pids, "bwrap")
    # the same options as flags only: the same config, so a run folder made one way resumes the other way
    args, flags = _resolve("--data", "rows.jsonl", "--gold", "--out", "o", "--workers", "8", "--no-ci",
                           "--mode", "strict", "--k", "1", "5", "--timeout-pass", "--mem-mb", "4096")
    assert flags == cfg
    threads = execution.default_threads(flags.cpus, flags.workers)
    assert execution.run_settings(flags, threads) == execution.run_settings(cfg, threads)
    before = vars(args).copy()
    execution.run_settings(flags, threads)
    assert vars(args) == before  # resolving threads no longer writes into the parsed flags


@pytest.mark.parametrize("text, argv, message, where", [
    ("mode: strict\nmdoe: compat\n", (), "unknown key 'mdoe'", "eval.yaml:2"),
    ("workers: two\n", (), "workers must be int, got 'two'", "eval.yaml:1"),
    ("backend: chroot\n", (), "backend must be one of", "eval.yaml:1"),
    ("timeout_pass: true\n", (), "strict-mode rule", "eval.yaml:1"),
    ("", ("--static-gate",), "strict-mode rule", "--static-gate"),
    ("k: [0]\n", (), "`k` must be positive", "eval.yaml:1"),
    ("", ("--workers", "0"), "`workers` must be at least 1", "--workers"),
])
def test_a_bad_option_is_one_error_naming_its_line_or_flag(tmp_path: Path, text: str, argv: tuple, message: str,
                                                           where: str) -> None:
    f = tmp_path / "eval.yaml"
    f.write_text(text or "{}\n")
    with pytest.raises(MLBenchError, match=message) as e:
        _resolve("--config", str(f), "--data", "d", "--gold", "--out", "o", *argv)
    assert e.value.where.endswith(where), e.value.where


def test_required_options_and_one_source_of_outputs() -> None:
    with pytest.raises(MLBenchError, match="missing --data: mlbench eval needs"):
        _resolve("--gold", "--out", "o")
    with pytest.raises(MLBenchError, match=r"missing --generations \(or --gold\): "):
        _resolve("--data", "d", "--out", "o")


def test_the_config_s_backends_are_the_sandbox_s() -> None:
    from mlbench_kit.sandbox import BACKENDS as SANDBOX
    assert set(BACKENDS) == set(SANDBOX)
    hint = dataclasses.fields(EvalConfig)
    assert next(f for f in hint if f.name == "backend").default == "bwrap"


@pytest.mark.parametrize("path", sorted((Path(__file__).parents[2] / "configs/eval/run").glob("*.yaml")),
                         ids=lambda p: p.stem)
def test_the_shipped_eval_configs_load(path: Path) -> None:
    _, cfg = _resolve("--config", str(path), "--data", "d", "--gold", "--out", "o")
    assert cfg.mode == path.stem.replace("paper", "compat")
