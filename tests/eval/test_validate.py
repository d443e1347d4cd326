"""Gold-validation causes, on log tails taken from real runs of the 14 repositories' gold answers here."""

from __future__ import annotations

import pytest

from mlbench_kit.eval.envs.validate import classify, validate

RAN = {"params_ok": True, "type_ok": True, "passed": False, "timed_out": False, "exit_code": 1}

LOGS = [
    ("network", "raise URLError(err)\nurllib.error.URLError: <urlopen error [Errno -3] Temporary failure in name "
                "resolution>"),
    ("gpu", "train_mask.sh: line 11: nvidia-smi: command not found\n...\nfairseq-train: error: argument "
            "--update-freq: expected one argument"),
    ("gpu", "torch._C._cuda_init()\nRuntimeError: Found no NVIDIA driver on your system."),
    ("weights", "OSError: Model file not found: ./checkpoints/checkpoint_last_musicbert_base.pt"),
    ("data", "FileNotFoundError: [Errno 2] No such file or directory: 'data/amazon/train.txt'"),
    ("missing module", "from cnsenti import Sentiment\nModuleNotFoundError: No module named 'cnsenti'"),
    ("answer", "python: can't open file '/sandbox/work/examples/train_prcnet.py': [Errno 2] No such file or "
               "directory"),
    ("answer", "bash: interactive_1billion.sh: No such file or directory"),
    ("answer", "  File \"/sandbox/work/temp.py\", line 1\n    code:\n         ^\nSyntaxError: invalid syntax"),
    ("other", "AttributeError: Can't pickle local object 'main.<locals>.worker'"),
]


@pytest.mark.parametrize("cause, log", LOGS, ids=[f"{c}-{i}" for i, (c, _) in enumerate(LOGS)])
def test_causes_from_real_logs(cause: str, log: str) -> None:
    assert classify(RAN | {"log": log}, built=True)[0] == cause


def test_argument_needs_exit_2_and_checks_come_first() -> None:
    usage = "usage: main.py [-h]\nmain.py: error: unrecognized arguments: --foo"
    assert classify(RAN | {"log": usage, "exit_code": 2}, True)[0] == "argument"
    assert classify(RAN | {"log": usage, "exit_code": 1}, True)[0] == "other"
    assert classify(RAN | {"params_ok": False, "log": usage}, True)[0] == "check"
    assert classify(RAN | {"log": "", "timed_out": True}, True)[0] == "timeout"
    assert classify(RAN | {"log": "x"}, False, "pip failed") == ("not built", "pip failed")
    assert classify(RAN | {"passed": True}, True) == (None, "")


def test_a_known_gold_defect_is_the_answers_fault_with_its_reason() -> None:
    rec = RAN | {"github_id": 9, "id": 261, "log": "RuntimeError: expected input[50, 512, 7, 7] to have 3 channels"}
    row = {"github_id": 9, "id": 261, "repo": "External-Attention-pytorch", "type": "Python Code"}
    report = validate({"compat": [rec]}, [row], {"External-Attention-pytorch": None},
                      {("External-Attention-pytorch", 261): "GFNet takes 3-channel images"})
    assert report["rows"][0]["compat"]["cause"] == "answer"
    assert report["rows"][0]["compat"]["excerpt"] == "known gold defect: GFNet takes 3-channel images"
    assert validate({"compat": [rec]}, [row], {"External-Attention-pytorch": None})["rows"][0]["compat"]["cause"] \
        == "other"


def test_a_known_defect_that_compat_passed_by_timing_out_is_still_not_gold_valid(tmp_path) -> None:
    # 261 fails ~12 s in on 2 cores: compat's 10 s limit counts it a pass there, a faster machine a failure
    import json

    from mlbench_kit.eval.envs.validate import gold_valid, validation_markdown
    row = {"github_id": 9, "id": 261, "repo": "External-Attention-pytorch", "type": "Python Code"}
    timed_out = RAN | {"github_id": 9, "id": 261, "passed": True, "timed_out": True, "exit_code": None}
    report = validate({"compat": [timed_out]}, [row], {"External-Attention-pytorch": None},
                      {("External-Attention-pytorch", 261): "GFNet takes 3-channel images"})
    assert report["rows"][0]["compat"]["passed"]
    assert report["per_repo"]["External-Attention-pytorch"]["compat_pass"] == 1
    (tmp_path / "validation.json").write_text(json.dumps(report))
    assert gold_valid(tmp_path / "validation.json") == {(9, 261): "answer"}
    assert "| 9 | 261 | External-Attention-pytorch | pass | known gold defect: GFNet" in \
        validation_markdown(report, {"External-Attention-pytorch": None})


def test_validation_md_shows_control_characters_and_html_as_text() -> None:
    """Issue 30 item 7: a gold answer's log is untrusted; its excerpt went raw into validation.md (ESC, CR, HTML)."""
    from mlbench_kit.eval.envs.validate import validation_markdown
    log = "\x1b[31mFileNotFoundError: No such file or directory <script>alert(1)</script>\rdone\x07 | x"
    row = {"github_id": 9, "id": 1, "repo": "toybench", "type": "Python Code"}
    report = validate({"compat": [RAN | {"github_id": 9, "id": 1, "log": log}]}, [row], {"toybench": None})
    md = validation_markdown(report, {"toybench": None})
    assert "\x1b" not in md and "\r" not in md and "\x07" not in md and "<script>" not in md
    assert "| 9 | 1 | toybench | data | \\x1b\\[31mFileNotFoundError: No such file or directory " \
           "&lt;script&gt;alert(1)&lt;/script&gt;\\rdone\\x07 \\| x |" in md
