"""`mlbench prep`'s options as one typed config (issue 23): flags override a --config file, which overrides the
defaults; a bad key, value or combination is one error with its file:line or flag, before anything is written."""

from pathlib import Path

import pytest

from mlbench_kit.cli import stage_parser
from mlbench_kit.data_prep.templates import TEMPLATES
from mlbench_kit.errors import MLBenchError
from mlbench_kit.flags import resolve
from mlbench_kit.prep_config import PrepConfig
from mlbench_kit.stages import stage

REPO = Path(__file__).parents[2]


def _resolve(*argv: str) -> PrepConfig:
    return resolve(stage("prep"), stage_parser("prep").parse_args(list(argv)))


def test_flags_override_the_file_which_overrides_the_defaults(tmp_path: Path) -> None:
    f = tmp_path / "prep.yaml"
    f.write_text("template: chat\nmax_context_tokens: 4096\nhf: false\ntasks: [3]\n")
    cfg = _resolve("--config", str(f), "--out", "o", "--tasks", "2", "3", "--splitter", "regex")
    assert (cfg.template, cfg.max_context_tokens, cfg.hf, cfg.tasks, cfg.splitter) == ("chat", 4096, False, [2, 3],
                                                                                      "regex")
    assert cfg.max_new_tokens == PrepConfig.max_new_tokens and cfg.out == "o"
    assert _resolve("--out", "o", "--no-hf").hf is False and _resolve("--out", "o").hf is True


@pytest.mark.parametrize("text, argv, message, where", [
    ("templat: chat\n", (), "unknown key 'templat'", "prep.yaml:1"),
    ("template: alpaca\n", (), "template must be one of", "prep.yaml:1"),
    ("splits: [a, b]\ndata: rows.jsonl\n", (), "a file holds one split", "prep.yaml:1"),
    ("checkout: repos.json\n", (), "needs `repos_dir`", "prep.yaml:1"),
    ("id_test_fraction: 1.5\n", (), "between 0 and 1", "prep.yaml:1"),
    ("", ("--max-new-tokens", "-1"), "must be >= 0", "--max-new-tokens"),
    ("", ("--build-splits", "--splits", "a", "b"), "exactly one loaded split", "--splits"),
])
def test_a_bad_option_is_one_error_naming_its_line_or_flag(tmp_path: Path, text: str, argv: tuple, message: str,
                                                           where: str) -> None:
    f = tmp_path / "prep.yaml"
    f.write_text(text or "{}\n")
    with pytest.raises(MLBenchError, match=message) as e:
        _resolve("--config", str(f), "--out", str(tmp_path / "out"), *argv)
    assert e.value.where.endswith(where), e.value.where
    assert not (tmp_path / "out").exists()


def test_the_old_budget_key_in_a_file_loads_with_one_warning(tmp_path: Path, capsys) -> None:
    f = tmp_path / "prep.yaml"
    f.write_text("template: paper\nmax_tokens: 2048\n")
    assert _resolve("--config", str(f), "--out", "o").max_context_tokens == 2048
    err = capsys.readouterr().err
    assert f"{f}:2" in err and "max_context_tokens" in err


def test_the_config_s_templates_are_the_stage_s() -> None:
    import typing
    assert set(typing.get_args(typing.get_type_hints(PrepConfig)["template"])) == set(TEMPLATES)


def test_the_shipped_prep_config_loads() -> None:
    cfg = _resolve("--config", str(REPO / "configs/prep/paper.yaml"), "--out", "o")
    assert (cfg.template, cfg.splitter, cfg.max_context_tokens, cfg.max_new_tokens) == ("paper", "punkt", 8192, 1024)


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_prep_writes_its_resolved_config_and_replays_from_it(tmp_path: Path, capsys) -> None:
    # OUT/config.yaml is the whole resolved config (defaults, the file and the flags in one), and
    # `mlbench prep --config OUT/config.yaml` redoes the same run: byte-identical outputs
    from mlbench_kit.cli import main
    sample = REPO / "examples" / "sample"
    opts = tmp_path / "opts.yaml"
    opts.write_text("template: llama-inst\nsplitter: regex\n")
    out = tmp_path / "prep"
    assert main(["prep", "--config", str(opts), "--data", str(sample / "samples.jsonl"), "--readmes",
                 str(sample / "repos"), "--tasks", "1", "3", "--no-hf", "--set", "seed=7", "--out", str(out)]) == 0
    written = (out / "config.yaml").read_text()
    assert {"template: llama-inst", "splitter: regex", "hf: false", "seed: 7", f"out: {out}"} <= set(
        written.splitlines()), written
    first = _files(out)
    out.rename(tmp_path / "first")
    assert main(["prep", "--config", str(tmp_path / "first" / "config.yaml")]) == 0
    assert _files(out) == first
