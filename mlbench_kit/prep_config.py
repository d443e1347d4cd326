"""The prep stage's options as one typed config: ``mlbench prep`` flags, an optional ``--config`` YAML file and
sweeps build a :class:`PrepConfig`, which ``mlbench_kit.data_prep.prepare.prepare`` runs.

Every key of the file is a flag's name with ``_`` for ``-`` (``--max-context-tokens`` is ``max_context_tokens:``;
``--no-hf`` is ``hf: false``); a flag given on the command line wins over the file, the file over the defaults.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from .config import Check, option
from .dataset import HUB_ID
from .errors import MLBenchError
from .records import TASKS


@dataclass
class PrepConfig:
    """What prep reads, how it renders tasks 1-3, and where it writes."""

    data: str = option(HUB_ID, "hub id, .jsonl/.parquet file or save_to_disk folder", flag=True)
    splits: list[str] = option(help="splits to load (hub/DatasetDict: full quarter id_train ood_train; a file "
                               "holds one)", factory=lambda: ["full"], flag=True, alias=("--split",))
    readmes: str | None = option(None, "folder of READMEs laid out as DIR/<repo>/<path>/README.md", flag=True)
    repos_dir: str | None = option(None, "folder of repository checkouts (DIR/<repo>); with --checkout, cloned "
                                   "there", flag=True)
    checkout: str | None = option(None, "clone the repositories of this repos.json at their pinned commits",
                                  metavar="REPOS_JSON", flag=True)
    tasks: list[int] = option(help="tasks to render", factory=lambda: list(TASKS), choices=TASKS, flag=True)
    # data_prep.templates.TEMPLATES
    template: Literal["paper", "llama-inst", "chat"] = option("paper", "prompt template", flag=True)
    tokenizer: str | None = option(None, "tokenizer folder or hub id; without it nothing is truncated", flag=True)
    max_context_tokens: int = option(8192, "budget for prompt + answer + EOS, capped at the model's positions",
                                     flag=True, old=("max_tokens",))
    max_new_tokens: int = option(1024, "room left for generation in the splits inference reads (all but *train*): "
                                 "their prompts are cut to the model's positions minus this (the benchmark's; "
                                 "0: off)", flag=True)
    splitter: Literal["punkt", "regex"] = option("punkt", "sentence splitter for task 2 (punkt is the paper's; "
                                                 "regex an explicit fallback)", flag=True)
    build_splits: bool = option(False, "build test/id_train/ood_train from the loaded rows (see --ood-repos)",
                                flag=True)
    ood_repos: list[str] = option(help="repositories held out for ood_train", factory=list, nargs="*", flag=True)
    repos: list[str] | None = option(None, "only these repositories' rows (e.g. those whose environments are "
                                     "built); default: all", metavar="REPO", flag=True)
    id_test_fraction: float = option(0.5, "with --build-splits: the share of the ID repositories' rows kept for "
                                     "test", flag=True)
    seed: int = option(0, "seed of --build-splits' shuffle", flag=True)
    hf: bool = option(True, "datasets folders beside the JSONL", negated="--no-hf")
    out: str | None = option(None, "output folder (required)", flag=True)

    def check(self, at: Check) -> None:
        if self.out is None:
            where = at("out")
            raise MLBenchError("missing --out: mlbench prep needs --out DIR, the folder it writes (and --data ROWS, "
                               f"default {self.data})", None if where == "defaults" else where,
                               "e.g. mlbench prep --data ../shared/mlbench/full.jsonl --splits full --readmes "
                               "../shared/mlbench/readmes --out runs/prep (mlbench prep --help lists every option)")
        if not self.splits:
            raise MLBenchError("`splits` names at least one split", at("splits"))
        if not self.tasks or any(t not in TASKS for t in self.tasks):
            raise MLBenchError(f"`tasks` are among {list(TASKS)}, got {self.tasks}", at("tasks"))
        if self.max_context_tokens < 1:
            raise MLBenchError(f"`max_context_tokens` must be positive, got {self.max_context_tokens}",
                               at("max_context_tokens"))
        if self.max_new_tokens < 0:
            raise MLBenchError(f"`max_new_tokens` must be >= 0, got {self.max_new_tokens}", at("max_new_tokens"))
        if not 0 < self.id_test_fraction < 1:
            raise MLBenchError(f"`id_test_fraction` is between 0 and 1, got {self.id_test_fraction}",
                               at("id_test_fraction"))
        if self.checkout and not self.repos_dir:
            raise MLBenchError("`checkout` needs `repos_dir` to clone into", at("checkout"),
                               "pass --repos-dir DIR")
        if Path(self.data).suffix in (".jsonl", ".json", ".parquet") and len(self.splits) > 1:
            raise MLBenchError("a file holds one split; `splits` names it", at("splits"),
                               "pass one name, e.g. --splits test")
        if self.build_splits and len(self.splits) != 1:
            raise MLBenchError("`build_splits` takes exactly one loaded split", at("splits"))


