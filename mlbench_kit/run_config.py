"""`mlbench run`'s options as one typed config: a model (and adapters) and the rows to score, then each stage's own
config file (prep, infer, eval: the paper's by default) for everything else. The run builds each stage's config
from these, exactly as that stage's command line would (:func:`mlbench_kit.stages.load_stage_config`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from .config import Check, option
from .errors import MLBenchError
from .records import TASKS

HUB_ID = "super-dainiu/ml-bench"


@dataclass
class RunConfig:
    """Everything `mlbench run` runs: prep -> infer -> eval -> report in one folder (``OUT/prep``, ``OUT/infer``,
    ``OUT/eval/<model>/task<t>``, ``OUT/report``), one summary at the end."""

    model: str | None = option(None, "base model: local folder or hub id (its tokenizer cuts the prompts); required",
                               flag=True)
    adapters: list[str] = option(help="LoRA adapters of the model to score beside it, in one engine",
                                 factory=list, metavar="NAME=DIR", flag=True)
    with_base: bool = option(True, "score the model as released beside the adapters", negated="--no-base")
    data: str = option(HUB_ID, "ML-Bench rows: hub id, .jsonl/.parquet file or save_to_disk folder", flag=True)
    split: str = option("full", "the split to score, by prep's names (full, quarter, test, ...)", flag=True)
    tasks: list[int] = option(help="tasks to score", factory=lambda: [3], choices=TASKS, flag=True, alias=("--task",))
    readmes: str | None = option(None, "prep: folder of READMEs laid out as DIR/<repo>/<path>/README.md", flag=True)
    repos_dir: str | None = option(None, "prep: folder of repository checkouts (DIR/<repo>); eval runs in them too",
                                   flag=True)
    checkout: str | None = option(None, "prep: clone the repositories of this repos.json at their pinned commits "
                                  "into --repos-dir", flag=True)
    template: Literal["paper", "llama-inst", "chat"] | None = option(
        None, "prompt template (default: the prep config's: the paper's)", flag=True)
    envs: str | None = option(None, "eval: YAML of per-repository environments (default: $MLBENCH_CACHE/envs.yaml, "
                              "what `mlbench env build` writes)", flag=True)
    mode: Literal["compat", "strict"] = option("compat", "eval: compat is the benchmark's checker, strict ours",
                                               flag=True)
    limit: int | None = option(None, "only the first N prompts per task (smoke runs)", flag=True)
    prep_config: str | None = option("configs/prep/paper.yaml", "prep's config file (the options above win)", flag=True)
    infer_config: str | None = option("configs/infer/paper.yaml", "infer's config file: engine and sampling", flag=True)
    eval_config: str | None = option(None, "eval's config file: sandbox, limits, k (default: eval's defaults)",
                                     flag=True)
    reference: str | None = option("configs/report/paper-rows.yaml", "report: published rows quoted beside yours",
                                   flag=True)
    out: str | None = option(None, "the run's folder: every stage writes a sub-folder of it; required", flag=True)

    def check(self, at: Check) -> None:
        if not self.tasks or any(t not in TASKS for t in self.tasks):
            raise MLBenchError(f"`tasks` are among {list(TASKS)}, got {self.tasks}", at("tasks"))
        if self.limit is not None and self.limit < 1:
            raise MLBenchError(f"`limit` must be at least 1, got {self.limit}", at("limit"))
        for spec in self.adapters:
            name, eq, path = spec.partition("=")
            if not eq or not name or not path:
                raise MLBenchError(f"`adapters` take NAME=DIR, got {spec!r}", at("adapters"))

    def require_inputs(self, source: str | None) -> None:
        """A run needs a model and a folder (a config without them is fine to load)."""
        missing = [f"--{k}" for k in ("model", "out") if getattr(self, k) is None]
        if missing:
            raise MLBenchError(f"missing {', '.join(missing)}: mlbench run needs --model and --out", source,
                               "e.g. mlbench run --model codellama/CodeLlama-7b-Instruct-hf --repos-dir runs/repos "
                               "--checkout ../shared/mlbench/repos.json --out runs/cl (mlbench run --help lists "
                               "every option)")

    def check_stages(self) -> None:
        """Every stage's config as the run would build it (prep, infer, each eval, report), each checked as its own
        command line checks it: ``mlbench run --check`` reports a bad stage option without running anything."""
        from pathlib import Path

        from .pipeline import stage_configs  # the pipeline imports this module
        stage_configs(self, Path(str(self.out or "OUT")))
