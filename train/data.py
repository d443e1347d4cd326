"""Prep records -> token ids with prompt-masked labels -> micro-batches (packing, length-grouped or padded).

Packing puts several samples in one sequence with position ids restarting at 0 for each sample and no
attention mask: transformers then builds a block-diagonal causal mask (sdpa/eager) or runs variable-length
flash attention, so no token attends across samples. The order of an epoch is a pure function of
(seed, epoch), which is what makes a resumed run see exactly the batches an uninterrupted run would.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from mlbench_kit.errors import MLBenchError
from mlbench_kit.hf import prompt_ids
from mlbench_kit.records import PrepRecord, read_prep_records

IGNORE = -100


@dataclass(frozen=True)
class Example:
    key: tuple[int, int]
    input_ids: list[int]
    labels: list[int]  # IGNORE on prompt tokens; the answer and EOS are trained

    def __len__(self) -> int:
        return len(self.input_ids)


def tokenize_record(rec: PrepRecord, tok: Any) -> Example:
    """BOS + prompt (masked), answer + EOS (trained); a chat prompt carries its specials as text."""
    prompt = prompt_ids(tok, rec.prompt, rec.template)
    answer = tok(rec.answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    return Example(rec.key, prompt + answer, [IGNORE] * len(prompt) + answer)


def load_examples(path: Path, tok: Any, template: str, max_context_tokens: int
                  ) -> tuple[list[Example], list[str]]:
    """Tokenize a prep file. Records longer than ``max_context_tokens`` are dropped (and reported), never cut."""
    examples: list[Example] = []
    dropped: list[Example] = []
    notes: list[str] = []
    for where, rec in read_prep_records(path):
        if rec.template != template:
            raise MLBenchError(f"record rendered with template {rec.template!r}, the config says {template!r}",
                               where, f"re-run `mlbench prep --template {template}` or change template:")
        ex = tokenize_record(rec, tok)
        (examples if len(ex) <= max_context_tokens else dropped).append(ex)
    if dropped:
        notes.append(f"{len(dropped)} records longer than max_context_tokens {max_context_tokens} were left out "
                     f"(re-run prep with --max-context-tokens {max_context_tokens} and this tokenizer to cut their "
                     "README instead)")
    if not examples and dropped:
        raise MLBenchError(f"no training records fit: all {len(dropped)} are longer than max_context_tokens "
                           f"{max_context_tokens}", str(path),
                           f"re-run mlbench prep with this model's tokenizer (--tokenizer) and --max-context-tokens "
                           f"{max_context_tokens}: it cuts each README to fit")
    if not examples:
        raise MLBenchError("no training records: the prep output is empty", str(path),
                           "re-run mlbench prep for this split and task (its --tasks; --build-splits for id_train/"
                           "ood_train), or choose another --split/--task")
    return examples, notes


def split_eval(examples: list[Example], fraction: float, seed: int) -> tuple[list[Example], list[Example]]:
    """Hold out a stable ``fraction`` (by a hash of the sample key, so it never moves between runs)."""
    if fraction <= 0:
        return examples, []

    def bucket(e: Example) -> float:
        h = hashlib.sha256(f"{seed}:{e.key}".encode()).digest()
        return int.from_bytes(h[:8], "big") / 2**64

    held = [e for e in examples if bucket(e) < fraction]
    if not held or len(held) == len(examples):
        held = examples[-1:] if len(examples) > 1 else []
    keys = {e.key for e in held}
    return [e for e in examples if e.key not in keys], held


def pack(lengths: list[int], capacity: int) -> list[list[int]]:
    """Best-fit decreasing: indices grouped into bins whose total length fits ``capacity``."""
    bins: list[list[int]] = []
    free: list[tuple[int, int]] = []  # (room left, bin index), kept sorted: best fit = first with enough room
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        j = bisect.bisect_left(free, (lengths[i], -1))
        if j == len(free):
            bins.append([i])
            room, b = capacity - lengths[i], len(bins) - 1
        else:
            room, b = free.pop(j)
            bins[b].append(i)
            room -= lengths[i]
        bisect.insort(free, (room, b))
    return bins


def epoch_batches(examples: list[Example], mode: str, micro_batch: int, max_context_tokens: int, seed: int,
                  epoch: int) -> list[list[list[int]]]:
    """The micro-batches of one epoch: each a list of rows, each row a list of example indices."""
    rng = random.Random(seed * 100_003 + epoch)
    order = list(range(len(examples)))
    rng.shuffle(order)
    if mode == "packing":
        rows = [[order[j] for j in b] for b in pack([len(examples[i]) for i in order], max_context_tokens)]
        rng.shuffle(rows)
    elif mode == "grouped":
        # sort within chunks of 64 micro-batches, so batches hold similar lengths but the epoch stays shuffled
        chunk = 64 * micro_batch
        rows = []
        for s in range(0, len(order), chunk):
            rows += [[i] for i in sorted(order[s: s + chunk], key=lambda i: len(examples[i]))]
    else:
        rows = [[i] for i in order]
    batches = [rows[s: s + micro_batch] for s in range(0, len(rows), micro_batch)]
    if mode == "grouped":
        rng.shuffle(batches)
    return batches


def collate(examples: list[Example], rows: list[list[int]], pad_id: int) -> dict[str, torch.Tensor]:
    """Tensors for one micro-batch.

    Packed rows are laid end to end in ONE row, position ids restarting at 0 for every sample and no attention
    mask: transformers recognises packed sequences from the position ids only in a batch of one, and then keeps
    samples apart (a block-diagonal causal mask for sdpa/eager, varlen kernels for FlashAttention-2). A batch
    of several packed rows would silently attend across samples. Single-sample rows are right-padded with an
    attention mask. Padding is never a target; ``real_tokens`` counts the tokens that are not padding."""
    packed = any(len(r) > 1 for r in rows)
    if packed:
        rows = [[i for r in rows for i in r]]
    seqs, labels, pos = [], [], []
    for r in rows:
        ids, lab, p = [], [], []
        for i in r:
            ids += examples[i].input_ids
            lab += examples[i].labels
            p += list(range(len(examples[i])))
        seqs.append(ids)
        labels.append(lab)
        pos.append(p)
    width = max(len(s) for s in seqs)
    batch = {"input_ids": torch.full((len(rows), width), pad_id, dtype=torch.long),
             "labels": torch.full((len(rows), width), IGNORE, dtype=torch.long),
             "position_ids": torch.zeros((len(rows), width), dtype=torch.long)}
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for b, (ids, lab, p) in enumerate(zip(seqs, labels, pos, strict=True)):
        n = len(ids)
        batch["input_ids"][b, :n] = torch.tensor(ids)
        batch["labels"][b, :n] = torch.tensor(lab)
        batch["position_ids"][b] = torch.tensor(p + list(range(width - n)))
        mask[b, :n] = 1
    if not packed:
        batch["attention_mask"] = mask
    batch["real_tokens"] = torch.tensor(sum(len(s) for s in seqs))
    return batch


def varlen_kwargs(position_ids: torch.Tensor, device: Any = None) -> dict[str, Any]:
    """The sample boundaries of ONE packed row for varlen flash attention, computed once per micro-batch on the host.

    Given as ``cu_seq_lens_q/k`` and ``max_length_q/k``, transformers' flash path uses them as they are in every
    layer (``_flash_attention_forward``: "pre-computed cu_seqlens"); without them it derives them from the
    position ids in each layer and its recompute (``_is_packed_sequence``, ``prepare_fa_kwargs_from_position_ids``:
    a ``nonzero`` and a ``bool()`` each, host syncs). Same values as ``prepare_fa_kwargs_from_position_ids``."""
    pos = position_ids.reshape(-1).tolist()
    starts = [i for i, p in enumerate(pos) if p == 0] + [len(pos)]
    longest = max(b - a for a, b in itertools.pairwise(starts))
    cu = torch.tensor(starts, dtype=torch.int32, device=device)
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}
