"""Environment recipes and builds (issue 13): every repository has a recipe, bad recipes fail with file:line,
builds are idempotent and resumable, a real repository's environment is built and its gold rows validated."""

import json
import re
import shutil
from pathlib import Path

import pytest
import yaml
from conftest import REPO_ROOT

from mlbench_kit.cli import main
from mlbench_kit.envspec import load_recipe, load_recipes
from mlbench_kit.errors import MLBenchError
from mlbench_kit.eval.envs import EnvConfig
from mlbench_kit.eval.envs.build import Builder, env_dir

RECIPES = REPO_ROOT / "configs" / "eval" / "envs"
FIXTURES = REPO_ROOT / "configs" / "eval" / "envs-sample"
SAMPLE = REPO_ROOT / "examples" / "sample" / "samples.jsonl"


def test_every_test_repository_has_a_recipe_at_its_pinned_commit(shared):
    recipes = {r.repo: r for r in load_recipes(RECIPES)}
    pinned = {r["name"]: r["commit"] for r in json.loads((shared / "repos.json").read_text())["test_repos"]}
    assert set(recipes) == set(pinned) and len(recipes) == 14
    assert all(recipes[n].commit == c for n, c in pinned.items())
    assert len({r.hash for r in recipes.values()}) == 14
    assert {r.repo for r in load_recipes(FIXTURES)} == {"toybench", "toyvision"}


def test_envs_yaml_names_the_modules_to_warm(tmp_path):
    (tmp_path / "r").mkdir()
    f = tmp_path / "envs.yaml"
    f.write_text("repos:\n  a: {checkout: r, warm: [torch]}\n  b: {checkout: r}\n  c: {checkout: r, warm: torch}\n")
    with pytest.raises(MLBenchError, match="repos.c.warm must be a list or null") as e:
        EnvConfig(f)  # when the file is read, before any repository runs
    assert f"{f}:4" in str(e.value)
    f.write_text("repos:\n  a: {checkout: r, warm: [torch]}\n  b: {checkout: r}\n  c:\n")
    envs = EnvConfig(f)
    assert envs.for_repo("a").warm == ("torch",) and envs.for_repo("b").warm is None
    assert envs.for_repo("a").where == f"{f}:2"
    with pytest.raises(MLBenchError, match="no checkout known for repository 'c'"):
        envs.for_repo("c")
    f.write_text("repos:\n  a: {checkout: r, venv: [x]}\n")
    with pytest.raises(MLBenchError, match="repos.a.venv must be") as e:
        EnvConfig(f)
    assert f"{f}:2" in str(e.value)


@pytest.mark.parametrize("text, message, line", [
    ("repo: x\ncheckout: {path: .}\npython: '3.11'\npipp: [a]\n", "unknown key 'pipp'", 4),
    ("repo: x\ncheckout: {path: .}\npip: ['torch ==']\n", "not a pip requirement", 3),
    ("repo: x\ncheckout: {github: u, commit: abc}\n", "40 hex digits", 2),
    # an asset's error names the asset's own line
    ("repo: x\ncheckout: {path: .}\nassets:\n  - {path: ../etc/passwd, generate: picture}\n", "stay inside it", 4),
    ("repo: x\ncheckout: {path: .}\nassets:\n  - {path: a.bin, url: 'https://x', sha256: zz}\n", "64 hex", 4),
    ("repo: x\ncheckout: {path: .}\nassets:\n  - {path: a, generate: picture}\n"
     "  - {path: b, generate: picture, knd: data}\n",
     "unknown key 'assets.1.knd'", 5),
    ("repo: x\ncheckout: {path: .}\nassets:\n  - {path: a.zip, url: 'https://x', unpack: rar}\n",
     "unpack must be one of 'zip', 'tar' or null", 4),
    ("repo: x\ncheckout: {path: .}\npython: '3'\n", "must look like 3.11", 3),
    ("repo: x\ncheckout: {path: .}\npython: 3.10\n", "is a string", 3),
    ("repo: x\ncheckout: {path: .}\ngold_defects: {'261': wrong}\n", "maps a row id", 3),
    ("checkout: {path: .}\npip: [a]\n", "missing key 'repo'", 1),
    ("repo: x\ncheckout: {path: .}\nenv: [A=1]\n", "env must be a mapping", 3),
])
def test_bad_recipes_name_file_and_line(tmp_path, text, message, line):
    f = tmp_path / "r.yaml"
    f.write_text(text)
    with pytest.raises(MLBenchError, match=message) as e:
        load_recipe(f)
    assert e.value.where.startswith(f"{f}:{line}")


def _fixture(tmp_path: Path, name: str = "toybench", **changes) -> Path:
    """A copy of a fixture recipe (path made absolute), with some keys changed."""
    doc = yaml.safe_load((FIXTURES / f"{name}.yaml").read_text())
    doc["checkout"]["path"] = str((FIXTURES / doc["checkout"]["path"]).resolve())
    doc |= changes
    d = tmp_path / "recipes"
    d.mkdir(exist_ok=True)
    (d / f"{name}.yaml").write_text(yaml.safe_dump(doc))
    return d


class _Interrupted(Builder):
    def _setup(self, recipe, part):
        raise KeyboardInterrupt  # killed after checkout, assets and venv


@pytest.mark.integration
def test_build_is_idempotent_and_resumes_after_an_interruption(tmp_path):
    recipes = _fixture(tmp_path, setup=["echo built > setup-ran.txt"])
    r = load_recipes(recipes)[0]
    cache = tmp_path / "cache"
    with pytest.raises(KeyboardInterrupt):
        _Interrupted(cache, log=lambda m: None).build(r)
    part = env_dir(cache, r)
    assert not (part / "meta.json").exists()  # not complete: not listed, not used
    venv_mtime = (part / "venv" / "pyvenv.cfg").stat().st_mtime_ns
    steps = []
    folder = Builder(cache, log=steps.append).build(r)
    names = {"checkout", "assets", "venv", "setup", "bytecode", "freeze"}
    assert [s.split(": ")[1] for s in steps if s.split(": ")[1] in names] == ["setup", "bytecode", "freeze"]
    assert (folder / "venv" / "pyvenv.cfg").stat().st_mtime_ns == venv_mtime
    assert (folder / "checkout" / "setup-ran.txt").read_text() == "built\n"
    meta = json.loads((folder / "meta.json").read_text())
    assert meta["recipe"] == r.hash and (folder / "freeze.txt").is_file() and (folder / "build.log").is_file()
    steps.clear()
    Builder(cache, log=steps.append).build(r)
    assert steps == [f"env toybench: up to date ({folder.name})"]
    # compiled: the sandbox mounts both read-only, so nothing would cache bytecode between executions
    assert meta["bytecode"]["pyc"] > 0 and list((folder / "checkout").rglob("__pycache__/train.*.pyc"))
    # a build by an older mlbench-kit (no bytecode) gets that step in place, nothing else
    (folder / "meta.json").write_text(json.dumps({k: v for k, v in meta.items() if k != "bytecode"}))
    for d in (folder / "checkout").rglob("__pycache__"):
        shutil.rmtree(d)
    steps.clear()
    Builder(cache, log=steps.append).build(r)
    assert steps == ["env toybench: bytecode (older build)", f"env toybench: up to date ({folder.name})"]
    assert json.loads((folder / "meta.json").read_text())["bytecode"]["pyc"] == meta["bytecode"]["pyc"]
    assert list((folder / "checkout").rglob("__pycache__/train.*.pyc"))


@pytest.mark.integration
def test_eval_scores_again_what_an_older_build_scored(tmp_path, capsys):
    cache, out = tmp_path / "cache", tmp_path / "eval"
    ev = ["eval", "--data", str(SAMPLE), "--gold", "--envs", str(cache / "envs.yaml"), "--repos", "toybench",
          "--out", str(out), "--no-ci"]
    assert main(["env", "build", "--recipes", str(_fixture(tmp_path)), "--cache", str(cache)]) == 0
    assert main(ev) == 0
    first = [json.loads(x) for x in (out / "results.jsonl").open()]
    capsys.readouterr()
    rebuilt = _fixture(tmp_path, env={"TOY_FLAG": "1"})  # another recipe hash: a new build
    assert main(["env", "build", "--recipes", str(rebuilt), "--cache", str(cache)]) == 0
    assert main(ev) == 0
    assert f"{len(first)} result(s) of toybench came from an older build" in capsys.readouterr().err
    again = [json.loads(x) for x in (out / "results.jsonl").open()]
    assert len(again) == len(first) and {r["env"] for r in again} == {load_recipes(rebuilt)[0].hash}
    assert {r["env"] for r in first} != {r["env"] for r in again}


@pytest.mark.integration
def test_unresolvable_requirement_fails_clearly_and_keeps_earlier_builds(tmp_path, capsys):
    cache = tmp_path / "cache"
    ok = _fixture(tmp_path)
    assert main(["env", "build", "--recipes", str(ok), "--cache", str(cache)]) == 0
    before = (cache / "envs.yaml").read_text()
    bad = _fixture(tmp_path, pip=["mlbench-no-such-package-anywhere==9.9.9"])
    assert main(["env", "build", "--recipes", str(bad), "--cache", str(cache)]) == 2
    err = capsys.readouterr().err
    assert "mlbench-no-such-package-anywhere" in err and "toybench.yaml" in err and "build.log" in err
    assert (cache / "envs.yaml").read_text() == before  # the earlier build is still the one listed
    built = yaml.safe_load(before)["repos"]["toybench"]
    assert Path(built["venv"], "bin", "python").exists()


def test_missing_checkout_tarball_is_one_clear_error(tmp_path, capsys):
    recipe = tmp_path / "recipes" / "r.yaml"
    recipe.parent.mkdir()
    recipe.write_text("repo: nothere\ncheckout: {github: https://github.com/x/nothere, commit: " + "a" * 40 + "}\n")
    assert main(["env", "build", "--recipes", str(recipe.parent), "--cache", str(tmp_path / "c"),
                 "--tarballs", str(tmp_path)]) == 2
    assert f"{tmp_path}/nothere.tar.gz: no checkout tarball for nothere" in capsys.readouterr().err


@pytest.mark.integration
def test_real_repository_environment_and_gold_validation(tmp_path, shared, real_env_cache, capsys):
    """External-Attention-pytorch from the shared tarball: built as a venv (the session's ``real_env_cache``,
    which tests/test_real.py's quick run shares), its 24 gold rows validated."""
    cache, out = real_env_cache, tmp_path / "val"
    capsys.readouterr()
    assert main(["env", "check", "External-Attention-pytorch", "--cache", str(cache)]) == 0
    check = capsys.readouterr().out
    # probed, and its libraries imported once in the sandbox, from bytecode the build compiled
    assert re.search(r"External-Attention-pytorch +ok +python 3\.\d+.*warm-up: .*torch [\d.]+ s", check), check
    assert "not compiled" not in check and "FAILED" not in check, check
    assert main(["env", "validate", "External-Attention-pytorch", "--cache", str(cache), "--data",
                 str(shared / "full.jsonl"), "--out", str(out), "--modes", "compat"]) == 0
    report = json.loads((out / "validation.json").read_text())
    rows = report["rows"]
    assert len(rows) == 24
    gold = [json.loads(x) for x in (out / "gold-compat" / "results.jsonl").open()]
    checked = [g for g in gold if g["params_ok"] and g["type_ok"]]
    # every answer that passes the checks runs, but for id 261 whose answer is wrong (the recipe's gold_defects).
    # It fails about 5 s in (12 s before environments were compiled to bytecode, when compat passed it).
    failed = {g["id"]: (g.get("exit_code"), g.get("duration"), (g.get("log") or "")[-600:])
              for g in checked if not (g["passed"] and g["executed"])}
    assert checked and set(failed) <= {261}, failed
    causes = {r["id"]: r["compat"]["cause"] for r in rows}
    assert causes.pop(261) == ("answer" if 261 in failed else None) and set(causes.values()) <= {None, "check"}
    assert "known gold defect" in (out / "validation.md").read_text()
    assert rows[[r["id"] for r in rows].index(261)]["defect"]
    assert "| External-Attention-pytorch | built | 24 |" in (out / "validation.md").read_text()
    # eval reports Pass@k on all rows and on the gold-valid ones, naming what it excluded. Run on the validation's
    # own gold run folder with its settings (validate's --cpus is 1), it resumes: the 24 verdicts are the
    # validation's, nothing is executed a second time
    run = out / "gold-compat"
    capsys.readouterr()
    assert main(["eval", "--data", str(shared / "full.jsonl"), "--gold", "--envs", str(cache / "envs.yaml"),
                 "--repos", "External-Attention-pytorch", "--validation", str(out / "validation.json"),
                 "--mode", "compat", "--cpus", "1", "--out", str(run), "--no-ci"]) == 0
    assert "eval: executed 0 (reused 0); 0/0 new generations passed; 24 done before" in capsys.readouterr().err
    s = json.loads((run / "summary.json").read_text())
    excluded = s["gold_valid"]["excluded"].get("check", [])
    assert s["gold_valid"]["rows"] == len(checked) - 1 and len(excluded) == 24 - len(checked)
    assert s["gold_valid"]["excluded"]["answer"] == [[9, 261]]  # a known defect, however compat scored it
    assert s["gold_valid"]["metrics"]["pass@1"] == 1.0
    assert "Gold-valid rows" in (run / "report.md").read_text()


@pytest.mark.integration
def test_fixture_image_from_recipe_runs_the_sample_in_podman(tmp_path, base_image):
    if base_image is None:
        pytest.skip("podman unavailable")
    cache = tmp_path / "cache"
    recipes = _fixture(tmp_path)
    shutil.copy(FIXTURES / "toyvision.yaml", recipes / "toyvision.yaml")
    doc = yaml.safe_load((recipes / "toyvision.yaml").read_text())
    doc["checkout"]["path"] = str((FIXTURES / doc["checkout"]["path"]).resolve())
    (recipes / "toyvision.yaml").write_text(yaml.safe_dump(doc))
    assert main(["env", "build", "--recipes", str(recipes), "--cache", str(cache), "--image"]) == 0
    envs = yaml.safe_load((cache / "envs.yaml").read_text())["repos"]
    assert envs["toybench"]["image"].startswith("localhost/mlbench-env-toybench:")
    out = tmp_path / "eval"
    assert main(["eval", "--data", str(SAMPLE), "--gold", "--envs", str(cache / "envs.yaml"), "--out", str(out),
                 "--backend", "podman", "--no-ci"]) == 0
    assert json.loads((out / "summary.json").read_text())["metrics"]["overall"]["pass@1"] == 1.0


def test_envs_yaml_from_a_relative_cache_resolves_from_anywhere(tmp_path, monkeypatch):
    # `mlbench env build --cache rel` wrote rel/envs/... paths into rel/envs.yaml, which the file's readers resolve
    # against the file's folder: rel/rel/envs/..., not found
    from mlbench_kit.eval.envs.build import write_envs_yaml
    recipe = load_recipes(FIXTURES)[0]
    monkeypatch.chdir(tmp_path)
    d = env_dir(Path("rel"), recipe)
    (d / "checkout").mkdir(parents=True)
    (d / "venv" / "bin").mkdir(parents=True)
    (d / "venv" / "bin" / "python").write_text("")
    (d / "meta.json").write_text("{}")
    target = write_envs_yaml(Path("rel"), [recipe])
    monkeypatch.chdir(REPO_ROOT)
    env = EnvConfig(tmp_path / target).for_repo(recipe.repo)
    assert env.checkout == (tmp_path / d / "checkout").resolve()
    assert env.prefix == str((tmp_path / d / "venv").resolve())


def test_a_repository_name_never_leaves_repos_dir(tmp_path):
    """Issue 30 item 3: `..` from a row's URL joined onto --repos-dir was copied and chowned as a checkout."""
    repos = tmp_path / "repos"
    (repos / "real").mkdir(parents=True)
    (repos / "escape").symlink_to(tmp_path)
    envs = EnvConfig(repos_dir=repos)
    assert envs.for_repo("real").checkout == repos / "real"
    for name in ["..", ".", "escape", "real/..", ""]:
        with pytest.raises(MLBenchError, match="does not name a folder directly inside"):
            envs.for_repo(name)
