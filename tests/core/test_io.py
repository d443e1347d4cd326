"""Reading the JSON files a run folder holds (results.jsonl, transcripts, stages.json, run.json): every one is
untrusted, so a line nested too deeply, a number too long for Python, bytes that are not UTF-8 or a line of any size
is one error naming file:line, never a traceback (RecursionError, ValueError, UnicodeDecodeError) nor a read of the
whole file into memory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import REPO_ROOT, SAMPLE, run_cli

from mlbench_kit import io
from mlbench_kit.errors import MLBenchError
from mlbench_kit.io import read_jsonl, read_log_lines
from mlbench_kit.records import EvalResult, read_eval_results

NESTED = '{"a": ' + "[" * 100_000 + "]" * 100_000 + "}"
LONG_INT = '{"a": ' + "1" * 5000 + "}"  # over Python's 4300-digit limit: ValueError, not JSONDecodeError
GOOD = json.dumps(EvalResult(1, 2, 0, "r", "Bash Script", "0" * 16, "strict", {}, True, True, passed=True).to_json())


@pytest.mark.parametrize("bad, what", [(NESTED, "nested too deeply"), (LONG_INT, "bad JSON"),
                                       (b"{\"a\": \"\xff\"}", "not UTF-8")], ids=["nested", "long-int", "bytes"])
def test_a_bad_line_is_one_error_at_file_line_in_every_reader(tmp_path: Path, bad: str | bytes, what: str):
    f = tmp_path / "results.jsonl"
    body = bad.encode() if isinstance(bad, str) else bad
    f.write_bytes(GOOD.encode() + b"\n" + body + b"\n" + GOOD.encode() + b"\n")
    with pytest.raises(MLBenchError, match=what) as exc:
        list(read_jsonl(f))
    assert exc.value.where == f"{f}:2"
    # the append-only log readers (results.jsonl): a bad line in the middle is corrupt, named by its line
    for read in (read_log_lines, read_eval_results):
        with pytest.raises(MLBenchError, match=f"corrupt record in the middle of a results log: .*{what}") as exc:
            read(f)
        assert exc.value.where == f"{f}:2"
    # as the last line it is a torn tail of a killed writer: left out, the records before it kept
    f.write_bytes(GOOD.encode() + b"\n" + body)
    assert [r.key for r in read_eval_results(f)] == [(1, 2)]


def test_a_line_over_the_cap_is_refused_without_reading_it_whole(tmp_path: Path, monkeypatch):
    monkeypatch.setattr(io, "MAX_RECORD_BYTES", 1000, raising=False)
    f = tmp_path / "t.jsonl"
    f.write_text(GOOD + "\n" + json.dumps({"a": "x" * 990}) + "\n" + json.dumps({"a": "x" * 5000}) + "\n")
    for read in (lambda p: list(read_jsonl(p)), read_log_lines):
        with pytest.raises(MLBenchError, match="a line over 1000 bytes") as exc:
            read(f)
        assert exc.value.where == f"{f}:3"
    f.write_text(GOOD + "\n" + json.dumps({"a": "x" * 990}) + "\n")  # 1000 bytes and its "\n": read
    assert len(list(read_jsonl(f))) == 2 and len(read_log_lines(f)) == 2


def test_read_json_names_what_is_wrong_with_a_small_record(tmp_path: Path):
    read_json = io.read_json
    f = tmp_path / "stages.json"
    for text, what, where in (('{\n "prep": 1.0,\n "infer": }', "bad JSON", f"{f}:3"),
                              (NESTED, "nested too deeply", str(f)), (LONG_INT, "bad JSON", str(f))):
        f.write_text(text)
        with pytest.raises(MLBenchError, match=what) as exc:
            read_json(f)
        assert exc.value.where == where
    f.write_text('{"prep": 1.0}')
    assert read_json(f) == {"prep": 1.0}
    with pytest.raises(MLBenchError, match="larger than 5 bytes"):
        read_json(f, limit=5)
    link = tmp_path / "link.json"
    link.symlink_to(f)
    with pytest.raises(MLBenchError, match="a link"):
        read_json(link)


def test_a_damaged_stages_json_or_run_json_is_one_error_and_nothing_is_written(tmp_path: Path):
    """`mlbench run` read its folder's stages.json and run.json with a bare json.loads: a damaged one was a
    traceback (exit 1), after run.json and config.yaml were written."""
    out = tmp_path / "run"
    out.mkdir()
    args = ["mlbench", "run", "--model", tmp_path, "--data", SAMPLE / "samples.jsonl", "--envs",
            REPO_ROOT / "configs" / "eval" / "sample.yaml", "--out", out]
    (out / "stages.json").write_text('{\n  "prep": 3.5,\n  "infer": \n}\n')
    r = run_cli(*args)
    assert r.returncode == 2 and f"{out / 'stages.json'}:4: bad JSON" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and sorted(p.name for p in out.iterdir()) == ["stages.json"]
    (out / "stages.json").write_text('["prep"]')
    r = run_cli(*args)
    assert r.returncode == 2 and "stages.json is not an object of stage names" in r.stderr, r.stderr
    (out / "stages.json").unlink()
    (out / "run.json").write_text(NESTED)
    r = run_cli(*args)
    assert r.returncode == 2 and f"{out / 'run.json'}: bad JSON (nested too deeply)" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr and sorted(p.name for p in out.iterdir()) == ["run.json"]


def test_an_append_log_that_is_a_link_is_refused_and_its_target_left_alone(tmp_path: Path):
    """A run folder's results.jsonl (or generations, transcript) that is a link to a file outside: resuming the run
    appended records to that file (and cut its last line when it did not end in a newline)."""
    from mlbench_kit.io import AppendLog
    target = tmp_path / "bashrc"
    target.write_text("export KEEP=1")
    log = tmp_path / "run" / "results.jsonl"
    log.parent.mkdir()
    log.symlink_to(target)
    with pytest.raises(MLBenchError, match="this log is a link") as exc:
        AppendLog(log)
    assert exc.value.where == str(log) and target.read_text() == "export KEEP=1"
    # a torn last line is cut (reading back from the end in chunks), the next record starts clean
    f = tmp_path / "r.jsonl"
    for before, after in ((b'{"a": 1}\n{"a": 2', b'{"a": 1}\n'), (b'{"a": 1}\n', b'{"a": 1}\n'),
                          (b'{"a": "' + b"x" * 200_000 + b'"}\n' + b"y" * 150_000, None), (b"torn", b"")):
        f.write_bytes(before)
        with AppendLog(f) as appended:
            appended.append({"b": 3})
        want = (after if after is not None else before[: before.rfind(b"\n") + 1]) + b'{"b": 3}\n'
        assert f.read_bytes() == want
