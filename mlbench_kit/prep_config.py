"""The prep stage's options as one typed config: ``mlbench prep`` flags, an optional ``--config`` YAML file and
sweeps build a :class:`PrepConfig`, which ``mlbench_kit.data_prep.prepare.prepare`` runs.

Every key of the file is a flag's name with ``_`` for ``-`` (``--max-context-tokens`` is ``max_context_tokens:``;
``--no-hf`` is ``hf: false``); a flag given on the command line wins over the file, the file over the defaults.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, ClassVar, Literal

from .config import Check, load
from .dataset import HUB_ID
from .deprecation import renamed_from
from .errors import MLBenchError
from .records import TASKS


@dataclass
class PrepConfig:
    """What prep reads, how it renders tasks 1-3, and where it writes."""

    # option name -> key (mlbench_kit.stages): every key is its own option; old option names -> new ones
    FLAGS: ClassVar[dict[str, str]] = {}
    FLAG_SPELLING: ClassVar[dict[str, str]] = {"hf": "--no-hf"}
    OLD_FLAGS: ClassVar[dict[str, str]] = {"max_tokens": "max_context_tokens"}

    data: str = HUB_ID  # hub id, .jsonl/.parquet file or save_to_disk folder
    splits: list[str] = field(default_factory=lambda: ["full"])
    readmes: str | None = None  # folder of READMEs laid out as DIR/<repo>/<path>/README.md
    repos_dir: str | None = None  # folder of checkouts (DIR/<repo>); with checkout, cloned there
    checkout: str | None = None  # a repos.json: clone its repositories at their pinned commits
    tasks: list[int] = field(default_factory=lambda: list(TASKS))
    template: Literal["paper", "llama-inst", "chat"] = "paper"  # data_prep.templates.TEMPLATES
    tokenizer: str | None = None  # without one nothing is truncated
    # prompt + answer + EOS, capped at the model's positions
    max_context_tokens: int = field(default=8192, metadata=renamed_from("max_tokens"))
    max_new_tokens: int = 1024  # room the evaluation splits' prompts leave for generation (0: off)
    splitter: Literal["punkt", "regex"] = "punkt"
    build_splits: bool = False  # test/id_train/ood_train from the loaded rows
    ood_repos: list[str] = field(default_factory=list)
    repos: list[str] | None = None  # only these repositories' rows
    id_test_fraction: float = 0.5
    seed: int = 0
    hf: bool = True  # also datasets folders beside the JSONL
    out: str | None = None

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


PrepConfig.FLAGS = {f.name: f.name for f in fields(PrepConfig)}


def load_prep_config(path: str | Path | None, overrides: dict[str, tuple[Any, str]] | None = None) -> PrepConfig:
    """A :class:`PrepConfig` from an optional YAML file plus ``{key: (value, origin)}`` overrides."""
    return load(PrepConfig, path, overrides)
