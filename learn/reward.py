"""The execution reward: answers scored by the checker exactly as `mlbench eval` scores them.

Each batch of answers is written as a generations file and handed to the eval stage's own entry, ``score(cfg)``,
resolved through the stage table (:func:`mlbench_kit.stages.stage`), with an :class:`EvalConfig` loaded and checked
like the command line's: the same parser, static checks, sandbox engines, limits and verdicts, so the reward cannot
disagree with `mlbench eval` on any engine. Each batch's eval folder and log are kept (``OUT/rewards/batch-NNNNN/``)
and every reward is appended to ``OUT/rewards.jsonl`` (rank R > 0 under DDP: ``batch-NNNNN-rankR/`` and
``rewards-rankR.jsonl``): reward curves and the reward-hacking check read these files.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from mlbench_kit.config import load
from mlbench_kit.dataset import normalized_text
from mlbench_kit.errors import MLBenchError
from mlbench_kit.eval_config import EvalConfig
from mlbench_kit.io import write_jsonl_atomic
from mlbench_kit.learn_config import LearnConfig, RewardConfig
from mlbench_kit.parse import parse_response
from mlbench_kit.records import EvalResult, read_eval_results
from mlbench_kit.stages import stage

Key = tuple[int, int]


def eval_config(cfg: LearnConfig, generations: Path, out: Path) -> EvalConfig:
    """The eval run that scores ``generations`` for learning: the reward's mode, the learn run's sandbox."""
    over: dict[str, tuple[Any, str]] = {
        "data": (cfg.data, "--data"), "split": (cfg.rows_split(), "--data-split"),
        "generations": (str(generations), "generations"), "out": (str(out), "out"),
        "mode": (cfg.reward.mode, "reward.mode"), "backend": (cfg.backend, "--backend"),
        "envs": (cfg.envs, "--envs"), "workers": (cfg.workers, "--workers"), "parser": (cfg.parser, "--parser"),
        "k": ([1], "k"), "ci": (False, "ci")}
    if cfg.timeout is not None:
        over["timeout"] = (cfg.timeout, "--timeout")
    return load(EvalConfig, None, over)


def shaped(verdict: EvalResult, code: str, reward: RewardConfig) -> float:
    """An answer's reward from its verdict: 1/0 for ``pass``; ``shaped`` adds the weighted partial credits."""
    value = 1.0 if verdict.passed else 0.0
    if reward.kind == "shaped":
        hits = verdict.param_hits
        value += reward.params_weight * (sum(hits.values()) / len(hits) if hits else 1.0)
        value += reward.type_weight * float(verdict.type_ok)
        value += reward.format_weight * float(bool(code.strip()))
    return value


class ExecutionReward:
    """A batched reward over the checker, callable as TRL's reward function (``prompts``, ``completions``, and the
    dataset's ``github_id`` and ``id`` columns). Returns one float per completion, or None where the environment
    faulted (no verdict: left out of the update, never scored as the model's failure)."""

    __name__ = "execution"

    def __init__(self, cfg: LearnConfig, out: Path, evaluated: frozenset[str] = frozenset()) -> None:
        self.cfg = cfg
        self.out = out
        self.evaluated = evaluated  # the evaluation split's answers (data.evaluated_answers): never rewarded
        self.score_fn = stage("eval").module().score  # the eval stage's own entry (imported when learning runs)
        # under DDP every process scores its own completions, in folders and a log of its own (rank 0's unsuffixed)
        self.rank = int(os.environ.get("RANK", "0") or 0)
        self.tag = "" if self.rank == 0 else f"-rank{self.rank}"
        self.log = out / f"rewards{self.tag}.jsonl"
        done = [int(m.group(1)) for p in (out / "rewards").glob("batch-*")
                if (m := re.fullmatch(rf"batch-(\d{{5}}){re.escape(self.tag)}", p.name))] \
            if (out / "rewards").is_dir() else []
        self.calls = max(done, default=0)  # a resumed run goes on after the last batch, never into one
        self._lock = threading.Lock()

    def score(self, keys: Sequence[Key], texts: Sequence[str], step: int | None = None) -> list[float | None]:
        """Rewards of ``texts[i]`` answering row ``keys[i]``, in order."""
        with self._lock:
            self.calls += 1
            batch = self.calls
            folder = self.out / "rewards" / f"batch-{batch:05d}{self.tag}"
        by_row: dict[Key, list[int]] = {}
        codes = [parse_response(t, self.cfg.parser) for t in texts]
        skipped = {i for i, c in enumerate(codes) if normalized_text(c or "") in self.evaluated}
        for i, key in enumerate(keys):  # an evaluated row's answer is not executed: no reward, left out
            if i not in skipped:
                by_row.setdefault(key, []).append(i)
        folder.mkdir(parents=True)  # a new folder: eval would resume an old batch's verdicts for new texts
        gens = folder / "generations.jsonl"
        write_jsonl_atomic(gens, [{"github_id": k[0], "id": k[1], "raw": [texts[i] for i in idx],
                                   "output": [codes[i] for i in idx]}
                                  for k, idx in by_row.items()])
        verdicts = self._execute(gens, folder) if by_row else {}
        rewards: list[float | None] = [None] * len(texts)
        rows = []
        for key, idx in by_row.items():
            for j, i in enumerate(idx):
                v = verdicts.get((key, j))
                rewards[i] = None if v is None else shaped(v, codes[i], self.cfg.reward)
                rows.append({"batch": batch, "rank": self.rank, "step": step, "github_id": key[0], "id": key[1],
                             "idx": j, "reward": rewards[i], "passed": None if v is None else v.passed,
                             "error_class": None if v is None else v.error_class,
                             "timed_out": None if v is None else v.timed_out})
        rows += [{"batch": batch, "rank": self.rank, "step": step, "github_id": keys[i][0], "id": keys[i][1],
                  "idx": None, "reward": None, "passed": None, "error_class": None, "timed_out": None,
                  "evaluated_answer": True} for i in sorted(skipped)]
        with self._lock, open(self.log, "a", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in rows)
        passed = sum(bool(r["passed"]) for r in rows)
        print(f"learn: reward batch {batch}{self.tag}: {passed}/{len(rows)} answers passed ({self.cfg.reward.mode}), "
              f"{sum(r['reward'] is None for r in rows)} not scored", file=sys.stderr, flush=True)
        return rewards

    def _execute(self, gens: Path, folder: Path) -> dict[tuple[Key, int], EvalResult]:
        """The batch's verdicts by (row, sample), from the eval stage's own entry."""
        with open(folder / "eval.log", "a", encoding="utf-8") as log, contextlib.redirect_stdout(log), \
                contextlib.redirect_stderr(log):  # eval's own lines stay with its batch; one line per batch here
            status = self.score_fn(eval_config(self.cfg, gens, folder / "eval"))
        if status not in (0, 3):  # 3: some executions faulted (their answers get no reward)
            raise MLBenchError(f"scoring the reward's batch failed (exit {status})", str(folder / "eval"))
        return {(r.key, r.idx): r for r in read_eval_results(folder / "eval" / "results.jsonl")}

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], **kw: Any) -> list[float | None]:
        ids, gids = kw.get("id"), kw.get("github_id")
        if ids is None or gids is None:
            raise MLBenchError("the reward needs each prompt's github_id and id columns", "learn dataset")
        state = kw.get("trainer_state")
        step = getattr(state, "global_step", None)
        return self.score([(int(g), int(i)) for g, i in zip(gids, ids, strict=True)], list(completions), step)
