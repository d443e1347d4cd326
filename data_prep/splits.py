"""ID/OOD training splits built from any rows (the leak check between train and test is the core's:
:func:`mlbench_kit.dataset.check_no_leak`)."""

from __future__ import annotations

import random
from collections import defaultdict

from mlbench_kit.dataset import Sample, check_no_leak, normalized_text
from mlbench_kit.errors import MLBenchError


def _groups(samples: list[Sample]) -> list[list[Sample]]:
    """Samples that share an instruction or an answer stay together (union-find), so no split can leak."""
    parent = list(range(len(samples)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    first: dict[str, int] = {}
    for i, s in enumerate(samples):
        for key in ("I:" + normalized_text(s.instruction), "O:" + normalized_text(s.output)):
            if key in first:
                parent[find(i)] = find(first[key])
            else:
                first[key] = i
    out: dict[int, list[Sample]] = defaultdict(list)
    for i, s in enumerate(samples):
        out[find(i)].append(s)
    return list(out.values())


def build_splits(samples: list[Sample], ood_repos: list[str], id_test_fraction: float = 0.5,
                 seed: int = 0) -> dict[str, list[Sample]]:
    """Split rows like the paper: ``test`` and ``id_train`` share repositories but no samples;
    ``ood_train`` holds only the repositories in ``ood_repos``, which never appear in ``test``."""
    known = {s.repo for s in samples}
    unknown = sorted(set(ood_repos) - known)
    if unknown:
        raise MLBenchError(f"--ood-repos names repositories not in the data: {unknown}", "--ood-repos",
                           f"choose from {sorted(known)}")
    if not 0 < id_test_fraction < 1:
        raise MLBenchError(f"id_test_fraction must be in (0, 1), got {id_test_fraction}", "--id-test-fraction")
    rng = random.Random(seed)
    out: dict[str, list[Sample]] = {"test": [], "id_train": [], "ood_train": []}
    by_repo: dict[str, list[Sample]] = defaultdict(list)
    for s in samples:
        by_repo[s.repo].append(s)
    for repo in sorted(by_repo):
        if repo in ood_repos:
            out["ood_train"].extend(by_repo[repo])
            continue
        groups = _groups(by_repo[repo])
        rng.shuffle(groups)
        n_test = max(1, round(len(by_repo[repo]) * id_test_fraction))
        taken = 0
        for g in groups:
            (out["test"] if taken < n_test else out["id_train"]).extend(g)
            taken += len(g) if taken < n_test else 0
    for rows in out.values():
        rows.sort(key=lambda s: s.key)
    check_no_leak(out["id_train"] + out["ood_train"], out["test"])
    return out
