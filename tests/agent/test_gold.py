"""Gold episodes (`mlbench agent --gold-episodes`): each training row's correct episode, built by the harness's own
episode code, as SFT records whose prompts are exactly what the harness sends at each turn."""

from __future__ import annotations

import json
from pathlib import Path

from mlbench_kit.agent.run import make_encoder, run_episodes
from mlbench_kit.cli import main, stage_config
from mlbench_kit.dataset import load_samples
from mlbench_kit.engine import Generated, GenParams, GenRequest
from mlbench_kit.hf import load_tokenizer, prompt_ids
from mlbench_kit.records import EvalResult, output_sha, read_prep_records

REPO = "External-Attention-pytorch"


def _rows_file(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps({"github_id": s.github_id, "id": s.id}) + "\n" for s in rows))
    return path


class Answering:
    """An engine that answers a prompt only with the record whose prompt tokenizes to exactly the ids it was sent."""

    def __init__(self, replies: dict[tuple[int, ...], str], tok) -> None:
        self.replies, self.tok, self.requests = replies, tok, 0

    def generate(self, requests: list[GenRequest], params: GenParams) -> list[list[Generated]]:
        self.requests += len(requests)
        out = []
        for r in requests:
            assert tuple(r.token_ids) in self.replies, "the harness sent a prompt no gold record holds"
            text = self.replies[tuple(r.token_ids)]
            out.append([Generated(text, len(self.tok(text, add_special_tokens=False)["input_ids"]))])
        return out

    def close(self) -> None:
        pass


def test_gold_episode_records_are_what_the_harness_sends_on_real_rows(shared: Path, tiny_tokenizer_dir: Path,
                                                                      tmp_path: Path, capsys):
    rows = [s for s in load_samples(shared / "full.jsonl") if s.repo == REPO]
    train, evaluated = rows[:2], rows[2:4]
    train_f, eval_f = _rows_file(tmp_path / "train.jsonl", train), _rows_file(tmp_path / "eval.jsonl", evaluated)
    common = ["agent", "--gold-episodes", "--model", str(tiny_tokenizer_dir), "--data", str(shared / "full.jsonl"),
              "--repos-dir", str(shared / "readmes"), "--eval-rows", str(eval_f)]
    out = tmp_path / "gold"
    assert main([*common, "--rows-of", str(train_f), "--out", str(out)]) == 0
    recs = [r for _, r in read_prep_records(out / "sft.jsonl")]
    assert [(r.key, json.loads(r.answer).keys() >= {"task_flag"}) for r in recs] == \
        [(train[0].key, True), (train[0].key, False), (train[1].key, True), (train[1].key, False)]
    assert all(r.template == "chat" and r.prompt.startswith("<s>[INST] ") for r in recs)  # the tiny template
    assert [json.loads(r.answer)["code"] for r in recs[1::2]] == [s.output for s in train]
    # the harness's own run, with the run's resolved config: every prompt it sends is a record's prompt, token for
    # token, and the records' answers walk every episode to the gold answer
    tok = load_tokenizer(str(tiny_tokenizer_dir))
    encode, template = make_encoder(tok, "auto")
    assert template == "chat"
    engine = Answering({tuple(prompt_ids(tok, r.prompt, r.template)): r.answer for r in recs}, tok)
    cfg = stage_config("agent", ["--config", str(out / "config.yaml")])
    cfg.episodes = 1
    max_model_len = json.loads((out / "gold.json").read_text())["max_model_len"]
    run_episodes(cfg, train, {REPO: shared / "readmes" / REPO}, lambda: engine, encode, max_model_len, tmp_path / "run",
                 {"model": "gold", "adapter": None, "backend": "scripted"})
    gens = [json.loads(x) for x in (tmp_path / "run" / "generations.jsonl").read_text().splitlines()]
    assert [g["output"] for g in gens] == [[s.output] for s in train] and engine.requests == len(recs)
    # expert iteration (--own-episodes): the run's episodes that passed strict come back as records; here the
    # harness ran the gold replies, so the kept turns are exactly the gold records, and a failing verdict keeps none
    def verdicts(path: Path, mode: str, passed: list[bool], answers: list[str]) -> Path:
        path.mkdir()
        (path / "results.jsonl").write_text("".join(json.dumps(EvalResult(
            s.github_id, s.id, 0, s.repo, s.type, output_sha(a), mode, {}, True, True, passed=p).to_json()) + "\n"
            for s, p, a in zip(train, passed, answers, strict=True)))
        return path

    own = ["--own-episodes", str(tmp_path / "run"), "--own-episodes-eval"]
    ok = verdicts(tmp_path / "eval-ok", "strict", [True, False], [s.output for s in train])
    assert main([*common, "--rows-of", str(train_f), *own, str(ok), "--out", str(tmp_path / "ei")]) == 0
    ei = [r for _, r in read_prep_records(tmp_path / "ei" / "sft.jsonl")]
    assert [(r.prompt, r.answer) for r in ei] == [(r.prompt, r.answer) for r in [*recs, *recs[:2]]]
    assert json.loads((tmp_path / "ei" / "gold.json").read_text())["own_episodes"]["episodes"] == 1
    for name, mode, answers in (("compat", "compat", [s.output for s in train]),  # compat passes the sleeper
                                ("other", "strict", ["echo other", "echo other"])):  # not what the run submitted
        bad = verdicts(tmp_path / f"eval-{name}", mode, [True, True], answers)
        assert main([*common, "--rows-of", str(train_f), *own, str(bad), "--out", str(tmp_path / name)]) == 2
        assert not (tmp_path / name / "sft.jsonl").exists()
    # a run folder is handed-over data: a transcript that is a link (here to the very same file) is not followed
    ep0 = tmp_path / "run" / "transcripts" / f"{train[0].github_id}-{train[0].id}" / "ep0.jsonl"
    ep0.rename(tmp_path / "elsewhere.jsonl")
    ep0.symlink_to(tmp_path / "elsewhere.jsonl")
    assert main([*common, "--rows-of", str(train_f), *own, str(ok), "--out", str(tmp_path / "link")]) == 2
    assert not (tmp_path / "link" / "sft.jsonl").exists()
    ep0.unlink()
    (tmp_path / "elsewhere.jsonl").rename(ep0)
    # nor a link above it, inside the run folder: the row's transcript folder, or transcripts/ itself (each led out
    # of the run folder and was read)
    row_dir = ep0.parent
    for linked in (row_dir, row_dir.parent):
        moved = tmp_path / f"moved-{linked.name}"
        linked.rename(moved)
        linked.symlink_to(moved, target_is_directory=True)
        assert main([*common, "--rows-of", str(train_f), *own, str(ok), "--out", str(tmp_path / "dirlink")]) == 2
        assert "a link (or under one)" in capsys.readouterr().err
        assert not (tmp_path / "dirlink" / "sft.jsonl").exists()
        linked.unlink()
        moved.rename(linked)
    # an eval folder without results.jsonl (a typo, the eval not run yet) is one error naming it: it read as no
    # verdicts, and the gold records alone were written as if expert iteration had found nothing
    empty = tmp_path / "eval-none"
    empty.mkdir()
    assert main([*common, "--rows-of", str(train_f), *own, str(empty), "--out", str(tmp_path / "none")]) == 2
    err = capsys.readouterr().err
    assert f"{empty / 'results.jsonl'}: this eval folder's results.jsonl is missing" in err and "--own-episodes-eval" \
        in err, err
    assert not (tmp_path / "none" / "sft.jsonl").exists()
    assert main([*common, "--rows-of", str(train_f), *own, str(ok), "--out", str(tmp_path / "again")]) == 0
    # an own episode is checked against the evaluation rows too: an ml-agent turn's prompt is read as the transcript
    # wrote it, so one holding an evaluated instruction is refused; an episode submitting an evaluated row's answer
    # is left out, counted (both were kept)
    lines = ep0.read_text().splitlines()
    turn = json.loads(lines[0])
    turn["prompt"] += "\n" + evaluated[0].instruction
    ep0.write_text("\n".join([json.dumps(turn), *lines[1:]]) + "\n")
    assert main([*common, "--rows-of", str(train_f), *own, str(ok), "--out", str(tmp_path / "smuggled")]) == 2
    assert f"holds the instruction of evaluated row id {evaluated[0].id}" in capsys.readouterr().err
    assert not (tmp_path / "smuggled" / "sft.jsonl").exists()
    end = json.loads(lines[-1])
    end["end"]["answer"] = evaluated[0].output
    ep0.write_text("\n".join([*lines[:-1], json.dumps(end)]) + "\n")
    as_eval = verdicts(tmp_path / "eval-as-eval", "strict", [True, False], [evaluated[0].output, train[1].output])
    assert main([*common, "--rows-of", str(train_f), *own, str(as_eval), "--out", str(tmp_path / "as-eval")]) == 0
    got = json.loads((tmp_path / "as-eval" / "gold.json").read_text())["own_episodes"]
    assert got["episodes"] == 0 and got["evaluated_answers_left_out"] == 1
    ep0.write_text("\n".join(lines) + "\n")
    # never the evaluation rows: refused, nothing written
    assert main([*common, "--rows-of", str(eval_f), "--out", str(tmp_path / "leak")]) == 2
    assert not (tmp_path / "leak" / "sft.jsonl").exists()


def test_rows_named_reads_prep_records_that_hold_line_separators(tmp_path: Path):
    """`--rows-of` / `--eval-rows` name prep files, whose records hold U+2028 and U+0085 raw (prep writes with
    ensure_ascii=False): str.splitlines() split a record there and refused the file at a line that was no line."""
    import pytest

    from mlbench_kit.agent.run import rows_named
    from mlbench_kit.errors import MLBenchError
    f = tmp_path / "task3.jsonl"
    f.write_text("".join(json.dumps({"github_id": 1, "id": i, "prompt": "a\u2028b\x85c"}, ensure_ascii=False) + "\n"
                         for i in (1, 2)), encoding="utf-8")
    assert rows_named(f) == {(1, 1), (1, 2)}
    f.write_text(f.read_text(encoding="utf-8") + "[" * 100_000 + "]" * 100_000 + "\n", encoding="utf-8")
    with pytest.raises(MLBenchError, match="nested too deeply") as exc:
        rows_named(f)
    assert exc.value.where == f"{f}:3"
