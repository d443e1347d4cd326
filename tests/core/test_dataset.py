import json
import subprocess
import sys
from pathlib import Path

import pytest

from mlbench_kit.dataset import load_samples, parse_arguments
from mlbench_kit.errors import MLBenchError


def test_loads_real_test_split(shared):
    samples = load_samples(shared / "full.jsonl")
    assert len(samples) == 260
    assert len({s.repo for s in samples}) == 14
    assert sum(s.type == "Bash Script" for s in samples) == 171
    first = samples[0]
    assert first.repo == "dgl" and first.arguments == {"dataset": "Citeseer", "lr": "0", "num-stacks": "5"}


def _write(tmp_path, rows, raw_lines=()):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + "".join(raw_lines))
    return path


@pytest.mark.parametrize("mutate, message", [
    (lambda r: r.pop("oracle"), "missing column(s) oracle"),
    (lambda r: r.update(type="Shell"), "unknown type 'Shell'"),
    (lambda r: r.update(arguments="{'a': foo()}"), "not a Python-literal dict"),
    (lambda r: r.update(arguments="['a']"), "must be a dict"),
    (lambda r: r.update(id="x"), "`id` must be an integer"),
    # a repository name or path from a row is data: nothing outside its repository can be named (issue 30)
    (lambda r: r.update(github="https://github.com/x/.."), "names the repository '..'"),
    (lambda r: r.update(github="https://github.com/x/../"), "names the repository '..'"),
    (lambda r: r.update(github="https://github.com/x/."), "names the repository '.'"),
    (lambda r: r.update(path="./../.."), "leaves the repository"),
    (lambda r: r.update(path="examples/../../../etc"), "leaves the repository"),
    (lambda r: r.update(path="/etc"), "leaves the repository"),
    # every argument is a pass over each output in strict mode: a row's count and size are bounded (issue 30)
    (lambda r: r.update(arguments=repr({f"a{i}": str(i) for i in range(257)})), "names 257 parameters"),
    (lambda r: r.update(arguments="{'a': '" + "x" * 70000 + "'}"), "holds 70009 characters"),
    (lambda r: r.update(arguments={"a": "x" * 70000}), "holds more than 65536 characters"),
    (lambda r: r.update(arguments="[" * 60000), "not a Python-literal dict"),
])
def test_bad_rows_name_file_and_line(tmp_path, full_rows, mutate, message):
    rows = [dict(full_rows[0]), dict(full_rows[1])]
    mutate(rows[1])
    path = _write(tmp_path, rows)
    with pytest.raises(MLBenchError) as exc:
        load_samples(path)
    assert message in str(exc.value) and f"{path}:2" in str(exc.value)


def test_arguments_are_never_evaluated(tmp_path):
    marker = tmp_path / "pwned"
    with pytest.raises(MLBenchError):
        parse_arguments(f"__import__('pathlib').Path({str(marker)!r}).touch()", "x:1")
    assert not marker.exists()


def test_bad_json_and_duplicates(tmp_path, full_rows):
    path = _write(tmp_path, full_rows[:2], ['{"github_id": 1, oops}\n'])
    with pytest.raises(MLBenchError, match=r"d.jsonl:3: bad JSON"):
        load_samples(path)
    path = _write(tmp_path, [full_rows[0], full_rows[0]])
    with pytest.raises(MLBenchError, match=r"d.jsonl:2: duplicate sample"):
        load_samples(path)


def test_cli_exits_2_with_one_message(tmp_path, full_rows):
    bad = dict(full_rows[0], type="Nope")
    path = _write(tmp_path, [bad])
    out = tmp_path / "out"
    res = subprocess.run([sys.executable, "-m", "mlbench_kit.cli", "prep", "--data", str(path), "--splits", "test",
                          "--tasks", "3", "--out", str(out)], capture_output=True, text=True)
    assert res.returncode == 2
    assert f"{path}:1: unknown type 'Nope'" in res.stderr and "Traceback" not in res.stderr
    assert not out.exists()  # nothing half-written


def test_parquet_and_save_to_disk_and_aliases(tmp_path, full_rows):
    import datasets
    rows = [dict(r) for r in full_rows[:5]]
    for r in rows:  # the older column names of the benchmark's scripts
        r["instructions"] = r.pop("instruction")
    ds = datasets.Dataset.from_list(rows)
    ds.to_parquet(str(tmp_path / "x.parquet"))
    datasets.DatasetDict({"full": ds}).save_to_disk(str(tmp_path / "dd"))
    a = load_samples(tmp_path / "x.parquet")
    b = load_samples(tmp_path / "dd", "full")
    assert a == b and len(a) == 5 and a[0].instruction == full_rows[0]["instruction"]
    with pytest.raises(MLBenchError, match="split 'quarter' not in this DatasetDict"):
        load_samples(tmp_path / "dd", "quarter")


def test_hub_offline_says_how_to_pass_a_local_file(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(MLBenchError) as exc:
        load_samples("super-dainiu/ml-bench", "full")
    assert "--data path/to/full.jsonl" in str(exc.value)
    with pytest.raises(MLBenchError, match="unknown split"):
        load_samples("super-dainiu/ml-bench", "nope")


def test_yaml_aliases_cannot_multiply_a_config(tmp_path):
    """Issue 30 item 7: a 406-byte billion-laughs config took 36 s and 3.7 GB; it is refused in linear time, and
    an alias that only repeats a value (as the PyTorch-GAN recipe's) is still read."""
    import time

    from mlbench_kit.config import read_yaml
    laughs = ["a: &a [x, x, x, x, x, x, x, x, x, x]"]
    for i, name in enumerate("bcdefghi"):
        prev = "abcdefghi"[i]
        laughs.append(f"{name}: &{name} [*{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, *{prev}, "
                      f"*{prev}, *{prev}]")
    path = tmp_path / "bomb.yaml"
    path.write_text("\n".join(laughs) + "\n")
    t0 = time.monotonic()
    with pytest.raises(MLBenchError, match="expands to more than"):
        read_yaml(path)
    assert time.monotonic() - t0 < 5
    ok = tmp_path / "ok.yaml"
    ok.write_text("x: &v >-\n  long value\ny: *v\nz: [*v, *v]\n")
    assert read_yaml(ok)[0] == {"x": "long value", "y": "long value", "z": ["long value", "long value"]}


SAMPLE_ROWS = Path(__file__).resolve().parents[2] / "examples" / "sample" / "samples.jsonl"


def test_a_file_refuses_a_split_it_does_not_hold(tmp_path):
    """`--split tset` on a JSONL file was scored and recorded as split "tset" (prep wrote tset/task3.jsonl)."""
    with pytest.raises(MLBenchError, match=r"unknown split 'tset'.*full, quarter, test, id_train, ood_train, "
                                           r"samples"):
        load_samples(SAMPLE_ROWS, "tset")
    assert len(load_samples(SAMPLE_ROWS, "test")) == len(load_samples(SAMPLE_ROWS, "samples")) == 53
    for argv in (["eval", "--data", SAMPLE_ROWS, "--split", "tset", "--gold", "--out", tmp_path / "eval"],
                 ["prep", "--data", SAMPLE_ROWS, "--splits", "tset", "--tasks", "3", "--no-hf", "--out",
                  tmp_path / "prep"]):
        res = subprocess.run([sys.executable, "-m", "mlbench_kit.cli", *map(str, argv)], capture_output=True,
                             text=True)
        assert res.returncode == 2, res.stderr
        assert f"error: {SAMPLE_ROWS}: unknown split 'tset'" in res.stderr and "Traceback" not in res.stderr
        assert res.stderr.count("error:") == 1
    assert not (tmp_path / "eval").exists() and not (tmp_path / "prep").exists()

