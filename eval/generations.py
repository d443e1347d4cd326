"""Read and validate a generations file: ``{"github_id", "id", "output": [n strings]}`` per line."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from mlbench_kit.dataset import Sample
from mlbench_kit.errors import MLBenchError
from mlbench_kit.io import read_jsonl
from mlbench_kit.parse import parse_response
from mlbench_kit.records import valid_text

REFERENCE_N = 5  # the benchmark's checker silently drops rows whose output list has another length


@dataclass
class Generations:
    """Validated generations keyed by (github_id, id), with what the benchmark would have hidden."""

    outputs: dict[tuple[int, int], list[str]]
    n: int
    reference_would_drop: list[dict] = field(default_factory=list)
    missing: list[tuple[int, int]] = field(default_factory=list)
    tasks: set[int] = field(default_factory=set)  # the `task` field of infer's records, when present
    invalid_unicode: list[tuple[int, int]] = field(default_factory=list)  # rows with text no UTF-8 can hold

    @classmethod
    def gold(cls, samples: dict[tuple[int, int], Sample]) -> Generations:
        """The dataset's own answers, one output per sample (``mlbench eval --gold``)."""
        return cls({k: [s.output] for k, s in samples.items()}, 1)

    def select(self, samples: dict[tuple[int, int], Sample], repos: list[str] | None, limit: int | None) -> None:
        """Keep only the rows of ``repos`` (when given), then only the first ``limit`` rows of the data."""
        if repos:
            unknown = sorted(set(repos) - {s.repo for s in samples.values()})
            if unknown:
                raise MLBenchError(f"no rows of repositories {unknown} in the data", "--repos",
                                   f"repositories here: {sorted({s.repo for s in samples.values()})}")
            self.outputs = {k: v for k, v in self.outputs.items() if samples[k].repo in repos}
            self.missing = [k for k in self.missing if samples[k].repo in repos]
        if limit:
            first = {k for k in samples if repos is None or samples[k].repo in repos}
            first = set(sorted(first, key=list(samples).index)[:limit])
            self.outputs = {k: v for k, v in self.outputs.items() if k in first}
            self.missing = [k for k in self.missing if k in first]


def load_generations(path: str | Path, samples: dict[tuple[int, int], Sample], parser: str = "compat",
                     n: int | None = None) -> Generations:
    """Validate every line; ``raw`` responses (when ``output`` is absent) are parsed into code."""
    outputs: dict[tuple[int, int], list[str]] = {}
    lines: dict[tuple[int, int], int] = {}
    tasks: set[int] = set()
    invalid: list[tuple[int, int]] = []
    for ln, row in read_jsonl(path, errors="surrogateescape"):
        where = f"{path}:{ln}"
        try:
            key = (int(row["github_id"]), int(row["id"]))
        except (KeyError, TypeError, ValueError, OverflowError):  # OverflowError: 1e400
            raise MLBenchError("each line needs integer `github_id` and `id`", where) from None
        if key not in samples:
            raise MLBenchError(f"unknown sample github_id={key[0]} id={key[1]} (not in the dataset)", where,
                               "score against the split the generations were made for (--data/--split)")
        if key in outputs:
            raise MLBenchError(f"duplicate line for github_id={key[0]} id={key[1]} (first at line {lines[key]})", where)
        outs = row.get("output")
        if outs is None and "raw" in row:
            raw = row["raw"]
            if not isinstance(raw, list) or not all(isinstance(x, str) for x in raw):
                raise MLBenchError("`raw` must be a list of strings", where)
            outs = [parse_response(x, parser) for x in raw]
        if isinstance(outs, str):
            outs = [outs]
        if not isinstance(outs, list) or not outs or not all(isinstance(x, str) for x in outs):
            raise MLBenchError("`output` must be a non-empty list of strings", where)
        clean = [valid_text(x) for x in outs]
        if clean != outs:
            invalid.append(key)
        outputs[key], lines[key] = clean, ln
        if isinstance(row.get("task"), int):
            tasks.add(row["task"])
    if not outputs:
        raise MLBenchError("no generations", str(path))
    n_expected = n or Counter(len(v) for v in outputs.values()).most_common(1)[0][0]
    drop = [{"github_id": k[0], "id": k[1], "line": lines[k], "outputs": len(v)}
            for k, v in outputs.items() if len(v) != REFERENCE_N]
    missing = sorted(set(samples) - set(outputs))
    return Generations(outputs, n_expected, drop, missing, tasks, invalid)
