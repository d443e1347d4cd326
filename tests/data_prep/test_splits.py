import dataclasses

import pytest

from mlbench_kit.data_prep.splits import build_splits
from mlbench_kit.dataset import check_no_leak, load_samples
from mlbench_kit.errors import MLBenchError


def test_id_ood_splits_from_real_rows(shared):
    samples = load_samples(shared / "full.jsonl")
    sp = build_splits(samples, ["bert", "muzic"], seed=1)
    keys = {n: {s.key for s in rows} for n, rows in sp.items()}
    assert sum(len(k) for k in keys.values()) == 260
    assert not (keys["test"] & keys["id_train"]) and not (keys["test"] & keys["ood_train"])
    assert {s.repo for s in sp["ood_train"]} == {"bert", "muzic"}
    assert {s.repo for s in sp["id_train"]} <= {s.repo for s in sp["test"]}  # every ID-train repo is tested
    assert not {s.repo for s in sp["test"]} & {"bert", "muzic"}
    assert build_splits(samples, ["bert"], seed=1)["test"] != build_splits(samples, ["bert"], seed=2)["test"]


def test_leak_check_catches_a_shared_answer(shared):
    samples = load_samples(shared / "full.jsonl")
    train = [dataclasses.replace(samples[5], id=9999, instruction="something else entirely")]
    with pytest.raises(MLBenchError, match="1 test answer"):
        check_no_leak(train, samples[:10])
    with pytest.raises(MLBenchError, match="--ood-repos names repositories not in the data"):
        build_splits(samples, ["not-a-repo"])
