"""One home for a model's facts: its context length (mlbench_kit.hf.model_positions) and its tokenizer
(mlbench_kit.hf.load_tokenizer). Prep, train, infer and the sweep check read them there, and agree."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from conftest import REPO_ROOT

from mlbench_kit.cli import stage_config, stage_parser
from mlbench_kit.errors import MLBenchError

SAMPLE = REPO_ROOT / "examples" / "sample" / "samples.jsonl"
CODE = ["data_prep", "train", "infer", "eval", "slurm", "mlbench_kit"]


@pytest.fixture(scope="module")
def model_700(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_dir: Path) -> Path:
    """A tiny Llama folder (the tests' own builder) with 700 positions: no stage's default budget fits it."""
    from tiny import build_llama
    return build_llama(tiny_tokenizer_dir, tmp_path_factory.mktemp("m700"), hidden=64, layers=1, heads=2,
                       max_positions=700)


def test_positions_and_tokenizers_are_read_in_one_place_only() -> None:
    # before: prep, train (model.py's max_positions) and infer each read max_position_embeddings themselves, and
    # infer and the merge loaded tokenizers with AutoTokenizer beside mlbench_kit.hf's loader
    found = []
    for folder in CODE:
        for f in sorted((REPO_ROOT / folder).rglob("*.py")):
            if f == REPO_ROOT / "mlbench_kit" / "hf.py":
                continue
            for n, line in enumerate(f.read_text().splitlines(), 1):
                if re.search(r"max_position_embeddings|\bn_positions\b|AutoTokenizer", line):
                    found.append(f"{f.relative_to(REPO_ROOT)}:{n}: {line.strip()}")
    assert found == []


def test_every_stage_uses_the_core_model_positions() -> None:
    from mlbench_kit import hf
    from mlbench_kit.data_prep import prepare
    from mlbench_kit.infer import run
    from mlbench_kit.slurm import render
    from mlbench_kit.train import lora
    assert prepare.model_positions is hf.model_positions and run.model_positions is hf.model_positions
    assert render.model_positions is hf.model_positions
    assert prepare.load_tokenizer is hf.load_tokenizer and run.load_tokenizer is hf.load_tokenizer
    import inspect
    assert "model_positions(" in inspect.getsource(lora.context_budget)


def test_model_positions_reads_configs_folders_and_says_none_when_unknown(model_700, tiny_tokenizer_dir,
                                                                          tmp_path) -> None:
    from transformers import AutoConfig, GPT2Config

    from mlbench_kit.hf import model_positions
    assert model_positions(model_700) == model_positions(str(model_700), local_only=True) == 700
    assert model_positions(AutoConfig.from_pretrained(model_700)) == 700
    assert model_positions({"max_position_embeddings": 4096}) == 4096
    assert model_positions(GPT2Config(n_positions=1024)) == 1024  # GPT-2 names it n_positions
    assert model_positions(tiny_tokenizer_dir) is None  # a tokenizer alone: no model config beside it
    assert model_positions("no-such-org/no-such-model", local_only=True) is None
    assert model_positions(tmp_path / "missing") is None


def test_model_positions_reads_config_json_as_data_from_a_folder_and_the_hub_cache(model_700, tmp_path) -> None:
    # `sweep plan` asks for every model's positions; importing transformers for AutoConfig made each plan ~5 s
    import subprocess
    import sys
    snapshot = tmp_path / "hub" / "models--org--m700" / "snapshots" / ("a" * 40)
    snapshot.mkdir(parents=True)
    blobs = tmp_path / "hub" / "models--org--m700" / "blobs"  # the hub's layout: the snapshot links to its blob
    blobs.mkdir()
    (blobs / "b1").write_bytes((model_700 / "config.json").read_bytes())
    (snapshot / "config.json").symlink_to("../../blobs/b1")
    # a snapshot linking out of its repository's folder is not read (then transformers decides, as before)
    outside = tmp_path / "hub" / "models--org--out" / "snapshots" / ("a" * 40)
    outside.mkdir(parents=True)
    (outside / "config.json").symlink_to(model_700 / "config.json")
    (tmp_path / "hub" / "models--org--out" / "refs").mkdir()
    (tmp_path / "hub" / "models--org--out" / "refs" / "main").write_text("a" * 40)
    (tmp_path / "hub" / "models--org--m700" / "refs").mkdir()
    (tmp_path / "hub" / "models--org--m700" / "refs" / "main").write_text("a" * 40)
    code = ("import sys; from mlbench_kit.hf import model_positions; "
            f"print(model_positions({str(model_700)!r}), model_positions('org/m700', local_only=True), "
            "model_positions('org/absent', local_only=True), 'transformers' in sys.modules); "
            "from mlbench_kit.hf import _cached_config; print(_cached_config('org/out'))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**__import__("os").environ, "HF_HUB_CACHE": str(tmp_path / "hub")})
    assert r.stdout.split() == ["700", "700", "None", "False", "None"], r.stdout + r.stderr


def test_prep_train_infer_and_the_sweep_check_agree_on_a_model_s_positions(model_700, tmp_path,
                                                                             capsys) -> None:

    from transformers import AutoConfig

    from mlbench_kit.data_prep import prepare
    from mlbench_kit.infer.run import context_length
    from mlbench_kit.slurm.render import check_jobs, jobs
    from mlbench_kit.slurm.spec import load_sweep
    from mlbench_kit.train.lora import context_budget
    # prep: the budget (4,096 asked) and the room for new tokens, both from the model's 700 positions
    p = stage_parser("prep")
    out = tmp_path / "prep"
    assert prepare.run(p.parse_args(["--data", str(SAMPLE), "--splits", "full", "--tasks", "3", "--template",
                                     "llama-inst", "--tokenizer", str(model_700), "--max-context-tokens", "4096",
                                     "--max-new-tokens", "200", "--splitter", "regex", "--no-hf", "--out",
                                     str(out)])) == 0
    manifest = json.loads((out / "manifest.json").read_text())
    assert (manifest["model_positions"], manifest["max_context_tokens"], manifest["max_prompt_tokens"]) == (700, 700,
                                                                                                             500)
    # train: data.max_context_tokens 8,192 capped at the same 700
    cfg = stage_config("train", ["--config", str(REPO_ROOT / "configs/train/codellama-7b-instruct.yaml"), "--model",
                                 str(model_700)])
    tokens, positions, note = context_budget(cfg, AutoConfig.from_pretrained(model_700))
    assert (tokens, positions) == (700, 700) and "capped at the model's 700 positions" in note
    # infer: vLLM's max_model_len never above them
    with pytest.raises(MLBenchError, match="above the model's 700 positions"):
        context_length(stage_config("infer", ["--max-model-len", "800"]), 10, positions)
    # the sweep check: prep's room for new tokens must fit in the same 700 positions, or `sweep plan` says so
    spec = yaml.safe_load((REPO_ROOT / "configs/sweeps/tiny-cpu.yaml").read_text())
    for room, ok in ((699, True), (700, False)):
        spec["models"] = {"m700": {"path": str(model_700), "train_config": "configs/train/tiny-cpu.yaml",
                                   "prep": {"max_new_tokens": room}}}
        f = tmp_path / "s.yaml"
        f.write_text(yaml.safe_dump(spec, sort_keys=False))
        sweep = load_sweep(f, REPO_ROOT)
        if ok:
            check_jobs(sweep, jobs(sweep))
            continue
        with pytest.raises(MLBenchError) as e:
            check_jobs(sweep, jobs(sweep))
        line = next(i for i, ln in enumerate(f.read_text().splitlines(), 1) if "max_new_tokens: 700" in ln)
        assert "has 700 positions" in e.value.what and e.value.where == f"{f}:{line}", (e.value.what, e.value.where)
    # and prep itself refuses the same room, for the same reason
    with pytest.raises(MLBenchError, match="700 positions"):
        prepare.run(p.parse_args(["--data", str(SAMPLE), "--splits", "full", "--tasks", "3", "--tokenizer",
                                  str(model_700), "--max-new-tokens", "700", "--splitter", "regex", "--no-hf",
                                  "--out", str(tmp_path / "prep2")]))
