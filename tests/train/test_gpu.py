"""The GPU-only speed levers compute what the default path computes, on a real CUDA device: flex_attention on
packed rows (its BlockMask against SDPA's dense mask) and Liger-Kernel's Triton RMSNorm/SwiGLU/RoPE. Skipped
without CUDA (CI has none); run on a lent GPU with the bench (bench/results/2026-11-25-gpu-levers-h100.md)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_speed import VOCAB, _packed_batch, assert_grads_close

from mlbench_kit.errors import MLBenchError
from mlbench_kit.train.loss import micro_batch_losses
from mlbench_kit.train.model import add_lora, load_base
from mlbench_kit.train_config import LoraConfig, TrainConfig

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _model(folder: Path, attention: str, device: str, precision: str = "fp32", **cfg: object) -> object:
    """A tiny Llama with the 7B models' head size (128: flex_attention's Triton template found no kernel for a
    head size of 32 in fp32 on the H100) and no grouped KV heads, LoRA on top."""
    from transformers import LlamaConfig, LlamaForCausalLM
    if not folder.exists():
        torch.manual_seed(0)
        LlamaForCausalLM(LlamaConfig(hidden_size=256, intermediate_size=384, num_hidden_layers=2,
                                     num_attention_heads=2, num_key_value_heads=2, vocab_size=VOCAB,
                                     max_position_embeddings=256)).save_pretrained(folder)
    tc = TrainConfig(model=str(folder), attn_implementation=attention, lora=LoraConfig(dropout=0.0),
                     **cfg)  # type: ignore[arg-type]
    torch.manual_seed(0)
    model = add_lora(load_base(tc, precision, attention), tc)
    for name, p in model.named_parameters():  # B = 0 at init would leave A without gradients
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.05)
    return model.to(device)


def _loss_and_grads(model, batch):  # type: ignore[no-untyped-def]
    model.zero_grad(set_to_none=True)
    losses = micro_batch_losses(model, batch, 32)
    losses.sum().backward()
    grads = {n: p.grad.detach().float().cpu() for n, p in model.named_parameters() if p.grad is not None}
    return losses.detach().float().cpu(), grads


@cuda
@pytest.mark.parametrize("lever", ["flex", "liger"])
def test_a_gpu_lever_computes_what_the_default_computes(tmp_path, lever):
    batch = {k: v.cuda() for k, v in _packed_batch().items()}  # two packed samples in one row
    ref_loss, ref_grads = _loss_and_grads(_model(tmp_path / "base", "sdpa", "cuda"), batch)
    model = (_model(tmp_path / "base", "flex_attention", "cuda") if lever == "flex"
             else _model(tmp_path / "base", "sdpa", "cuda", liger_kernels=True))
    loss, grads = _loss_and_grads(model, batch)
    if lever == "liger":  # the kernels really replaced transformers' modules
        names = {type(m).__name__ for m in model.modules()} | {
            getattr(m.forward, "__qualname__", "") for m in model.modules()}
        assert any("Liger" in n for n in names), sorted(names)[:20]
    torch.testing.assert_close(loss, ref_loss, atol=1e-4, rtol=1e-4)
    assert grads.keys() == ref_grads.keys() and grads
    for name in ref_grads:
        assert_grads_close(grads[name], ref_grads[name], name)


@cuda
def test_flex_on_packed_rows_matches_sdpa_in_bf16(tmp_path):
    """The bench's precision: flex_attention's BlockMask against SDPA's dense mask, each bf16 sample's losses
    within bf16's resolution, and LoRA gradients pointing the same way (a leak across the packed samples'
    boundary moves the second sample's losses by far more)."""
    batch = {k: v.cuda() for k, v in _packed_batch().items()}
    ref_loss, ref_grads = _loss_and_grads(_model(tmp_path / "base", "sdpa", "cuda", "bf16"), batch)
    loss, grads = _loss_and_grads(_model(tmp_path / "base", "flex_attention", "cuda", "bf16"), batch)
    torch.testing.assert_close(loss, ref_loss, atol=3e-2, rtol=1e-2)
    for name in ref_grads:
        cos = torch.nn.functional.cosine_similarity(grads[name].flatten(), ref_grads[name].flatten(), dim=0)
        assert cos > 0.99, (name, float(cos))


def test_liger_on_cpu_is_refused_at_set_up(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # this machine's view when it has no GPU
    with pytest.raises(MLBenchError) as e:
        _model(tmp_path / "base", "sdpa", "cpu", liger_kernels=True)
    assert "needs a CUDA GPU" in str(e.value) and "liger_kernels: false" in str(e.value)
