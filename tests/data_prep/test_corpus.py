import json
import subprocess

import pytest

from mlbench_kit.data_prep.corpus import ReadmeCorpus, checkout_repos
from mlbench_kit.dataset import load_samples
from mlbench_kit.errors import MLBenchError


def test_nearest_readme_walk_on_real_rows(shared):
    corpus = ReadmeCorpus(shared / "readmes")
    samples = load_samples(shared / "full.jsonl")
    found = [corpus.readme_for(s.repo, s.path) for s in samples]
    assert sum(r.walked_up for r in found) == 49
    assert len({(s.repo, r.relpath) for s, r in zip(samples, found, strict=True)}) == 37
    gan = [r for s, r in zip(samples, found, strict=True) if s.repo == "PyTorch-GAN"]
    assert {r.relpath for r in gan} == {"README.md"}
    arma = found[0]
    assert arma.relpath == "examples/pytorch/arma/README.md" and not arma.walked_up
    # several READMEs in one folder: the canonical one wins over README_EN.md / README_pip.md
    assert corpus.readme_for("External-Attention-pytorch", ".").relpath == "README.md"


def test_missing_repo_folder_is_a_clear_error(shared):
    with pytest.raises(MLBenchError, match="no folder for repository 'nope'"):
        ReadmeCorpus(shared / "readmes").readme_for("nope", ".")


def _git(cwd, *args):
    subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True)


def test_checkout_at_pinned_commit_from_a_real_git_remote(tmp_path):
    upstream = tmp_path / "upstream"
    (upstream / "sub").mkdir(parents=True)
    _git(upstream, "init", "-q")
    _git(upstream, "config", "user.email", "t@t")
    _git(upstream, "config", "user.name", "t")
    (upstream / "README.md").write_text("pinned version")
    _git(upstream, "add", ".")
    _git(upstream, "commit", "-qm", "one")
    pinned = subprocess.run(["git", "rev-parse", "HEAD"], cwd=upstream, capture_output=True, text=True).stdout.strip()
    (upstream / "README.md").write_text("newer version")
    _git(upstream, "commit", "-qam", "two")
    _git(upstream, "config", "uploadpack.allowAnySHA1InWant", "true")
    spec = tmp_path / "repos.json"
    spec.write_text(json.dumps({"test_repos": [{"github_id": 1, "name": "toy", "github": f"file://{upstream}",
                                                "commit": pinned}]}))
    dest = checkout_repos(spec, tmp_path / "repos")
    assert (dest / "toy" / "README.md").read_text() == "pinned version"
    assert ReadmeCorpus(dest).readme_for("toy", "./sub").text == "pinned version"
    checkout_repos(spec, tmp_path / "repos")  # already there: kept, no error
    spec.write_text(json.dumps({"test_repos": [{"github_id": 1, "name": "gone", "github": f"file://{tmp_path}/none",
                                                "commit": pinned}]}))
    with pytest.raises(MLBenchError, match="offline\\? pass --readmes"):
        checkout_repos(spec, tmp_path / "repos")


def test_readmes_stay_inside_their_repository(tmp_path):
    """Issue 30 item 3: a README is read from inside its repository's folder only, links resolved."""
    root = tmp_path / "readmes"
    (root / "repo" / "docs").mkdir(parents=True)
    (root / "repo" / "README.md").write_text("inside")
    (tmp_path / "README.md").write_text("SECRET beside the repositories")
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "README.md").write_text("SECRET elsewhere")
    (root / "repo" / "linked").symlink_to(tmp_path / "outside")
    (root / "repo" / "docs" / "README.md").symlink_to(tmp_path / "README.md")
    corpus = ReadmeCorpus(root)
    assert corpus.readme_for("repo", "./").text == "inside"
    for repo, path in [("repo", "../.."), ("repo", "/"), ("..", "."), ("repo", "x/../../..")]:
        with pytest.raises(MLBenchError, match="do not name a folder inside one repository"):
            corpus.readme_for(repo, path)
    for path in ["linked", "docs"]:
        with pytest.raises(MLBenchError, match="resolves outside repository 'repo'"):
            corpus.readme_for("repo", path)
