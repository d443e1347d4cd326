"""Training data that cannot be used says which step makes it usable."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import SAMPLE

from mlbench_kit.cli import main
from mlbench_kit.errors import MLBenchError
from mlbench_kit.train.data import load_examples


def test_no_usable_records_says_which_prep_to_run(tiny_tokenizer, tmp_path: Path) -> None:
    # before: "no training records fit ... fix: check the prep output and data.max_context_tokens" in both cases
    assert main(["prep", "--data", str(SAMPLE / "samples.jsonl"), "--splits", "full", "--tasks", "3", "--no-hf",
                 "--out", str(tmp_path / "prep")]) == 0
    path = tmp_path / "prep" / "full" / "task3.jsonl"
    with pytest.raises(MLBenchError) as e:
        load_examples(path, tiny_tokenizer, "paper", 8)
    assert "all 53 are longer than max_context_tokens 8" in e.value.what
    assert "--tokenizer" in str(e.value.fix) and "--max-context-tokens 8" in str(e.value.fix)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(MLBenchError) as e:
        load_examples(empty, tiny_tokenizer, "paper", 8)
    assert "the prep output is empty" in e.value.what and "re-run mlbench prep" in str(e.value.fix)
