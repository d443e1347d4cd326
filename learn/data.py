"""From verdicts to training data: a training split's prompts, its generations and their eval results -> SFT records
of passing answers (deduplicated per row, optionally with the gold answers) and preference pairs (a passing and a
failing answer to the same prompt).

Only verdicts count: an answer the checker could not run (an environment fault, kept out of ``results.jsonl``) is
neither chosen nor rejected. Records keep the prep record's prompt and template, so ``mlbench train`` reads them as
it reads prep's.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from mlbench_kit.dataset import check_no_leak, instruction_finder, normalized_text
from mlbench_kit.errors import MLBenchError
from mlbench_kit.io import read_jsonl
from mlbench_kit.learn_config import LearnConfig
from mlbench_kit.parse import parse_response
from mlbench_kit.records import EvalResult, PrepRecord, output_sha, read_prep_records, read_scored_folder, valid_text

Key = tuple[int, int]


@dataclass
class Answer:
    """One sampled answer and its verdict."""

    idx: int
    text: str  # what the model said (trained on)
    code: str  # what the checker ran (deduplicated on)
    passed: bool
    error_class: str | None = None


@dataclass
class LearningData:
    """What one split's verdicts give: SFT records, preference pairs and the counts behind them."""

    sft: list[PrepRecord] = field(default_factory=list)
    pairs: list[dict[str, Any]] = field(default_factory=list)
    stats: dict[str, int] = field(default_factory=dict)


def training_prompts(cfg: LearnConfig) -> dict[Key, PrepRecord]:
    """The training split's prompts, after the leak check against the evaluation split: learning never starts
    on a split that shares a row, an instruction or an answer with the split models are scored on."""
    path = cfg.training_prompts()
    if not path.is_file():
        raise MLBenchError(f"no prompts of split {cfg.split!r}, task {cfg.task}", str(path),
                           "run `mlbench prep` for the training split (--build-splits makes id_train/ood_train)")
    train = {rec.key: rec for _, rec in _records(path, cfg.task)}
    evaluated = [rec for _, rec in _records(cfg.eval_prompts(), cfg.task)]
    if not evaluated:
        raise MLBenchError(f"the evaluation split has no task-{cfg.task} prompts to check for leaks",
                           str(cfg.eval_prompts()), "name the split your models are scored on (--eval-split)")
    shared = sorted(set(train) & {r.key for r in evaluated})
    if shared:
        raise MLBenchError(f"{len(shared)} rows of the training split are in the evaluation split (first: "
                           f"github_id={shared[0][0]} id={shared[0][1]})", str(path),
                           "learn on a training split: never the rows models are scored on")
    check_no_leak(list(train.values()), evaluated)
    # nor train on an evaluated answer under another `output`: the leak check reads `output`, training `answer`
    codes = _codes(evaluated, cfg.parser)
    for rec in train.values():
        if _code(rec.answer, cfg.parser) in codes:
            raise MLBenchError(f"the answer trained on for github_id={rec.github_id} id={rec.id} is an evaluated "
                               "row's answer", str(path), "learn on a training split only")
    # a training prompt may not hold an evaluated instruction, whatever its own `instruction` field says
    held = instruction_finder(evaluated)
    for rec in train.values():
        hit = held(rec.prompt)
        if hit is not None:
            raise MLBenchError(f"training prompt github_id={rec.github_id} id={rec.id} holds the instruction of "
                               f"evaluated row id {hit.id}", str(path), "learn on a training split only")
    if not train:
        raise MLBenchError("the training split has no prompts", str(path), "re-run `mlbench prep` for it")
    return train


def _code(text: str, parser: str) -> str:
    """What the leak check compares an answer by: its normalised code (the text itself where none parses)."""
    return normalized_text(parse_response(text, parser) or text)


def _codes(records: list[PrepRecord], parser: str) -> frozenset[str]:
    return frozenset(c for r in records for c in (normalized_text(r.output), _code(r.answer, parser)) if c)


def evaluated_answers(cfg: LearnConfig) -> frozenset[str]:
    """The evaluation split's answers, normalised as the leak check compares them: an answer a model wrote on a
    training row that equals one of them is not trained on (see :func:`build`)."""
    return _codes([rec for _, rec in _records(cfg.eval_prompts(), cfg.task)], cfg.parser)


def _records(path: Path, task: int) -> list[tuple[str, PrepRecord]]:
    """A prep file's records of ``task``, each field of the type the record declares (untrusted files)."""
    out = []
    for where, rec in read_prep_records(path, task):
        bad = [f for f in ("prompt", "answer", "instruction", "output", "template")
               if not isinstance(getattr(rec, f), str)]
        if bad or not all(type(getattr(rec, f)) is int for f in ("github_id", "id")):
            raise MLBenchError(f"not a prep record: {', '.join(bad) or 'github_id and id'} of the wrong type", where,
                               "pass the output of `mlbench prep`")
        out.append((where, rec))
    return out


def read_answers(generations: str | Path, results: list[EvalResult], prompts: dict[Key, PrepRecord],
                 parser: str, mode: str) -> dict[Key, list[Answer]]:
    """Each training row's sampled answers with their verdicts (answers without one are left out). A generation
    or a verdict of a row that is not a training prompt is an error: learning reads training rows only."""
    verdicts: dict[tuple[Key, int], EvalResult] = {}
    for r in results:
        if r.mode != mode:
            raise MLBenchError(f"the eval results are {r.mode} verdicts; the reward reads {mode}", "--results",
                               f"score the generations with `mlbench eval --mode {mode}` (or set reward.mode)")
        if mode == "strict" and r.passed and r.timed_out:  # eval's --timeout-pass: the sleeper's pass
            raise MLBenchError(f"a strict verdict passes an answer still running at the limit (github_id="
                               f"{r.github_id} id={r.id} sample {r.idx}: `mlbench eval --timeout-pass`)", "--results",
                               "score the generations in strict mode without --timeout-pass")
        verdicts[(r.key, r.idx)] = r
    out: dict[Key, list[Answer]] = {}
    for ln, row in read_jsonl(generations):
        where = f"{generations}:{ln}"
        try:
            key = (int(row["github_id"]), int(row["id"]))
        except (KeyError, TypeError, ValueError, OverflowError):
            raise MLBenchError("each line needs integer `github_id` and `id`", where) from None
        if key not in prompts:
            raise MLBenchError(f"github_id={key[0]} id={key[1]} is not a prompt of the training split", where,
                               "pass the generations of the training split's prompts")
        raw, output = row.get("raw"), row.get("output")
        texts = raw if raw is not None else output
        for name, value in (("raw", raw), ("output", output)):
            if value is not None and (not isinstance(value, list) or not all(isinstance(t, str) for t in value)):
                raise MLBenchError(f"`{name}` must be a list of strings", where)
        if texts is None:
            raise MLBenchError("each line needs `raw` or `output`", where)
        answers = []
        for i, text in enumerate(texts):
            # eval ran `output` where there is one: the text trained on must be what it ran
            code = parse_response(text, parser) if output is None else output[i] if i < len(output) else None
            if code is None or (raw is not None and output is not None and parse_response(text, parser) != code):
                raise MLBenchError(f"sample {i}: `raw` does not parse (--parser {parser}) to its `output`", where,
                                   "pass the generations file `mlbench infer` wrote, unchanged")
            v = verdicts.get((key, i))
            if v is None:
                continue
            if v.output_sha != output_sha(valid_text(code)):
                raise MLBenchError(f"the verdict on github_id={key[0]} id={key[1]} sample {i} is on another text",
                                   "--results", "pass the eval folder that scored this generations file")
            answers.append(Answer(i, text, code, bool(v.passed), v.error_class))
        out[key] = answers
    stray = sorted({k for k, _ in verdicts} - set(prompts))
    if stray:
        raise MLBenchError(f"verdicts on rows outside the training split (first: github_id={stray[0][0]} "
                           f"id={stray[0][1]})", "--results", "pass the eval folder of the training split's answers")
    return out


def build(prompts: dict[Key, PrepRecord], answers: dict[Key, list[Answer]], *, include_gold: bool,
          max_per_row: int, max_pairs_per_row: int, gold_as_chosen: bool, parser: str = "compat",
          evaluated: frozenset[str] = frozenset()) -> LearningData:
    """SFT records (per row: the gold answer when ``include_gold``, then up to ``max_per_row`` distinct passing
    answers, distinct by their whitespace-normalised code) and pairs (distinct passing x distinct failing, in
    sample order, up to ``max_pairs_per_row``; with ``gold_as_chosen`` a row without a passing answer pairs the
    gold answer with its failures).

    Left out, and counted: an answer whose code is one of ``evaluated`` (the evaluation split's answers,
    :func:`evaluated_answers`: a model may write one on a training row, and training on it would score as a leak),
    and a failing answer whose code also passed, or is the gold answer's where the gold is chosen (its verdicts
    disagree, or the environment fails the gold itself: a pair would teach that an answer is worse than itself)."""
    data = LearningData()
    n = dict.fromkeys(("rows", "answers", "passed", "rows_with_pass", "rows_with_pair", "sft_passing", "sft_gold",
                       "evaluated_answers_left_out", "ambiguous_failures_left_out"), 0)
    for key, rec in sorted(prompts.items()):
        got = answers.get(key, [])
        n["rows"] += 1
        n["answers"] += len(got)
        n["passed"] += sum(a.passed for a in got)
        kept = [a for a in got if normalized_text(a.code) not in evaluated]
        n["evaluated_answers_left_out"] += len(got) - len(kept)
        passing = _distinct([a for a in kept if a.passed])
        gold = {normalized_text(rec.output), _code(rec.answer, parser)}
        known = {normalized_text(a.code) for a in passing} or (gold if gold_as_chosen else set())
        failing = _distinct([a for a in kept if not a.passed])
        n["ambiguous_failures_left_out"] += sum(normalized_text(a.code) in known for a in failing)
        failing = [a for a in failing if normalized_text(a.code) not in known]
        n["rows_with_pass"] += bool(passing)
        if include_gold:
            data.sft.append(rec)
            n["sft_gold"] += 1
        for a in passing[:max_per_row]:
            if include_gold and normalized_text(a.code) in gold:
                continue  # the gold answer itself, already there
            data.sft.append(replace(rec, answer=a.text))
            n["sft_passing"] += 1
        chosen = [a.text for a in passing] or ([rec.answer] if gold_as_chosen else [])
        pairs = [(c, r.text) for c in chosen for r in failing][:max_pairs_per_row]
        n["rows_with_pair"] += bool(pairs)
        data.pairs += [{"github_id": key[0], "id": key[1], "prompt": rec.prompt, "chosen": c, "rejected": r}
                       for c, r in pairs]
    n["pairs"] = len(data.pairs)
    data.stats = n
    return data


def _distinct(answers: list[Answer]) -> list[Answer]:
    seen: set[str] = set()
    out = []
    for a in answers:
        norm = normalized_text(a.code)
        if norm and norm not in seen:
            seen.add(norm)
            out.append(a)
    return out


def scored_answers(cfg: LearnConfig, prompts: dict[Key, PrepRecord], generations: str | Path,
                   results_dir: str | Path) -> dict[Key, list[Answer]]:
    """Each training row's answers in ``generations`` with their verdicts from the eval folder ``results_dir``
    (checked as :func:`read_answers` checks them, in the reward's mode)."""
    _, results = read_scored_folder(results_dir, "--results")
    return read_answers(generations, results, prompts, cfg.parser, cfg.reward.mode)


def from_verdicts(cfg: LearnConfig, generations: str | Path, results_dir: str | Path, include_gold: bool,
                  max_per_row: int) -> LearningData:
    """The learning data of one scored run of the training split (the ``data`` method; every rft round)."""
    prompts = training_prompts(cfg)
    answers = scored_answers(cfg, prompts, generations, results_dir)
    return build(prompts, answers, include_gold=include_gold, max_per_row=max_per_row,
                 max_pairs_per_row=cfg.dpo.max_pairs_per_row, gold_as_chosen=cfg.dpo.gold_as_chosen,
                 parser=cfg.parser, evaluated=evaluated_answers(cfg))


def mixed_rows(prompts: dict[Key, PrepRecord], answers: dict[Key, list[Answer]]) -> dict[Key, float]:
    """GRPO's ``mixed`` curriculum: each training row whose scored answers hold both a pass and a fail, with its
    pass rate. A row whose answers all pass or all fail gives a group of equal rewards, so no gradient (for a row of
    pass rate p a group of G holds both with probability 1 - p^G - (1-p)^G); a row without verdicts is left out."""
    rates = {}
    for key in sorted(prompts):
        got = answers.get(key, [])
        passed = sum(a.passed for a in got)
        if 0 < passed < len(got):
            rates[key] = passed / len(got)
    return rates


def curriculum(cfg: LearnConfig, prompts: dict[Key, PrepRecord]) -> tuple[dict[Key, PrepRecord], list[dict[str, Any]]]:
    """The prompts GRPO trains on (``grpo.curriculum``) and, for ``mixed``, the rows kept with their pass rates in
    ``--generations``/``--results``. No row left is one error: nothing to learn from, say what would give some."""
    if cfg.grpo.curriculum == "all":
        return prompts, []
    rates = mixed_rows(prompts, scored_answers(cfg, prompts, str(cfg.generations), str(cfg.results)))
    if not rates:
        raise MLBenchError(f"grpo.curriculum mixed: none of the {len(prompts)} training rows has both a passing and "
                           "a failing answer in --results", str(cfg.results),
                           "sample more answers per row (rft.k), or train on every row (grpo.curriculum: all)")
    kept = [{"github_id": k[0], "id": k[1], "pass_rate": rate} for k, rate in rates.items()]
    return {k: prompts[k] for k in rates}, kept
