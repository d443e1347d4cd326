import subprocess
import sys

from rank_bm25 import BM25Okapi

from mlbench_kit.data_prep.corpus import ReadmeCorpus
from mlbench_kit.data_prep.retrieval import WindowIndex, reference_top1, windows
from mlbench_kit.dataset import load_samples


def test_task2_windows_equal_reference_on_all_260_rows(shared):
    corpus = ReadmeCorpus(shared / "readmes")
    samples = load_samples(shared / "full.jsonl")
    indexes: dict[str, WindowIndex] = {}
    mismatches = []
    for s in samples:
        readme = corpus.readme_for(s.repo, s.path)
        idx = indexes.setdefault(f"{s.repo}/{readme.relpath}", WindowIndex(readme.text))
        if idx.top1(s.instruction) != reference_top1(s.instruction, readme.text):
            mismatches.append(s.id)
    assert mismatches == []
    assert len(indexes) == 37


def test_scores_bit_identical_and_ties_resolve_like_reference():
    # 30 identical sentences: every full window ties, the reference's argsort picks one particular index
    sentences = ["Run python train.py --lr 0.1 now."] * 30
    text = " ".join(sentences)
    split = lambda t: sentences  # noqa: E731
    idx = WindowIndex(text, splitter=split)
    bm = BM25Okapi(windows(sentences))
    for query in ["train.py lr", "unknown words only", "Run Run now."]:
        assert (idx.scores(query) == bm.get_scores(query.split())).all()
        assert idx.top1(query) == reference_top1(query, text, splitter=split)


def test_empty_readme_gives_empty_context():
    assert WindowIndex("").top1("anything") == ""


def test_missing_punkt_model_fails_clearly(tmp_path):
    code = ("import nltk; nltk.data.path[:] = []\n"
            "from mlbench_kit.data_prep.retrieval import punkt_split\n"
            "try:\n    punkt_split('A b. C d.')\nexcept Exception as e:\n    print(type(e).__name__, e)\n")
    env = {"NLTK_DATA": str(tmp_path), "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env).stdout
    assert "MLBenchError" in out and "punkt_tab" in out and "--splitter regex" in out
