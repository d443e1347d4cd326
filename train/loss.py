"""The training loss: next-token cross-entropy per token, computed in chunks so that no fp32 [seq, vocab] tensor
exists whole; optionally with ``lm_head`` inside the chunks, so that the full logits never exist at all.

Two paths give the same per-token losses (shape [batch, seq-1], 0 where the label is IGNORE):

- :func:`token_losses` from the model's logits (``lm_head`` ran over the whole sequence);
- :class:`LinearLoss`, the torch-native form of a fused linear cross-entropy (Liger-Kernel's, Apple's
  cut-cross-entropy): the model's ``lm_head`` returns the per-token losses of the hidden states instead of
  logits, one chunk at a time, with the gradient for the hidden states made in the same pass (the output layer
  is frozen under LoRA), so no logits are kept or recomputed. With accelerate's bf16 mode this also removes the
  fp32 copy of the whole logits that ``convert_outputs_to_fp32`` makes of a model's output.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from mlbench_kit.errors import MLBenchError

from .data import IGNORE


def _chunk_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    lg = logits.float()
    return torch.nn.functional.cross_entropy(lg.reshape(-1, lg.size(-1)), labels.reshape(-1), ignore_index=IGNORE,
                                             reduction="none").view(labels.shape)


def _per_chunk(fn: Any, x: torch.Tensor, labels: torch.Tensor, chunk: int, recompute: bool,
               *args: Any) -> torch.Tensor:
    """``fn(x_chunk, *args, labels_chunk)`` over chunks of ``chunk`` next-token positions (``x[:, :-1]`` against
    ``labels[:, 1:]``), concatenated to [batch, seq-1]; with ``recompute`` each chunk is checkpointed (its
    logits recomputed in the backward pass instead of kept)."""
    shift_x, shift_labels = x[:, :-1], labels[:, 1:]
    out = []
    for s in range(0, shift_labels.size(1), chunk):
        part = (shift_x[:, s: s + chunk], *args, shift_labels[:, s: s + chunk])
        out.append(checkpoint(fn, *part, use_reentrant=False) if recompute else fn(*part))
    return torch.cat(out, dim=1) if out else shift_labels.new_zeros(shift_labels.shape, dtype=torch.float32)


def token_losses(logits: torch.Tensor, labels: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
    """Per-token next-token loss (0 where the label is IGNORE), shape [batch, seq-1].

    Computed in chunks of ``chunk`` positions, each upcast to fp32 on its own and recomputed in the backward pass
    (activation checkpointing), so no fp32 copy of the [seq, vocab] logits ever exists whole: at 8k tokens and a
    32k vocabulary that copy, plus the log-softmax cross-entropy keeps for backward, is about 2 GB."""
    return _per_chunk(_chunk_loss, logits, labels, chunk, logits.requires_grad)


def _linear_chunk_loss(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                       labels: torch.Tensor) -> torch.Tensor:
    return _chunk_loss(torch.nn.functional.linear(hidden, weight, bias), labels)


class _FrozenLinearCrossEntropy(torch.autograd.Function):
    """Per-token losses of ``linear(hidden, weight, bias)`` against ``labels``, for a frozen ``weight`` (LoRA
    never trains ``lm_head``), chunk by chunk; the gradient with respect to ``hidden`` is made in the forward pass
    (Liger-Kernel's method): a token's loss is the last op on its logits, so its gradient is
    ``(softmax - onehot) @ weight`` times whatever the token's upstream gradient turns out to be. Saved for the
    backward: that [N, hidden] gradient only; no logits are kept or recomputed. Under autocast the matmuls run in
    its dtype and the softmax in fp32, as in the logits path."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                labels: torch.Tensor, chunk: int) -> torch.Tensor:
        losses = torch.zeros(labels.shape, dtype=torch.float32, device=hidden.device)
        grad = torch.empty_like(hidden)
        for s in range(0, labels.size(0), chunk):
            logits = torch.nn.functional.linear(hidden[s: s + chunk], weight, bias).float()
            lb = labels[s: s + chunk]
            valid = lb != IGNORE
            target = lb.clamp(min=0)
            lse = torch.logsumexp(logits, dim=-1)
            losses[s: s + chunk] = (lse - logits.gather(1, target[:, None]).squeeze(1)) * valid
            probs = torch.exp(logits.sub_(lse[:, None]))  # softmax, in place of the logits
            probs.scatter_add_(1, target[:, None], -valid[:, None].to(probs.dtype))
            probs.mul_(valid[:, None])
            grad[s: s + chunk] = (probs.to(weight.dtype) @ weight).to(grad.dtype)
        ctx.save_for_backward(grad)
        return losses

    @staticmethod
    def backward(ctx: Any, grad_losses: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        (grad,) = ctx.saved_tensors
        return grad * grad_losses[:, None].to(grad.dtype), None, None, None, None


def linear_token_losses(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                        labels: torch.Tensor, chunk: int = 4096) -> torch.Tensor:
    """:func:`token_losses` of ``linear(hidden, weight, bias)`` without those logits ever existing whole.
    ``hidden``: [batch, seq, hidden]; ``labels``: [batch, seq]; returns [batch, seq-1].

    A frozen output layer (LoRA): :class:`_FrozenLinearCrossEntropy`, no recompute. A trained one: each chunk's
    logits are made, reduced to its losses, and recomputed in the backward pass (activation checkpointing)."""
    trained = weight.requires_grad or (bias is not None and bias.requires_grad)
    if hidden.requires_grad and not trained:
        shift_labels = labels[:, 1:]
        flat = _FrozenLinearCrossEntropy.apply(hidden[:, :-1].reshape(-1, hidden.size(-1)), weight, bias,
                                               shift_labels.reshape(-1), chunk)
        return flat.view(shift_labels.shape)
    return _per_chunk(_linear_chunk_loss, hidden, labels, chunk, trained, weight, bias)


class LinearLoss:
    """The model's output layer turned into the loss: while :meth:`targets` is active, ``lm_head`` maps hidden
    states to per-token losses (:func:`linear_token_losses`), so ``model(...).logits`` holds those losses.

    The module itself stays in the model (same parameters, same state dict, the same hooks that DDP, FSDP2 and
    DeepSpeed put on it); only its ``forward`` is replaced, and outside :meth:`targets` it returns logits as
    before (evaluation, generation, merging)."""

    def __init__(self, model: Any, chunk: int = 4096) -> None:
        head = model.get_output_embeddings()
        weight = getattr(head, "weight", None)
        if not isinstance(head, torch.nn.Linear) or weight is None or not weight.dtype.is_floating_point:
            raise MLBenchError(f"the output layer is a {type(head).__name__} (weights: "
                               f"{getattr(weight, 'dtype', None)}), not a Linear of float weights",
                               "fused_linear_loss", "set fused_linear_loss: false for this model")
        self.head, self.chunk = head, chunk
        self._labels: torch.Tensor | None = None
        # an instance attribute: nn.Module.__call__ (and the hooks on it) still run, only the computation changes
        head.forward = self._forward  # type: ignore[method-assign,assignment]

    def _forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._labels is None:
            return torch.nn.functional.linear(hidden, self.head.weight, self.head.bias)
        return linear_token_losses(hidden, self.head.weight, self.head.bias, self._labels, self.chunk)

    @contextlib.contextmanager
    def targets(self, labels: torch.Tensor) -> Iterator[None]:
        """Within this block the model's forward returns the per-token losses against ``labels``."""
        self._labels = labels
        try:
            yield
        finally:
            self._labels = None


def micro_batch_losses(model: Any, batch: dict[str, torch.Tensor], chunk: int, linear_loss: LinearLoss | None = None,
                       **kwargs: Any) -> torch.Tensor:
    """Per-token losses [batch, seq-1] of one micro-batch (already on the model's device): the model's forward,
    then the chunked cross-entropy, through the logits or (``linear_loss``) with ``lm_head`` inside the chunks."""
    def forward() -> torch.Tensor:
        return model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                     attention_mask=batch.get("attention_mask"), use_cache=False, **kwargs).logits
    if linear_loss is None:
        return token_losses(forward(), batch["labels"], chunk)
    with linear_loss.targets(batch["labels"]):
        return forward()
