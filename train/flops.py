"""FLOPs of a LoRA training step and the GPU's peak: model FLOPs utilisation (MFU) that means MFU.

Model FLOPs are what the algorithm needs, whatever the implementation; hardware FLOPs are what the GPU executes.
For a decoder with a frozen base and LoRA adapters, per token:

- every frozen linear layer (the attention and MLP projections and ``lm_head``; the embedding lookup is a
  gather, not a matmul) costs 2 FLOPs per weight forward and 2 backward (the gradient with respect to its
  input, which earlier layers' adapters need); its weight gradient is never computed: **4 N**, not 6 N;
- every LoRA weight costs 2 forward, 2 for the input gradient and 2 for its own weight gradient: **6 N_lora**;
- causal attention: for each (query, key) pair a sample really has (s(s+1)/2 for a sample of s tokens, counted
  over each packed sample's own length, never the packed row's), QK^T and PV cost 2 x heads x head_dim each
  forward, twice that backward (dQ, dK, dV, dP): **12 x heads x head_dim per pair and layer**.

Hardware FLOPs add what the implementation does on top: the recompute of every decoder layer's forward under
activation checkpointing, and, for a kernel that cannot skip masked blocks (SDPA or eager with a dense
block-diagonal mask over a packed row), attention over every (query, key) pair of the row. Norms, softmax,
RoPE and the loss are elementwise and left out of both, as is customary (PaLM, arXiv 2204.02311, appendix B).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

# How packed rows reach the attention kernel: its own varlen path (boundaries from cu_seqlens), a block-sparse mask
# (flex_attention's BlockMask skips the blocks outside every sample), or a dense [row, row] mask that the kernel
# applies to every block (sdpa, eager).
PACKED_PATH = {"flash_attention_2": "varlen", "flash_attention_3": "varlen", "flex_attention": "block_mask",
               "sdpa": "dense_mask", "eager": "dense_mask"}


@dataclass(frozen=True)
class ModelShape:
    """The shape-defining fields of a Llama-style decoder."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int
    head_dim: int

    @classmethod
    def from_config(cls, config: Any) -> ModelShape:
        """From a transformers config (or anything with its attribute names)."""
        g = (lambda k, d=None: config.get(k, d)) if isinstance(config, dict) else (
            lambda k, d=None: getattr(config, k, d))
        heads = g("num_attention_heads")
        return cls(hidden=g("hidden_size"), intermediate=g("intermediate_size"), layers=g("num_hidden_layers"),
                   heads=heads, kv_heads=g("num_key_value_heads") or heads, vocab=g("vocab_size"),
                   head_dim=g("head_dim") or g("hidden_size") // heads)

    def projections(self) -> dict[str, tuple[int, int]]:
        """(in, out) features of each linear layer of one decoder layer, by its module name."""
        h, q, kv, i = self.hidden, self.heads * self.head_dim, self.kv_heads * self.head_dim, self.intermediate
        return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
                "gate_proj": (h, i), "up_proj": (h, i), "down_proj": (i, h)}

    def layer_linear_params(self) -> int:
        return sum(a * b for a, b in self.projections().values())

    def linear_params(self) -> int:
        """N: the weights that are multiplied per token: every decoder projection and ``lm_head``."""
        return self.layers * self.layer_linear_params() + self.vocab * self.hidden

    def lora_params(self, r: int, targets: Iterable[str]) -> int:
        """LoRA weights (A: in x r, B: r x out) on ``targets`` in every layer."""
        p = self.projections()
        return self.layers * sum(r * (p[t][0] + p[t][1]) for t in targets if t in p)


def causal_pairs(lengths: Iterable[int]) -> int:
    """(query, key) pairs causal attention computes over samples of these lengths: sum of s(s+1)/2."""
    return sum(s * (s + 1) // 2 for s in lengths)


@dataclass(frozen=True)
class StepFlops:
    model: float
    hardware: float
    tokens: int


def step_flops(shape: ModelShape, rows: list[list[int]], lora_r: int, lora_targets: Iterable[str],
               checkpointed_layers: int, attention: str) -> StepFlops:
    """Model and hardware FLOPs of one forward + backward over ``rows`` (each row: the lengths of the samples
    packed into it; padding excluded). ``checkpointed_layers``: how many decoder layers rerun their forward in
    the backward pass (all of them under full activation checkpointing, none without, some when selective).
    ``attention`` is the kernel that ran (``PACKED_PATH``'s keys)."""
    tokens = sum(sum(r) for r in rows)
    n, n_lora = shape.linear_params(), shape.lora_params(lora_r, lora_targets)
    attn_unit = 4 * shape.heads * shape.head_dim * shape.layers  # forward FLOPs per (query, key) pair, all layers
    pairs = sum(causal_pairs(r) for r in rows)
    model = 4 * n * tokens + 6 * n_lora * tokens + 3 * attn_unit * pairs
    dense = PACKED_PATH.get(attention) == "dense_mask"
    hw_pairs = sum(sum(r) ** 2 if dense and len(r) > 1 else causal_pairs(r) for r in rows)
    hardware = 4 * n * tokens + 6 * n_lora * tokens + 3 * attn_unit * hw_pairs
    if checkpointed_layers:  # those decoder layers' forward runs again in the backward pass; lm_head is outside
        k = min(checkpointed_layers, shape.layers)  # n_lora and attn_unit are per layer x layers
        hardware += k * ((2 * shape.layer_linear_params() + 2 * n_lora // shape.layers) * tokens
                         + attn_unit // shape.layers * hw_pairs)
    return StepFlops(float(model), float(hardware), tokens)


def rows_from_positions(position_ids: Any, attention_mask: Any = None) -> list[list[int]]:
    """Each row's sample lengths from a batch's position ids (a packed sample restarts at 0) and, for padded
    rows, its attention mask: what :func:`step_flops` counts."""
    out = []
    for b in range(position_ids.shape[0]):
        pos = position_ids[b].tolist()
        n = int(attention_mask[b].sum()) if attention_mask is not None else len(pos)
        starts = [i for i in range(n) if pos[i] == 0] or [0]
        out.append([e - s for s, e in zip(starts, starts[1:] + [n], strict=True)])
    return out


@dataclass(frozen=True)
class GpuPeak:
    label: str
    flops: float  # dense bf16/fp16 tensor-core FLOP/s, no 2:4 sparsity


# NVIDIA's datasheets give tensor-core BF16 "with sparsity"; the dense figure is half of it. Each rule: the device
# name as torch reports it (without "NVIDIA "), the SM count that variant has (a MIG slice or an unexpected part
# reports fewer and gets no peak), optionally a memory range in GiB to tell apart parts that share a name.
_PEAKS: list[tuple[str, int, tuple[float, float] | None, str, float]] = [
    (r"H100 80GB HBM3e?|H100 SXM5?( \d+GB)?", 132, None, "H100 SXM5", 989.4e12),
    (r"H100 PCIe", 114, None, "H100 PCIe", 756.5e12),
    (r"H100 NVL", 132, None, "H100 NVL", 835.5e12),
    (r"H100", 114, None, "H100 PCIe", 756.5e12),
    (r"H100", 132, (70, 88), "H100 SXM5", 989.4e12),
    (r"H100", 132, (88, 100), "H100 NVL", 835.5e12),
    (r"H200( 141GB)?|H200 SXM", 132, None, "H200 SXM", 989.4e12),
    (r"H200 NVL", 132, None, "H200 NVL", 835.5e12),
    (r"GH200( \d+GB)?", 132, None, "GH200", 989.4e12),
    (r"H800( 80GB HBM3)?|H800 SXM5?", 132, None, "H800 SXM5", 989.4e12),
    (r"H800 PCIe", 114, None, "H800 PCIe", 756.5e12),
    (r"A100[- ].*|A100", 108, None, "A100", 312e12),  # SXM4 and PCIe, 40 and 80 GB: the same dense peak
    (r"A800[- ].*|A800", 108, None, "A800", 312e12),
    (r"L40S", 142, None, "L40S", 362.05e12),
    (r"L40", 142, None, "L40", 181.05e12),
    (r"L4", 58, None, "L4", 121e12),
    (r"A10", 72, None, "A10", 125e12),
    (r"B200", 148, None, "B200", 2250e12),
]


_BY_SMS_ONLY = {"H100"}  # a bare "H100" is PCIe, SXM or NVL: only its SMs and memory tell


def gpu_peak(name: str, sm_count: int | None = None, memory_gib: float | None = None) -> GpuPeak | None:
    """The dense bf16 peak of this exact GPU, or None when it is not known (then no MFU is reported).

    ``sm_count`` (``torch.cuda.get_device_properties().multi_processor_count``) must match the variant's when
    given; without it (a stored result holding only the name) the name alone must be unambiguous."""
    short = re.sub(r"^NVIDIA\s+", "", name.strip())
    if "MIG" in short.split():
        return None  # a slice of a GPU: its share of the peak depends on the profile
    for pattern, sms, mem, label, peak in _PEAKS:
        if not re.fullmatch(pattern, short):
            continue
        if sm_count is None:
            if pattern not in _BY_SMS_ONLY:
                return GpuPeak(label, peak)
            continue
        if sms != sm_count:
            continue
        if mem is not None and (memory_gib is None or not mem[0] <= memory_gib < mem[1]):
            continue
        return GpuPeak(label, peak)
    return None


def detect_gpu_peak() -> tuple[str, GpuPeak | None]:
    """This process's CUDA device: its name (with SMs and memory) and its peak, or ("cpu", None)."""
    import torch
    if not torch.cuda.is_available():
        return "cpu", None
    p = torch.cuda.get_device_properties(torch.cuda.current_device())
    gib = p.total_memory / 2**30
    return (f"{p.name} ({p.multi_processor_count} SMs, {gib:.0f} GiB)",
            gpu_peak(p.name, p.multi_processor_count, gib))
