"""train/'s speed and memory levers change how a step runs, never what it computes: the fused linear loss (no
[T, vocab] logits), selective activation checkpointing, per-layer torch.compile; each recorded as applied."""

from __future__ import annotations

import contextlib
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import REPO_ROOT
from test_train import _launch, _steps
from torch.utils._python_dispatch import TorchDispatchMode

from mlbench_kit.errors import MLBenchError
from mlbench_kit.train.loss import LinearLoss, micro_batch_losses
from mlbench_kit.train.model import add_lora, checkpointed_layers, choose_attention, compile_layers, load_base
from mlbench_kit.train_config import LoraConfig, TrainConfig

VOCAB, SEQ, CHUNK, HIDDEN = 384, 96, 32, 64


class LargestTensor(TorchDispatchMode):
    """The most elements any single op's output had while active (forward and backward)."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def _lora_llama(tmp_path: Path, layers: int = 2, **cfg: object) -> object:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(0)
    folder = tmp_path / "base"
    if not folder.exists():
        LlamaForCausalLM(LlamaConfig(hidden_size=HIDDEN, intermediate_size=96, num_hidden_layers=layers,
                                     num_attention_heads=2, num_key_value_heads=1, vocab_size=VOCAB,
                                     max_position_embeddings=256)).save_pretrained(folder)
    tc = TrainConfig(model=str(folder), attn_implementation="sdpa", lora=LoraConfig(dropout=0.0),
                     **cfg)  # type: ignore[arg-type]
    torch.manual_seed(0)
    model = add_lora(load_base(tc, "fp32", "sdpa"), tc)
    for name, p in model.named_parameters():  # B = 0 at init would leave A without gradients
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    return model


def _packed_batch() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, VOCAB, (1, SEQ), generator=g)
    labels = ids.clone()
    labels[0, :20] = -100  # a prompt, masked
    pos = torch.cat([torch.arange(40), torch.arange(SEQ - 40)])[None]  # two packed samples
    return {"input_ids": ids, "labels": labels, "position_ids": pos}


def assert_grads_close(got: torch.Tensor, ref: torch.Tensor, name: str) -> None:
    """Equal up to fp32 summation order: the absolute tolerance scales with the tensor's largest entry (a fixed
    1e-6 failed one element in 1,024, 2.3e-6 off where the largest was 2.7, on another CPU's kernels)."""
    torch.testing.assert_close(got, ref, atol=1e-5 * float(ref.abs().max()), rtol=1e-4, msg=name)


def _loss_and_grads(model, batch, linear_loss=None, watch=True):  # type: ignore[no-untyped-def]
    model.zero_grad(set_to_none=True)
    with LargestTensor() if watch else contextlib.nullcontext() as seen:  # a dispatch mode keeps dynamo off
        losses = micro_batch_losses(model, batch, CHUNK, linear_loss)
        # an upstream gradient that differs per token (the recipe's is one scale for all): the fused path makes
        # each token's gradient ahead of knowing it
        (losses * torch.linspace(0.5, 1.5, losses.size(1))).sum().backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    return losses.detach(), grads, seen.largest if seen else None


def test_fused_linear_loss_equals_the_logits_path_without_ever_making_the_logits(tmp_path):
    model = _lora_llama(tmp_path, gradient_checkpointing=True)
    model.train()
    batch = _packed_batch()
    ref, ref_grads, ref_largest = _loss_and_grads(model, batch)
    linear = LinearLoss(model, CHUNK)
    got, grads, largest = _loss_and_grads(model, batch, linear)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    assert ref_grads.keys() == grads.keys() and grads
    for k in grads:
        assert_grads_close(grads[k], ref_grads[k], k)
    assert ref_largest >= SEQ * VOCAB  # the logits path makes the whole [T, vocab] logits
    # the fused path: one chunk's logits at a time, forward and backward (or lm_head's weight, viewed transposed)
    assert largest <= max(CHUNK * VOCAB, VOCAB * HIDDEN) < SEQ * VOCAB
    # a trained output layer (not LoRA's case) takes the checkpointed chunks instead, its gradient included
    linear.head.weight.requires_grad_(True)
    _, ref_grads, _ = _loss_and_grads(model, batch)
    got, grads, largest = _loss_and_grads(model, batch, linear)
    assert "base_model.model.lm_head.weight" in grads
    for k in grads:
        assert_grads_close(grads[k], ref_grads[k], k)
    assert largest <= max(CHUNK * VOCAB, VOCAB * HIDDEN)
    linear.head.weight.requires_grad_(False)
    # outside a loss the output layer is itself again: logits, for evaluation, generation and merging
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], use_cache=False).logits
    assert logits.shape == (1, SEQ, VOCAB)
    # and without gradients (evaluation) the same losses come out
    with torch.no_grad():
        torch.testing.assert_close(micro_batch_losses(model, batch, CHUNK, linear), ref, atol=1e-5, rtol=1e-5)


def test_a_model_whose_output_layer_is_not_linear_is_refused_clearly():
    class Odd(torch.nn.Module):
        def get_output_embeddings(self) -> torch.nn.Module:
            return torch.nn.Identity()
    with pytest.raises(MLBenchError, match="not a Linear of float weights"):
        LinearLoss(Odd())


def _layer_calls(model) -> list[int]:  # type: ignore[no-untyped-def]
    from mlbench_kit.train.model import decoder_layers
    calls = [0]
    for layer in decoder_layers(model):
        layer.register_forward_pre_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    return calls


@pytest.mark.parametrize("every, recomputed", [(1, 4), (2, 2), (3, 2), (4, 1)])
def test_selective_checkpointing_recomputes_one_layer_in_n_and_computes_the_same(tmp_path, every, recomputed):
    batch = _packed_batch()
    full = _lora_llama(tmp_path, layers=4, gradient_checkpointing=False)
    full.train()
    _, ref_grads, _ = _loss_and_grads(full, batch)
    model = _lora_llama(tmp_path, layers=4, gradient_checkpointing=True, gradient_checkpointing_every_n_layers=every)
    model.train()
    assert checkpointed_layers(model) == recomputed
    calls = _layer_calls(model)
    _, grads, _ = _loss_and_grads(model, batch)
    assert calls[0] == 4 + recomputed  # every layer forward once, the checkpointed ones again in backward
    for k in grads:
        assert_grads_close(grads[k], ref_grads[k], k)


def test_qlora_keeps_the_selective_checkpointing_that_peft_s_preparation_would_reset(tmp_path):
    pytest.importorskip("bitsandbytes")
    folder = tmp_path / "q"
    _lora_llama(folder, layers=4)  # saves the base
    tc = TrainConfig(model=str(folder / "base"), quantization="nf4", attn_implementation="sdpa",
                     lora=LoraConfig(dropout=0.0),
                     gradient_checkpointing=True, gradient_checkpointing_every_n_layers=2)
    model = add_lora(load_base(tc, "fp32", "sdpa"), tc)
    assert checkpointed_layers(model) == 2
    # the fused loss on the quantized model: lm_head is left in full precision by the quantizer
    model.train()
    batch = _packed_batch()
    ref, _, _ = _loss_and_grads(model, batch)
    got, _, _ = _loss_and_grads(model, batch, LinearLoss(model, CHUNK))
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


def test_speed_levers_are_checked_where_they_are_set():
    with pytest.raises(MLBenchError, match="every_n_layers must be at least 1"):
        TrainConfig(model="m", gradient_checkpointing_every_n_layers=0).check(lambda k: k)
    # flex attention has no backward on CPU: refused before a run starts, not at its first step
    with pytest.raises(MLBenchError, match="no backward pass on CPU"):
        choose_attention("flex_attention", None, frozenset())
    assert choose_attention("flex_attention", (9, 0), frozenset()) == "flex_attention"


@pytest.mark.integration
def test_compiled_decoder_layers_train_like_eager_ones(tmp_path):
    import torch._dynamo
    batch = _packed_batch()
    eager = _lora_llama(tmp_path, gradient_checkpointing=True)
    eager.train()
    ref, ref_grads, _ = _loss_and_grads(eager, batch, watch=False)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    model = _lora_llama(tmp_path, gradient_checkpointing=True)
    model.train()
    assert compile_layers(model) == 2
    got, grads, _ = _loss_and_grads(model, batch, watch=False)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 1  # it really compiled
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    for k in grads:
        torch.testing.assert_close(grads[k], ref_grads[k], atol=1e-5, rtol=1e-3, msg=k)


@pytest.mark.integration
def test_the_recipe_with_every_lever_takes_the_baseline_s_steps_and_records_them(tmp_path, tiny_model_dir, real_prep):
    few = tmp_path / "few.jsonl"
    few.write_text("".join((real_prep / "id_train" / "task3.jsonl").read_text().splitlines(True)[:12]))
    args = ("--epochs", "2", "--set", f"data.path={few}", "--set", "data.eval_fraction=0.25", "--set",
            "checkpoint.every_steps=2")
    base, fast = tmp_path / "base", tmp_path / "fast"
    r = subprocess.run(_launch(tiny_model_dir, real_prep, base, *args), cwd=REPO_ROOT, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    levers = ("--set", "gradient_checkpointing=true", "--set", "gradient_checkpointing_every_n_layers=2",
              "--set", "fused_linear_loss=true", "--set", "loss_chunk_tokens=100", "--set", "compile=true")
    r = subprocess.run(_launch(tiny_model_dir, real_prep, fast, *args, *levers), cwd=REPO_ROOT,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    start = json.loads((fast / "metrics.jsonl").read_text().splitlines()[0])
    assert (start["checkpointed_layers"], start["decoder_layers"], start["compiled_layers"], start["loss_impl"]) == (
        1, 2, 2, "fused_linear")
    assert len(_steps(base)) >= 4
    assert [s["loss"] for s in _steps(fast)] == pytest.approx([s["loss"] for s in _steps(base)], rel=1e-4)
    evals = [[json.loads(x)["eval_loss"] for x in (d / "metrics.jsonl").read_text().splitlines() if "eval_loss" in x]
             for d in (base, fast)]
    assert evals[0] and evals[1] == pytest.approx(evals[0], rel=1e-4)
    # the levers are not part of the run's identity: a run made without them resumes with them (and runs made
    # before they existed resume): its run.json and its checkpoints' config hash are the same
    shutil.rmtree(base / "adapter")
    speed = ("--set", "fused_linear_loss=true", "--set", "gradient_checkpointing_every_n_layers=2", "--set",
             "compile=true")
    r = subprocess.run(_launch(tiny_model_dir, real_prep, base, *args, *speed), cwd=REPO_ROOT,
                       capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and "train: resumed from" in r.stderr, r.stderr[-3000:]
