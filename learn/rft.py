"""Rejection-sampling fine-tuning (expert iteration, STaR-style): ``rft.rounds`` rounds of

    sample k answers per training prompt (`mlbench infer`, the current adapter)
    -> execute them (`mlbench eval`, the reward's mode: strict by default)
    -> keep the distinct passing answers (``learn/data.py``)
    -> SFT from the base model on the gold answers and every round's passing answers so far (`mlbench train`).

Each round lives in ``OUT/round-R/`` (``infer/``, ``eval/``, ``sft.jsonl``, ``train/``), each of its steps is run by
the stage's own command in its own process (as a sweep's units are) and stamped when complete, so a re-run resumes
at the first unfinished step (the stages resume their own work inside it). The last round's adapter is published as
``OUT/adapter``; ``OUT/rounds.jsonl`` holds each round's counts and seconds.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from mlbench_kit.config import load, parse_set, save_resolved
from mlbench_kit.dataset import normalized_text
from mlbench_kit.errors import MLBenchError
from mlbench_kit.hf import TRAIN_META
from mlbench_kit.io import atomic_dir, read_jsonl, write_json_atomic, write_jsonl_atomic
from mlbench_kit.learn_config import LearnConfig
from mlbench_kit.parse import parse_response
from mlbench_kit.records import PrepRecord
from mlbench_kit.train_config import TrainConfig

from .data import from_verdicts, training_prompts


def mlbench(*argv: str, log: Path) -> None:
    """One stage's command, in its own process, its output in ``log``; a failure names the log."""
    cmd = [sys.executable, "-I", "-m", "mlbench_kit.cli", *argv]  # -I: nothing of the working folder is imported
    with open(log, "a", encoding="utf-8") as f:
        f.write("$ mlbench " + " ".join(argv) + "\n")
        f.flush()
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL).returncode
    if rc == 3:  # eval's faults: answers left unscored by the environment, so the step is not done
        raise MLBenchError("some answers were not scored: the environment or the sandbox failed, not the model",
                           str(log), "see faults.jsonl beside the round's eval results, fix the environment "
                           "(`mlbench env check`), then re-run the same command: the round resumes at its eval")
    if rc != 0:
        raise MLBenchError(f"mlbench {argv[0]} failed (exit {rc})", str(log), "read the log; re-run to resume")


# what each round decides itself: a train config or --set naming one is refused
ROUND_KEYS = frozenset({"data.path", "data.extra", "data.prep_dir", "data.split", "data.task", "output_dir", "out",
                        "model"})


class RFTRecipe:
    """The rounds, declared as data: each step's name and what it runs."""

    def __init__(self, cfg: LearnConfig) -> None:
        self.cfg = cfg
        self.out = Path(str(cfg.out))

    def check(self) -> None:
        """What can be refused before anything is written or sampled: the keys ``rft.train_set`` may not set, and
        ``rft.train_config`` (it must load, and train on a round's records alone)."""
        self._train_config(self.out / "round-1")

    def setup(self) -> None:
        self.prompts = training_prompts(self.cfg)  # the leak check, before any sampling
        self.check()
        self.out.mkdir(parents=True, exist_ok=True)

    def steps(self, r: int, adapter: str | None) -> list[tuple[str, Callable[[Path], None]]]:
        """Round ``r``'s steps, sampling with ``adapter`` (None: the base model)."""
        cfg, s = self.cfg, self.cfg.sampling
        t = str(cfg.task)

        def infer(d: Path) -> None:
            conf = ["--config", cfg.rft.infer_config] if cfg.rft.infer_config else []
            with_adapter = ["--adapter", adapter] if adapter else []
            mlbench("infer", *conf, "--model", str(cfg.model), *with_adapter, "--prompts",
                    str(cfg.training_prompts()), "--tasks", t, "--n", str(cfg.rft.k), "--temperature",
                    str(s.temperature), "--top-p", str(s.top_p), "--top-k", str(s.top_k), "--max-new-tokens",
                    str(s.max_new_tokens), "--seed", str(s.seed + r), "--parser", cfg.parser, "--out",
                    str(d / "infer"), log=d / "infer.log")

        def execute(d: Path) -> None:
            timeout = ["--timeout", str(cfg.timeout)] if cfg.timeout is not None else []
            mlbench("eval", "--data", str(cfg.data), "--split", cfg.rows_split(), "--generations",
                    str(d / "infer" / f"task{t}.jsonl"), "--envs", str(cfg.envs), "--mode", cfg.reward.mode,
                    "--backend", cfg.backend, "--workers", str(cfg.workers), *timeout, "--parser", cfg.parser,
                    "--no-ci", "--out", str(d / "eval"), log=d / "eval.log")

        def select(d: Path) -> None:
            records: dict[tuple[tuple[int, int], str], PrepRecord] = {}
            stats = {}
            for q in range(1, r + 1):  # every round's passing answers so far (expert iteration keeps them)
                rd = self.out / f"round-{q}"
                got = from_verdicts(cfg, rd / "infer" / f"task{t}.jsonl", rd / "eval", cfg.rft.include_gold,
                                    cfg.rft.max_per_row)
                for rec in got.sft:  # distinct by normalised code across rounds too, as within one (data.py)
                    records.setdefault((rec.key, normalized_text(parse_response(rec.answer, cfg.parser))), rec)
                if q == r:
                    stats = got.stats
            write_jsonl_atomic(d / "sft.jsonl", [rec.to_json() for rec in records.values()])
            write_json_atomic(d / "data.json", {**stats, "sft_records": len(records)})

        def train(d: Path) -> None:
            mlbench("train", "--config", str(self.train_config(d)), log=d / "train.log")

        return [("infer", infer), ("eval", execute), ("select", select), ("train", train)]

    def train_set(self) -> dict:
        """``rft.train_set`` as overrides; the keys a round owns (its data, model, folder, logging) are refused."""
        over = parse_set(self.cfg.rft.train_set, "rft.train_set")
        owned = sorted(k for k in over if k in ROUND_KEYS or k.startswith("logging."))
        if owned:
            raise MLBenchError(f"rft.train_set may not set {', '.join(owned)}: each round sets what it trains on, the "
                               "model and where it writes", "rft.train_set", "set only optim.*, lora.* and the like")
        return over

    def train_config(self, d: Path) -> Path:
        """Round ``d``'s training config, resolved here and written whole as ``d/train.yaml``: the round decides
        what it trains on (its ``sft.jsonl`` alone), the model and where it writes; ``rft.train_set`` may only
        tune the training (a handed-over config cannot point it at the evaluation split or outside OUT)."""
        save_resolved(self._train_config(d), d / "train.yaml")
        return d / "train.yaml"

    def _train_config(self, d: Path) -> TrainConfig:
        cfg = self.cfg
        over = self.train_set()
        over.update({"model": (str(cfg.model), "--model"), "data.path": (str(d / "sft.jsonl"), "rft"),
                     "data.task": (cfg.task, "--task"), "output_dir": (str(d / "train"), "rft")})
        tc = load(TrainConfig, cfg.rft.train_config, over)
        if tc.data.extra:
            raise MLBenchError(f"rft.train_config trains on more files too (data.extra: {tc.data.extra})",
                               cfg.rft.train_config, "a round trains on its own records alone: remove data.extra")
        return tc

    def train(self) -> Path:
        adapter = self.cfg.adapter
        for r in range(1, self.cfg.rft.rounds + 1):
            d = self.out / f"round-{r}"
            d.mkdir(exist_ok=True)
            t0 = time.monotonic()
            for name, step in self.steps(r, adapter):
                stamp = d / f".done-{name}"
                if stamp.exists():
                    continue
                print(f"learn: rft round {r}/{self.cfg.rft.rounds}: {name}", file=sys.stderr, flush=True)
                step(d)
                stamp.touch()
            stats = json.loads((d / "data.json").read_text())
            self._record(r, stats, time.monotonic() - t0)
            adapter = str(d / "train" / "adapter")
        return self._publish(Path(str(adapter)))

    def _record(self, r: int, stats: dict, seconds: float) -> None:
        path = self.out / "rounds.jsonl"
        rows = [row for _, row in read_jsonl(path) if row.get("round") != r] if path.is_file() else []
        write_jsonl_atomic(path, [*rows, {"round": r, **stats, "seconds_this_run": round(seconds, 1)}])
        print(f"learn: rft round {r}: {stats['passed']}/{stats['answers']} samples passed "
              f"({stats['rows_with_pass']}/{stats['rows']} rows); {stats['sft_records']} SFT records",
              file=sys.stderr, flush=True)

    def _publish(self, adapter: Path) -> Path:
        final = self.out / "adapter"
        with atomic_dir(final) as tmp:
            shutil.copytree(adapter, tmp, dirs_exist_ok=True)
            meta = json.loads((adapter / TRAIN_META).read_text()) if (adapter / TRAIN_META).is_file() else {}
            meta["learned"] = {"method": "rft", "rounds": self.cfg.rft.rounds, "k": self.cfg.rft.k,
                               "from_adapter": self.cfg.adapter}
            write_json_atomic(tmp / TRAIN_META, meta)
        print(f"learn: rft done; adapter: {final}", file=sys.stderr)
        return final
