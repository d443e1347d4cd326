"""train/flops.py: model vs hardware FLOPs of a LoRA step, counted by hand and by torch; the exact GPU's peak."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import REPO_ROOT

from mlbench_kit.train.flops import (
    ModelShape,
    causal_pairs,
    gpu_peak,
    rows_from_positions,
    step_flops,
)

TINY = ModelShape(hidden=8, intermediate=16, layers=2, heads=2, kv_heads=1, vocab=10, head_dim=4)


def test_model_and_hardware_flops_match_a_hand_count():
    # per layer q 8x8, k 8x4, v 8x4, o 8x8, gate/up/down 8x16: 576 weights; 2 layers + lm_head 10x8 = 1232
    assert TINY.linear_params() == 2 * 576 + 80
    # LoRA r=2 on q (8 in, 8 out) and v (8 in, 4 out): 2*(8+8) + 2*(8+4) = 56 per layer
    assert TINY.lora_params(2, ["q_proj", "v_proj"]) == 112
    rows = [[3, 2]]  # one packed row: samples of 3 and 2 tokens -> 6 + 3 causal (query, key) pairs
    assert causal_pairs(rows[0]) == 9
    f = step_flops(TINY, rows, 2, ["q_proj", "v_proj"], checkpointed_layers=2, attention="flash_attention_2")
    frozen, lora = 4 * 1232 * 5, 6 * 112 * 5  # 4N (no weight gradient of the frozen base), 6N for LoRA
    attn_pair = 12 * 2 * 4  # forward 2 matmuls x 2 FLOPs x heads x head_dim, backward twice that
    assert f.tokens == 5
    assert f.model == frozen + lora + attn_pair * 2 * 9 == 29728
    recompute = 2 * 2 * 576 * 5 + 2 * 112 * 5 + 4 * 2 * 4 * 2 * 9  # decoder layers' forward again; not lm_head
    assert f.hardware == f.model + recompute
    # SDPA over a packed row gets a dense [5, 5] block-diagonal mask and computes all 25 pairs, twice forward
    dense = step_flops(TINY, rows, 2, ["q_proj", "v_proj"], checkpointed_layers=2, attention="sdpa")
    assert dense.model == f.model
    assert dense.hardware == frozen + lora + 96 * 2 * 25 + 2 * 2 * 576 * 5 + 2 * 112 * 5 + 32 * 2 * 25 == 47040
    # selective checkpointing (every 2nd layer: 1 of 2) recomputes half of it; none recomputes nothing
    half = step_flops(TINY, rows, 2, ["q_proj", "v_proj"], checkpointed_layers=1, attention="flash_attention_2")
    assert half.hardware == f.model + recompute // 2 and half.model == f.model
    none = step_flops(TINY, rows, 2, ["q_proj", "v_proj"], checkpointed_layers=0, attention="flash_attention_2")
    assert none.hardware == f.model
    # the 6N count the bench used before: for this row it is far from both
    assert 6 * (1232 + 10 * 8) * 5 not in (f.model, f.hardware)


def test_forward_flops_agree_with_torch_s_counter_on_a_real_lora_llama():
    from peft import LoraConfig, get_peft_model
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=50, attn_implementation="eager")
    model = get_peft_model(LlamaForCausalLM(cfg).eval(),
                           LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["q_proj", "down_proj"]))
    shape = ModelShape.from_config(cfg)
    s = 7
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model(input_ids=torch.randint(0, 50, (1, s)))
    # torch counts matmuls only (as we do); eager attention multiplies all s x s pairs (the mask comes after)
    expected = 2 * shape.linear_params() * s + 2 * shape.lora_params(4, ["q_proj", "down_proj"]) * s \
        + 4 * shape.heads * shape.head_dim * shape.layers * s * s
    assert counter.get_total_flops() == expected


def test_sample_lengths_come_from_position_ids_and_the_mask():
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    assert rows_from_positions(pos) == [[3, 2, 4]]
    padded = torch.tensor([[0, 1, 2, 3], [0, 1, 2, 3]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    assert rows_from_positions(padded, mask) == [[4], [2]]


@pytest.mark.parametrize("name, sms, gib, label, tflops", [
    ("NVIDIA H100 80GB HBM3", 132, 79.1, "H100 SXM5", 989.4),
    ("NVIDIA H100 PCIe", 114, 79.6, "H100 PCIe", 756.5),
    ("NVIDIA H100 NVL", 132, 93.1, "H100 NVL", 835.5),
    ("NVIDIA H100", 114, 79.6, "H100 PCIe", 756.5),  # a bare name: the SMs tell
    ("NVIDIA H100", 132, 93.1, "H100 NVL", 835.5),
    ("NVIDIA H200", 132, 139.8, "H200 SXM", 989.4),
    ("NVIDIA H200 NVL", 132, 139.8, "H200 NVL", 835.5),
    ("NVIDIA A100-SXM4-40GB", 108, 39.4, "A100", 312.0),
    ("NVIDIA A100-SXM4-80GB", 108, 79.2, "A100", 312.0),
    ("NVIDIA A100 80GB PCIe", 108, 79.2, "A100", 312.0),
    ("NVIDIA L40S", 142, 44.4, "L40S", 362.05),
    ("NVIDIA L40", 142, 44.4, "L40", 181.05),
    ("NVIDIA L4", 58, 22.0, "L4", 121.0),
])
def test_the_exact_gpu_s_peak(name, sms, gib, label, tflops):
    peak = gpu_peak(name, sms, gib)
    assert peak is not None and peak.label == label and peak.flops == pytest.approx(tflops * 1e12)


@pytest.mark.parametrize("name, sms", [
    ("NVIDIA H100 80GB HBM3 MIG 3g.40gb", 60),  # a slice: no share of the peak is assumed
    ("NVIDIA H100 80GB HBM3", 114),  # SMs that do not fit the name
    ("NVIDIA H100", None),  # a bare H100 without its SMs is PCIe, SXM or NVL
    ("Tesla T4", 40),
    ("NVIDIA A10G", 80),
    ("NVIDIA GeForce RTX 4090", 128),
])
def test_an_unknown_or_ambiguous_gpu_gets_no_peak(name, sms):
    assert gpu_peak(name, sms, 80.0) is None


@pytest.mark.integration
def test_bench_toy_run_reports_mfu_inputs_and_the_kernel_that_ran(tmp_path, shared):
    out = tmp_path / "r.json"
    r = subprocess.run([sys.executable, "bench/gpu_train.py", "--toy", "--modes", "lora", "--steps", "1",
                        "--warmup", "1", "--attention", "sdpa", "--shared", str(shared), "--out", str(out),
                        "--levers", "baseline", "no-ckpt", "ckpt-every-2", "fused-loss", "fused-loss+ckpt-every-2",
                        "liger"],
                       cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert doc["versions"]["torch"] == torch.__version__.split("+")[0] or doc["versions"]["torch"] == torch.__version__
    res, nockpt, every2, fused, both, liger = doc["results"]
    # levers combine; a lever that cannot run here is a row saying why, and the other rows still ran
    assert both["change"] == {"fused_linear_loss": True, "gradient_checkpointing_every_n_layers": 2}
    assert both["checkpointed_layers"] == 1 and both["loss_impl"] == "fused_linear"
    assert "needs a CUDA GPU" in liger["error"] and "| toy | lora | liger | failed: " in r.stderr
    assert res["attention"] == "sdpa" and res["attention_packed"] in ("dense_mask", "unpacked")
    assert res["mfu"] is None and "no dense bf16 peak known for 'cpu'" in res["mfu_note"]
    assert res["model_tflops_per_s"] > 0 and res["hardware_tflops_per_s"] > res["model_tflops_per_s"]
    # each lever is one change, applied as asked and counted as it ran
    assert [x["lever"] for x in (res, nockpt, every2, fused)] == ["baseline", "no-ckpt", "ckpt-every-2", "fused-loss"]
    assert [x["checkpointed_layers"] for x in (res, nockpt, every2, fused)] == [2, 0, 1, 2]
    assert [x["loss_impl"] for x in (res, nockpt, fused)] == ["logits", "logits", "fused_linear"]
    if res["attention_packed"] == "unpacked":  # no masked blocks: without recompute, hardware = model FLOPs
        assert nockpt["hardware_tflops_per_s"] == pytest.approx(nockpt["model_tflops_per_s"], rel=1e-3)
    assert res["peak_rss_gib"] > 0  # on CPU, each run's own peak resident memory
    assert "| toy | lora | fused-loss |" in r.stderr and "× baseline" in r.stderr
