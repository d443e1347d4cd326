"""The one generation engine (`mlbench_kit/engine.py`): one LoRA-rank rule, one context-length check and one
backend registry for every stage. Engines themselves run in tests/infer and tests/agent."""

from __future__ import annotations

import json
import typing
from pathlib import Path

import pytest

from mlbench_kit.agent_config import AgentConfig
from mlbench_kit.engine import BACKENDS, context_length, lora_rank, serving_dtype
from mlbench_kit.errors import MLBenchError
from mlbench_kit.infer_config import InferConfig


def _adapter(root: Path, name: str, r: object) -> str:
    d = root / name
    d.mkdir()
    (d / "adapter_config.json").write_text(json.dumps({"r": r, "base_model_name_or_path": "tiny"}))
    return str(d)


def test_one_lora_rank_rule_for_every_adapter_of_an_engine(tmp_path: Path):
    """The largest adapter's rank, rounded up to one vLLM accepts (1 is one: the agent's own table rounded a rank-1
    adapter up to 8 while infer kept 1); a configured rank below an adapter's is an error naming that adapter."""
    small, big = _adapter(tmp_path, "small", 4), _adapter(tmp_path, "big", 12)
    assert lora_rank({}, None) is None
    assert lora_rank({"one": _adapter(tmp_path, "one", 1)}, None) == 1
    assert lora_rank({"small": small}, None) == 8
    assert lora_rank({"small": small, "big": big}, None) == 16
    assert lora_rank({"small": small, "big": big}, 64) == 64
    with pytest.raises(MLBenchError, match="adapter rank 12 is above the engine's max_lora_rank 8") as e:
        lora_rank({"small": small, "big": big}, 8)
    assert e.value.where == big and "--max-lora-rank" in str(e.value)
    with pytest.raises(MLBenchError, match="not a positive integer"):
        lora_rank({"bad": _adapter(tmp_path, "bad", "8")}, None)
    with pytest.raises(MLBenchError, match="not a PEFT adapter folder"):
        lora_rank({"none": str(tmp_path)}, None)


def _trained(root: Path, name: str, precision: object) -> str:
    d = Path(_adapter(root, name, 8))
    (d / "mlbench_train.json").write_text(json.dumps({"precision": precision}))
    return str(d)


def test_one_dtype_rule_the_adapters_training_precision_for_infer_and_the_agent(tmp_path: Path):
    """auto serves adapters in the precision they were trained in (fp32 too: vLLM's own auto served a CPU-trained
    adapter in bf16, slower on a CPU without bf16 instructions), in infer's engine and the agent's alike; a
    configured dtype wins; adapters of two precisions are one error; no record, or a foreign one, is vLLM's auto."""
    from mlbench_kit.agent.run import engine_spec
    from mlbench_kit.infer.run import engine_dtype
    fp32, bf16 = _trained(tmp_path, "fp32", "fp32"), _trained(tmp_path, "bf16", "bf16")
    assert serving_dtype("auto", [fp32], "x") == "float32"
    assert serving_dtype("auto", [bf16], "x") == "bfloat16"
    assert serving_dtype("float16", [fp32], "x") == "float16"
    assert serving_dtype("auto", [], "x") == "auto"
    assert serving_dtype("auto", [_adapter(tmp_path, "plain", 8), _trained(tmp_path, "odd", ["fp32"])], "x") == "auto"
    with pytest.raises(MLBenchError, match="different precisions") as e:
        serving_dtype("auto", [fp32, bf16], "--adapters")
    assert e.value.where == "--adapters"
    assert engine_dtype(InferConfig(), [fp32]) == "float32"
    assert engine_spec(AgentConfig(adapter=fp32), 512).dtype == "float32"
    assert engine_spec(AgentConfig(adapter=fp32, backend="openai"), 512).dtype == "auto"  # a served name
    assert engine_spec(AgentConfig(), 512).dtype == "auto"


def test_one_context_length_rule():
    """Configured above the model's positions: an error at the stage's option; else the configured length or the
    wanted one, capped at the positions."""
    with pytest.raises(MLBenchError, match="max_model_len 8192 is above the model's 4096 positions") as e:
        context_length(8192, 4096, 100, "--max-model-len")
    assert e.value.where == "--max-model-len" and "use at most 4096" in str(e.value)
    assert context_length(None, 4096, 5000, "x") == 4096
    assert context_length(2048, 4096, 5000, "x") == 2048
    assert context_length(None, None, 5000, "x") == 5000


@pytest.mark.parametrize("config", [InferConfig, AgentConfig])
def test_every_stage_offers_exactly_the_registry_s_backends(config: type):
    """`--backend`'s choices are the registry's rows: a backend added to the table and not to a stage (or the
    reverse) fails here."""
    choices = typing.get_args(typing.get_type_hints(config)["backend"])
    assert set(choices) == set(BACKENDS)
    assert all(b.name == name for name, b in BACKENDS.items())


def test_the_hf_engine_serves_several_adapters_one_per_request(tmp_path: Path, tiny_model_dir: Path):
    """Two real PEFT adapters (random LoRA weights, so they change the samples) and the base model in one hf
    engine: a call whose requests name base, one and the other adapter samples what each does alone, n samples a
    request; the adapters differ from the base."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from mlbench_kit.engine import EngineSpec, GenParams, GenRequest, make_engine
    from mlbench_kit.hf import load_tokenizer
    adapters = {}
    for k, name in enumerate(("one", "two")):
        torch.manual_seed(k)
        lm = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                            LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
        with torch.no_grad():
            for n, p in lm.named_parameters():
                if "lora_" in n:
                    p.mul_(20)  # a random adapter strong enough to move a 2-layer model's samples
        lm.save_pretrained(tmp_path / name)
        adapters[name] = str(tmp_path / name)
    tok = load_tokenizer(str(tiny_model_dir), fast=False)
    engine = make_engine(EngineSpec("hf", str(tiny_model_dir), adapters=adapters), tok)
    params = GenParams(max_new_tokens=8, n=2)
    prompts = [tuple(tok("def train(model):")["input_ids"]), tuple(tok("python main.py --lr")["input_ids"])]
    reqs = [GenRequest(ids, 7 + i, a) for i, ids in enumerate(prompts) for a in (None, "one", "two")]
    try:
        together = [[g.text for g in out] for out in engine.generate(reqs, params)]
        alone = [[g.text for g in engine.generate([r], params)[0]] for r in reqs]
    finally:
        engine.close()
    assert together == alone and all(len(t) == 2 for t in together)
    by = {(r.seed, r.adapter): t for r, t in zip(reqs, together, strict=True)}
    assert any(by[(s, "one")] != by[(s, None)] for s in (7, 8))
    assert any(by[(s, "two")] != by[(s, "one")] for s in (7, 8))


def test_vllm_cpu_gives_a_small_machine_s_every_core_to_the_worker(monkeypatch):
    # vLLM kept one CPU of two for its front end, idle while the worker decoded on the other (LoRA generation of the
    # real model 128 s; 80 s with every core to the worker)
    from mlbench_kit import engine
    for cpus, user, want in ((2, None, "0"), (4, None, "0"), (16, None, None), (2, "1", "1")):
        monkeypatch.setattr(engine.os, "sched_getaffinity", lambda pid, n=cpus: set(range(n)))
        if user is None:
            monkeypatch.delenv("VLLM_CPU_NUM_OF_RESERVED_CPU", raising=False)
        else:
            monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", user)
        engine.cpu_defaults()
        assert engine.os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU") == want, (cpus, user)
