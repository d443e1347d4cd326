import json

import pytest

from mlbench_kit.cli import main
from mlbench_kit.data_prep.corpus import ReadmeCorpus
from mlbench_kit.data_prep.render import Renderer
from mlbench_kit.data_prep.templates import render
from mlbench_kit.dataset import load_samples
from mlbench_kit.errors import MLBenchError


@pytest.mark.parametrize("template", ["paper", "llama-inst", "chat"])
def test_truncation_cuts_only_the_context(shared, tiny_tokenizer, template):
    samples = load_samples(shared / "full.jsonl")[:40]
    r = Renderer(ReadmeCorpus(shared / "readmes"), template, tiny_tokenizer, max_context_tokens=1024)
    recs = r.render_task(samples, 1)
    assert sum(x["truncated"] for x in recs) >= 20
    for s, rec in zip(samples, recs, strict=True):
        assert rec["total_tokens"] <= 1024
        assert s.instruction in rec["prompt"] and s.output in rec["answer"]
        full = r.corpus.readme_for(s.repo, s.path).text
        if rec["truncated"]:
            assert rec["dropped_tokens"] > 0
            # the kept context is a prefix of the README, and it is what the prompt holds
            kept = rec["prompt"].split("[readme]:", 1)[1] if template == "paper" else rec["prompt"]
            assert full[:200] in kept or rec["dropped_tokens"] == rec["context_tokens"]
        else:
            assert full.strip() in rec["prompt"]
        n = len(tiny_tokenizer(rec["prompt"], add_special_tokens=template != "chat")["input_ids"])
        n += len(tiny_tokenizer(rec["answer"], add_special_tokens=False)["input_ids"]) + 1
        assert n == rec["total_tokens"]


def test_templates():
    r = render("llama-inst", "do X", "README", "python a.py --x 1", "Bash Script")
    assert r.prompt.startswith("[INST] Suppose you are a data scientist") and r.prompt.endswith("[/INST]")
    assert "```\npython a.py --x 1\n```" in r.answer
    p = render("paper", "do X", "README", "print(1)", "Python Code")
    assert p.prompt.startswith("[readme]:README\n[instruction]:do X") and p.answer == "```python\nprint(1)\n```"
    with pytest.raises(MLBenchError, match="needs a tokenizer with a chat template"):
        render("chat", "a", "b", "c", "Bash Script")


def test_prep_cli_writes_every_split_task_and_stats(shared, tiny_tokenizer_dir, tmp_path):
    out = tmp_path / "prep"
    rc = main(["prep", "--data", str(shared / "full.jsonl"), "--splits", "full", "--readmes",
               str(shared / "readmes"), "--build-splits", "--ood-repos", "bert", "esm", "--tokenizer",
               str(tiny_tokenizer_dir), "--max-context-tokens", "2048", "--out", str(out)])
    assert rc == 0
    import datasets
    for split in ("test", "id_train", "ood_train"):
        for task in (1, 2, 3):
            rows = [json.loads(x) for x in (out / split / f"task{task}.jsonl").open()]
            ds = datasets.load_from_disk(str(out / split / f"task{task}.hf"))
            assert len(ds) == len(rows) > 0
            assert json.loads(ds[0]["arguments"]) == rows[0]["arguments"]
            assert all(r["total_tokens"] <= 2048 for r in rows)
    test_repos = {json.loads(x)["repo"] for x in (out / "test" / "task3.jsonl").open()}
    assert not test_repos & {"bert", "esm"}
    stats = json.loads((out / "stats.json").read_text())
    all_t1 = next(r for r in stats if r["split"] == "test" and r["task"] == 1 and r["repo"] == "ALL")
    assert 0.5 < all_t1["truncated_share"] <= 1
    assert "| test | 1 | ALL |" in (out / "stats.md").read_text()
