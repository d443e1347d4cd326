import json
import os
import shutil

import pytest
import yaml
from conftest import REPO_ROOT, assert_shared_modes

from mlbench_kit.cli import main

SAMPLE = REPO_ROOT / "examples" / "sample" / "samples.jsonl"
ENVS = REPO_ROOT / "configs" / "eval" / "sample.yaml"
pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")


def _gens(tmp_path):
    rows = [json.loads(x) for x in SAMPLE.open()]
    lines = []
    for r in rows:
        good = r["output"]
        outs = ["echo hello", good, good, "python train.py --dataset nope", good] if r["type"] == "Bash Script" \
            else ["raise SystemExit(3)", good, good + "\nprint(", good, good]
        lines.append({"github_id": r["github_id"], "id": r["id"], "output": outs})
    path = tmp_path / "gens.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    return path, len(rows)


def _eval(gens, out, *extra):
    return main(["eval", "--data", str(SAMPLE), "--generations", str(gens), "--envs", str(ENVS), "--out", str(out),
                 "--no-ci", *extra])


def test_scores_resumes_and_rescores(tmp_path, capsys, umask_022):
    gens, n_rows = _gens(tmp_path)
    out = tmp_path / "run"
    assert _eval(gens, out) == 0
    assert_shared_modes(*(out / n for n in ("summary.json", "report.md", "results.jsonl", "run.json")))
    s = json.loads((out / "summary.json").read_text())["metrics"]["overall"]
    assert s["samples"] == n_rows and s["pass@1"] == 0.0 and s["pass@2"] == 1.0 and s["pass@5"] == 1.0
    assert s["unbiased_pass@1"] == pytest.approx(3 / 5)  # 3 of 5 outputs pass for every row, bash or Python
    n_bash = sum(json.loads(x)["type"] == "Bash Script" for x in SAMPLE.open())
    assert s["error_classes"]["E1"] >= n_bash  # "echo hello" is not a script
    res = [json.loads(x) for x in (out / "results.jsonl").open()]
    assert len(res) == 5 * n_rows and sum(r["cached"] for r in res) >= 2 * n_rows  # duplicates ran once
    syntax = [r for r in res if r["type"] == "Python Code" and r["idx"] == 2]
    assert syntax and all(r["error_class"] == "E4" for r in syntax)
    # a killed run: drop the tail and leave a torn line; the re-run only does what is missing
    lines = (out / "results.jsonl").read_text().splitlines(keepends=True)
    (out / "results.jsonl").write_text("".join(lines[:-7]) + lines[-7][:20])
    capsys.readouterr()
    assert _eval(gens, out) == 0
    err = capsys.readouterr().err
    # exactly the 7 dropped generations were scored again, each distinct execution once (the kept records were
    # not run again); identical ones among the 7 are reused, and outputs the static checks reject never run
    dropped = [json.loads(x) for x in lines[-7:]]
    paths = {(r["github_id"], r["id"]): r["path"] for r in map(json.loads, SAMPLE.open())}
    ran = [(r["repo"], paths[r["github_id"], r["id"]], r["output_sha"]) for r in dropped if r["executed"]]
    passed = sum(r["passed"] for r in dropped)
    assert (f"eval: executed {len(set(ran))} (reused {len(ran) - len(set(ran))}); {passed}/7 new generations "
            f"passed; {len(lines) - 7} done before") in err, err
    res2 = [json.loads(x) for x in (out / "results.jsonl").open()]
    assert sorted((r["id"], r["idx"]) for r in res2) == sorted((r["id"], r["idx"]) for r in res)
    assert _eval(gens, out) == 0
    assert "executed 0 (reused 0); 0/0 new" in capsys.readouterr().err
    assert _eval(gens, out, "--rescore") == 0
    assert "Pass@2 1.000" in capsys.readouterr().err
    assert _eval(gens, out, "--mode", "strict") == 2  # other settings: refuse to mix in one folder


def test_strict_mode_static_gate(tmp_path):
    gens, _ = _gens(tmp_path)
    out = tmp_path / "strict"
    assert _eval(gens, out, "--mode", "strict", "--static-gate") == 0
    res = [json.loads(x) for x in (out / "results.jsonl").open()]
    bad = [r for r in res if r["idx"] == 3 and r["cli"] is not None]
    assert len(bad) >= 10  # rows under ./examples/gnn have no train.py there: nothing to check statically
    assert all(not r["passed"] and r["cli"]["invalid_choices"] == ["--dataset=nope (choices: cora, citeseer, pubmed)"]
               for r in bad)
    assert "strict mode" in (out / "report.md").read_text()


@pytest.mark.parametrize("line, message", [
    ('{"github_id": 101, "id": 1, "output": ["x"]}', "unknown sample github_id=101 id=1"),
    ('{"github_id": 101, "id": 9001, "output": [1, 2]}', "must be a non-empty list of strings"),
    ('{"github_id": 101, "id": 9001, "output": ["a"]}\n{"github_id": 101, "id": 9001, "output": ["a"]}',
     "duplicate line"),
    ('{"github_id": 101, "id": 9001, "output": ["a"]', "bad JSON"),
    ('{"github_id": 101, "id": 1e400, "output": ["a"]}', "integer `github_id` and `id`"),  # crashed: OverflowError
    ('{"github_id": 101, "id": 9001, "output": ' + "[" * 100_000 + "]" * 100_000 + "}", "nested too deeply"),
])
def test_bad_generations_fail_with_file_line(tmp_path, capsys, line, message):
    gens = tmp_path / "g.jsonl"
    gens.write_text(line + "\n")
    assert _eval(gens, tmp_path / "o") == 2
    err = capsys.readouterr().err
    assert message in err and f"{gens}:" in err
    assert not (tmp_path / "o" / "results.jsonl").exists()


def test_gold_and_raw_responses(tmp_path):
    rows = [json.loads(x) for x in SAMPLE.open()]
    gens = tmp_path / "raw.jsonl"
    gens.write_text("".join(json.dumps({"github_id": r["github_id"], "id": r["id"],
                                        "raw": [f"Here you go:\n```bash\n{r['output']}\n```"] * 5}) + "\n"
                            for r in rows if r["type"] == "Bash Script"))
    assert _eval(gens, tmp_path / "raw") == 0
    s = json.loads((tmp_path / "raw" / "summary.json").read_text())
    n_python = sum(json.loads(x)["type"] == "Python Code" for x in SAMPLE.open())
    assert s["metrics"]["overall"]["pass@1"] == 1.0 and len(s["missing"]) == n_python
    assert main(["eval", "--data", str(SAMPLE), "--gold", "--envs", str(ENVS), "--out", str(tmp_path / "g")]) == 0
    gold = json.loads((tmp_path / "g" / "summary.json").read_text())["metrics"]["overall"]
    assert gold["samples"] == len(rows) and gold["pass@1"] == 1.0  # every dataset answer runs in its repository


@pytest.mark.user
def test_libraries_without_bytecode_are_named_before_scoring(tmp_path, capsys):
    """The sandbox mounts an environment read-only, so bytecode it lacks is compiled again by every execution."""
    repo = tmp_path / "toybench"
    shutil.copytree(REPO_ROOT / "examples" / "sample" / "repos" / "toybench", repo,
                    ignore=shutil.ignore_patterns("__pycache__"))
    envs = tmp_path / "envs.yaml"
    envs.write_text(f"repos:\n  toybench: {{checkout: {repo}, warm: [toylib]}}\n")
    assert main(["eval", "--data", str(SAMPLE), "--gold", "--envs", str(envs), "--repos", "toybench", "--out",
                 str(tmp_path / "run"), "--no-ci"]) == 0
    err = capsys.readouterr().err
    assert "warm-up: toylib" in err and "(not compiled)" in err and "toybench's libraries have no bytecode" in err
    assert "; compile them once: " in err and " -m compileall -q DIR" in err  # the environment's own interpreter
    # who runs the executions: as root a uid of its own each (the staged checkout bound idmapped), else the caller's
    assert ("; a uid per execution; warm-up" if os.geteuid() == 0 else "; your uid") in err, err


def test_limit_scores_only_the_first_rows(tmp_path):
    # --limit means what it means in infer and agent: the first N rows (a smoke run), here of the data
    rows = [json.loads(x) for x in SAMPLE.open()]
    assert main(["eval", "--data", str(SAMPLE), "--gold", "--envs", str(ENVS), "--limit", "3",
                 "--out", str(tmp_path / "g")]) == 0
    results = [json.loads(x) for x in (tmp_path / "g" / "results.jsonl").read_text().splitlines()]
    assert {(r["github_id"], r["id"]) for r in results} == {(r["github_id"], r["id"]) for r in rows[:3]}
    assert json.loads((tmp_path / "g" / "summary.json").read_text())["metrics"]["overall"]["samples"] == 3


def test_a_run_replays_from_the_config_it_wrote(tmp_path, capsys):
    out = tmp_path / "g"
    assert main(["eval", "--data", str(SAMPLE), "--gold", "--envs", str(ENVS), "--limit", "2", "--mode", "strict",
                 "--out", str(out)]) == 0
    first = json.loads((out / "summary.json").read_text())
    written = yaml.safe_load((out / "config.yaml").read_text())
    assert written["limit"] == 2 and written["mode"] == "strict" and written["gold"] is True
    capsys.readouterr()
    assert main(["eval", "--config", str(out / "config.yaml")]) == 0  # the same run: resumed, nothing re-executed
    again = json.loads((out / "summary.json").read_text())
    assert again["metrics"] == first["metrics"] and "eval: executed 0" in capsys.readouterr().err
