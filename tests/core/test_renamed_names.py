"""The budget's names: ``max_context_tokens`` (prompt + answer, prep and train) and ``max_new_tokens`` (infer).
Each old name (``--max-tokens``, ``max_seq_len``, ``max_tokens``) still works for one release: the same result as
the new name, and one warning that names the new name (and, in a config file, the old key's file:line)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from conftest import REPO_ROOT

from mlbench_kit import deprecation
from mlbench_kit.cli import stage_config, stage_parser
from mlbench_kit.errors import MLBenchError
from mlbench_kit.flags import resolve
from mlbench_kit.stages import stage

SAMPLE = REPO_ROOT / "examples" / "sample" / "samples.jsonl"


@pytest.fixture(autouse=True)
def fresh_warnings():
    deprecation._warned.clear()  # each warning is printed once per process
    yield
    deprecation._warned.clear()


def _warnings(err: str) -> list[str]:
    return [ln for ln in err.splitlines() if ln.startswith("warning:")]


def _one_warning(capsys, old: str, new: str, where: str | None = None) -> None:
    got = _warnings(capsys.readouterr().err)
    assert len(got) == 1, got
    assert f"{old} is deprecated, use {new}" in got[0], got
    if where:
        assert got[0].startswith(f"warning: {where}: "), got


def _prep(out: Path, tokenizer: Path, *budget: str) -> dict:
    from mlbench_kit.data_prep import prepare
    p = stage_parser("prep")
    args = p.parse_args(["--data", str(SAMPLE), "--splits", "full", "--tasks", "3", "--template", "llama-inst",
                         "--tokenizer", str(tokenizer), *budget, "--splitter", "regex", "--no-hf", "--out", str(out)])
    assert prepare.run(args) == 0
    return {"manifest": json.loads((out / "manifest.json").read_text()),
            "records": (out / "full" / "task3.jsonl").read_text()}


def test_prep_max_tokens_is_max_context_tokens(tiny_tokenizer_dir, tmp_path, capsys):
    new = _prep(tmp_path / "new", tiny_tokenizer_dir, "--max-context-tokens", "120")
    assert _warnings(capsys.readouterr().err) == []
    old = _prep(tmp_path / "old", tiny_tokenizer_dir, "--max-tokens", "120")
    _one_warning(capsys, "--max-tokens", "--max-context-tokens")
    assert old == new and new["manifest"]["max_context_tokens"] == 120
    assert '"truncated": true' in new["records"]  # the budget was used: some oracle contexts were cut


def _train_file(tmp_path: Path, key: str, value: int) -> Path:
    text = (REPO_ROOT / "configs/train/tiny-cpu.yaml").read_text()
    assert "  max_context_tokens: 1024\n" in text
    f = tmp_path / f"{key}.yaml"
    f.write_text(text.replace("  max_context_tokens: 1024\n", f"  {key}: {value}\n"))
    return f


def _train(config: Path, *argv: str):
    return stage_config("train", ["--config", str(config), "--model", "m", *argv])


def test_train_config_max_seq_len_is_max_context_tokens(tmp_path, capsys):
    new = _train(_train_file(tmp_path, "max_context_tokens", 768))
    assert _warnings(capsys.readouterr().err) == []
    f = _train_file(tmp_path, "max_seq_len", 768)
    line = next(i for i, ln in enumerate(f.read_text().splitlines(), 1) if "max_seq_len" in ln)
    old = _train(f)
    _one_warning(capsys, "data.max_seq_len", "data.max_context_tokens", f"{f}:{line}")
    assert old == new and new.data.max_context_tokens == 768
    # --set with the old key, over a file with the new one: the override wins, as any --set does
    assert _train(_train_file(tmp_path, "max_context_tokens", 768),
                  "--set", "data.max_seq_len=512").data.max_context_tokens == 512
    _one_warning(capsys, "data.max_seq_len", "data.max_context_tokens", "--set data.max_seq_len=512")
    # both names in one file is a mistake, not a guess
    both = tmp_path / "both.yaml"
    both.write_text(f.read_text().replace("  max_seq_len: 768\n", "  max_seq_len: 768\n  max_context_tokens: 512\n"))
    with pytest.raises(MLBenchError, match="data.max_seq_len and data.max_context_tokens are both set") as e:
        _train(both)
    assert e.value.where == f"{both}:{line}"


def test_train_flag_max_seq_len_is_max_context_tokens(capsys):
    p, train = stage_parser("train"), stage("train")
    new = resolve(train, p.parse_args(["--config", "configs/train/tiny-cpu.yaml", "--model", "m",
                                            "--max-context-tokens", "640"]))
    assert _warnings(capsys.readouterr().err) == []
    old = resolve(train, p.parse_args(["--config", "configs/train/tiny-cpu.yaml", "--model", "m",
                                            "--max-seq-len", "640"]))
    _one_warning(capsys, "--max-seq-len", "--max-context-tokens")
    assert old == new and new.data.max_context_tokens == 640
    assert "--max-seq-len" not in p.format_help()  # the old spelling is hidden


def test_infer_config_max_tokens_is_max_new_tokens(tmp_path, capsys):
    text = (REPO_ROOT / "configs/infer/paper.yaml").read_text()
    assert "  max_new_tokens: 1024\n" in text
    new = stage_config("infer", ["--config", str(REPO_ROOT / "configs/infer/paper.yaml")])
    assert _warnings(capsys.readouterr().err) == []
    f = tmp_path / "old.yaml"
    f.write_text(text.replace("  max_new_tokens: 1024\n", "  max_tokens: 1024\n"))
    line = next(i for i, ln in enumerate(f.read_text().splitlines(), 1) if "max_tokens" in ln)
    old = stage_config("infer", ["--config", str(f)])
    _one_warning(capsys, "sampling.max_tokens", "sampling.max_new_tokens", f"{f}:{line}")
    assert old == new and new.sampling.max_new_tokens == 1024


def test_infer_flag_max_tokens_is_max_new_tokens(capsys):
    p, infer = stage_parser("infer"), stage("infer")
    base = ["--model", "m", "--prompts", "p", "--out", "o", "--config", "configs/infer/paper.yaml"]
    new = resolve(infer, p.parse_args([*base, "--max-new-tokens", "32"]))
    assert _warnings(capsys.readouterr().err) == []
    old = resolve(infer, p.parse_args([*base, "--max-tokens", "32"]))
    _one_warning(capsys, "--max-tokens", "--max-new-tokens")
    assert old == new and new.sampling.max_new_tokens == 32


def test_a_sweep_with_the_old_names_plans_and_warns_once_per_name(tmp_path, capsys):
    from mlbench_kit.slurm.render import check_jobs, jobs
    from mlbench_kit.slurm.spec import load_sweep
    spec = yaml.safe_load((REPO_ROOT / "configs/sweeps/tiny-cpu.yaml").read_text())
    spec["prep"]["max_tokens"] = spec["prep"].pop("max_context_tokens")
    spec["infer"]["max_tokens"] = 32
    f = tmp_path / "s.yaml"
    f.write_text(yaml.safe_dump(spec, sort_keys=False))
    sweep = load_sweep(f, REPO_ROOT)
    all_jobs = jobs(sweep)
    check_jobs(sweep, all_jobs)  # two models, four infer cells: each command parsed, each old flag warned once
    got = _warnings(capsys.readouterr().err)
    lines = f.read_text().splitlines()
    prep_line = next(i for i, ln in enumerate(lines, 1) if ln.startswith("  max_tokens: 1024"))
    infer_line = next(i for i, ln in enumerate(lines, 1) if ln.startswith("  max_tokens: 32"))
    assert got == [f"warning: {f}:{prep_line}: --max-tokens is deprecated, use --max-context-tokens (--max-tokens "
                   "still works in this release and is removed in 0.2.0)",
                   f"warning: {f}:{infer_line}: --max-tokens is deprecated, use --max-new-tokens (--max-tokens "
                   "still works in this release and is removed in 0.2.0)"]
    assert sum(u.argv.count("--max-tokens") for j in all_jobs for u in j.units) == 2 + 4


def test_records_written_under_the_old_names_still_load(tmp_path, capsys):
    """What older runs wrote: prep's manifest (max_tokens), an infer folder's infer.json (sampling.max_tokens), a
    training run's run.json and checkpoint hash (data.max_seq_len)."""
    from mlbench_kit.config import rename_old_keys, with_old_names
    from mlbench_kit.infer_config import InferConfig, Sampling
    from mlbench_kit.io import claim_run_folder
    from mlbench_kit.train.lora import LoRAFinetuneRecipe, _check_prep_budget
    from mlbench_kit.train_config import SPEED_KEYS, TrainConfig
    # train reads the budget of a manifest from before the rename
    prep = tmp_path / "prep"
    prep.mkdir()
    (prep / "manifest.json").write_text(json.dumps({"max_tokens": 8192, "model_positions": None}))
    cfg = _train(REPO_ROOT / "configs/train/tiny-cpu.yaml", "--prep-dir", str(prep))
    with pytest.raises(MLBenchError, match="prep cut the README context for 8192 tokens"):
        _check_prep_budget(cfg, 4096)
    # an infer folder written with sampling.max_tokens is the same run
    sampling = InferConfig().to_dict()["sampling"]
    old = {**sampling, "max_tokens": sampling.pop("max_new_tokens")}
    (tmp_path / "infer.json").write_text(json.dumps({"sampling": old, "split": "test"}))
    claim_run_folder(tmp_path / "infer.json", {"sampling": {**sampling, "max_new_tokens": 1024}, "split": "test"},
                     upgrade=lambda o: rename_old_keys(Sampling, o.get("sampling")))
    # a training run folder and checkpoint from before data.max_seq_len became data.max_context_tokens (and
    # before the speed levers existed: those keys were not in its config)
    recipe = LoRAFinetuneRecipe(cfg)
    before = with_old_names(TrainConfig, {k: v for k, v in cfg.to_dict().items() if k not in SPEED_KEYS})
    assert before["data"]["max_seq_len"] == 1024 and "max_context_tokens" not in before["data"]
    import hashlib
    same = {k: v for k, v in before.items() if k != "output_dir"}
    assert recipe.config_sha_before_rename == hashlib.sha256(json.dumps(same, sort_keys=True).encode()).hexdigest()[:16]
    (tmp_path / "run.json").write_text(json.dumps({"config": before}))
    claim_run_folder(tmp_path / "run.json", recipe.run_settings(),
                     upgrade=lambda o: rename_old_keys(TrainConfig, o.get("config")))
    assert _warnings(capsys.readouterr().err) == []  # reading records back is silent: nothing for a user to change


def test_a_folder_with_other_settings_names_the_keys_that_differ(tmp_path: Path):
    """The refusal says which keys differ, by their dotted names, with both values: not two whole configs."""
    from mlbench_kit.io import claim_run_folder
    config = {"policy": "ml-agent", "sampling": {"seed": 42, "top_k": 50}, "read": {"max_readme_chars": 8000}}
    claim_run_folder(tmp_path / "agent.json", {"config": config, "split": "full"})
    other = {**config, "sampling": {"seed": 43, "top_k": 50}, "read": {"max_readme_chars": 8000, "new_key": "x"}}
    with pytest.raises(MLBenchError) as err:
        claim_run_folder(tmp_path / "agent.json", {"config": other, "split": "full"})
    assert str(err.value).startswith(f'{tmp_path / "agent.json"}: this run folder was made with other settings: 2 '
                                     'differ: config.sampling.seed: 42 here, now 43; config.read.new_key: null here, '
                                     'now "x"\n')
    assert "max_readme_chars" not in str(err.value) and "top_k" not in str(err.value)
