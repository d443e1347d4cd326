"""`mlbench prep` checks everything it needs before writing, and its output folder appears whole or not at all."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import run_cli

from mlbench_kit.cli import main, stage_parser
from mlbench_kit.data_prep import prepare
from mlbench_kit.errors import MLBenchError
from mlbench_kit.flags import resolve
from mlbench_kit.stages import stage


def _no_punkt_env(tmp_path: Path) -> dict[str, str]:
    """Variables under which NLTK finds no Punkt model (an empty NLTK_DATA and home); skips where a system
    folder (/usr/share/nltk_data, ...) has one anyway."""
    empty = tmp_path / "empty"
    empty.mkdir()
    env = {"NLTK_DATA": str(empty), "HOME": str(empty)}
    probe = subprocess.run([sys.executable, "-c", "import nltk; nltk.data.find('tokenizers/punkt_tab/english/')"],
                           env={"PATH": "/usr/bin:/bin", **env}, capture_output=True)
    if probe.returncode == 0:
        pytest.skip("a system-wide NLTK folder has Punkt")
    return env


def test_prep_without_punkt_fails_before_writing_anything(shared: Path, tmp_path: Path) -> None:
    # before: task 1 was written (task1.jsonl) and then task 2 failed, leaving half a folder without a manifest
    out = tmp_path / "runs" / "prep"
    r = run_cli("mlbench", "prep", "--data", shared / "full.jsonl", "--splits", "full", "--readmes",
                shared / "readmes", "--tasks", "1", "2", "3", "--no-hf", "--out", out, env=_no_punkt_env(tmp_path))
    assert r.returncode == 2, r.stderr
    assert not out.exists() and not (tmp_path / "runs").exists(), list(tmp_path.rglob("*"))
    assert "Punkt model (punkt_tab)" in r.stderr and "NLTK_DATA=" in r.stderr
    assert "python3 -m nltk.downloader" in r.stderr and "shared/mlbench/nltk_data" in r.stderr


def test_a_row_without_readme_fails_before_writing(shared: Path, tmp_path: Path) -> None:
    readmes = tmp_path / "readmes"
    # every esm row loses its README (left out of the copy: the shared data has no write bits, so a copy of it
    # cannot be pruned by a user who is not root)
    shutil.copytree(shared / "readmes", readmes, ignore=lambda d, names: ["esm"] if Path(d) == shared / "readmes"
                    else [])
    out = tmp_path / "prep"
    with pytest.raises(MLBenchError) as e:
        prepare.prepare(resolve(stage("prep"), _args(shared, readmes, out, ["1", "3"])))
    assert "no README found for" in e.value.what and "esm" in e.value.what and e.value.where == str(readmes)
    assert not out.exists() and list(tmp_path.iterdir()) == [readmes]


def _args(shared: Path, readmes: Path, out: Path, tasks: list[str]):
    return stage_parser("prep").parse_args(["--data", str(shared / "full.jsonl"), "--splits", "full", "--readmes",
                                            str(readmes), "--tasks", *tasks, "--no-hf", "--splitter", "regex",
                                            "--out", str(out)])


def test_a_failure_while_writing_leaves_the_old_folder_as_it_was(shared: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    out = tmp_path / "prep"
    args = ["prep", "--data", str(shared / "full.jsonl"), "--splits", "full", "--readmes", str(shared / "readmes"),
            "--tasks", "1", "3", "--no-hf", "--splitter", "regex", "--out", str(out)]
    assert main(args) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.yaml", "full", "manifest.json", "stats.json", "stats.md"]
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}

    real = prepare.Renderer.render_task

    def render_task(self, samples, task, **kw):
        if task == 3:
            raise KeyboardInterrupt  # killed after task 1 was rendered and written
        return real(self, samples, task, **kw)

    monkeypatch.setattr(prepare.Renderer, "render_task", render_task)
    assert main(args) == 130  # the CLI's answer to an interrupt
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before  # no staging folder left either
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prep"]
    # into a new folder: nothing at all
    new = tmp_path / "new"
    assert main([*args[:-1], str(new)]) == 130
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prep"]

    # a second successful run replaces the files it writes and keeps the others; the manifest is the new run's
    monkeypatch.setattr(prepare.Renderer, "render_task", real)
    (out / "notes.txt").write_text("mine")
    assert main([*args[:7], "--tasks", "3", *args[10:]]) == 0
    assert json.loads((out / "manifest.json").read_text())["tasks"] == [3]
    assert (out / "notes.txt").read_text() == "mine" and not [p for p in out.iterdir() if p.name.startswith(".")]


@pytest.mark.user
def test_an_unwritable_output_folder_fails_before_any_work(tmp_path: Path) -> None:
    import os
    (tmp_path / "file").write_text("")
    with pytest.raises(MLBenchError, match="--out is a file"):
        prepare._check_out(tmp_path / "file")
    if os.geteuid() == 0:
        pytest.skip("root writes anywhere")
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    with pytest.raises(MLBenchError) as e:
        prepare._check_out(locked / "prep")
    assert "not writable" in e.value.what and e.value.where == str(locked / "prep")


def test_prep_without_out_names_the_flag_and_an_example(capsys: pytest.CaptureFixture) -> None:
    # before: "error: defaults: no `out` given"
    assert main(["prep"]) == 2
    first, fix = capsys.readouterr().err.splitlines()[:2]
    assert first.startswith("error: missing --out: mlbench prep needs --out DIR"), first
    assert fix.startswith("  fix: e.g. mlbench prep --data ") and "--out runs/prep" in fix
