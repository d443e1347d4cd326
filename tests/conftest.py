"""Shared fixtures: the real ML-Bench data in ../shared/mlbench and a tokenizer trained offline on it."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("MLBENCH_SHARED", REPO_ROOT.parent / "shared" / "mlbench"))


@pytest.fixture(scope="session")
def shared() -> Path:
    if not (SHARED / "full.jsonl").is_file():
        pytest.skip(f"real ML-Bench data not found at {SHARED} (set MLBENCH_SHARED)")
    os.environ["NLTK_DATA"] = str(SHARED / "nltk_data")
    return SHARED


@pytest.fixture(scope="session")
def full_rows(shared: Path) -> list[dict]:
    return [json.loads(line) for line in (shared / "full.jsonl").open()]


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory, full_rows: list[dict]) -> Path:
    from mlbench_kit.tiny import build_tokenizer
    texts = [r["instruction"] + "\n" + r["oracle"] + "\n" + r["output"] for r in full_rows]
    return build_tokenizer(texts, tmp_path_factory.mktemp("tok"), vocab_size=1500)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_tokenizer_dir: Path):
    from mlbench_kit.data_prep.truncate import load_tokenizer
    return load_tokenizer(str(tiny_tokenizer_dir))
