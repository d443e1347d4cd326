"""DPO and GRPO through TRL (1.16): the policy is the SFT adapter (trainable), the data and the reward are this
stage's. Each recipe has ``setup()`` and ``train()``; a run resumes from its newest checkpoint
(``OUT/trainer/checkpoint-N``) and publishes ``OUT/adapter`` (a PEFT adapter `mlbench infer` serves) and
``OUT/metrics.jsonl`` (TRL's log, one record per logged step).

TRL's vLLM generation path requires vllm <= 0.31 (``trl.import_utils.is_vllm_available``); this project pins
vllm 0.32, so GRPO generates with transformers' ``generate`` here (``use_vllm=False``).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from mlbench_kit.errors import MLBenchError
from mlbench_kit.hf import TRAIN_META, adds_bos, compute_dtype, load_tokenizer
from mlbench_kit.io import atomic_dir, read_json, read_jsonl, write_json_atomic, write_jsonl_atomic
from mlbench_kit.learn_config import LearnConfig
from mlbench_kit.progress import Progress
from mlbench_kit.records import PrepRecord

from .data import evaluated_answers
from .reward import ExecutionReward


def load_policy(cfg: LearnConfig) -> Any:
    """The base model with the start adapter loaded trainable (a fresh LoRA on every linear layer without one);
    4-bit NF4 base weights with ``quantization: nf4`` (QLoRA)."""
    import torch
    from peft import LoraConfig, PeftModel, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    kw: dict[str, Any] = {"dtype": compute_dtype()}
    if cfg.quantization == "nf4":
        kw["quantization_config"] = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                       bnb_4bit_compute_dtype=compute_dtype(),
                                                       bnb_4bit_use_double_quant=True)
    base = AutoModelForCausalLM.from_pretrained(str(cfg.model), **kw)
    if cfg.adapter:
        return PeftModel.from_pretrained(base, cfg.adapter, is_trainable=True)
    torch.manual_seed(cfg.seed)
    return get_peft_model(base, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear",
                                           task_type="CAUSAL_LM"))


def _common_args(cfg: LearnConfig, out: Path) -> dict[str, Any]:
    import torch
    return {"output_dir": str(out / "trainer"), "logging_steps": 1, "save_total_limit": 2, "report_to": [],
            "seed": cfg.seed, "bf16": torch.cuda.is_available(), "use_cpu": not torch.cuda.is_available(),
            "disable_tqdm": True, "remove_unused_columns": False}


def _newest_checkpoint(out: Path) -> str | None:
    steps = sorted((int(p.name.split("-")[1]), p) for p in (out / "trainer").glob("checkpoint-*")
                   if p.name.split("-")[1].isdigit() and (p / "trainer_state.json").is_file())
    return str(steps[-1][1]) if steps else None


def adapter_lineage(cfg: LearnConfig) -> dict[str, Any]:
    """The start adapter's own record (``mlbench_train.json``; {} without one), checked before any training: a
    damaged one (not JSON, nested too deeply, a link, too large) is one error naming it, not a traceback after
    training that loses the trained adapter."""
    f = Path(cfg.adapter) / TRAIN_META if cfg.adapter else None
    if f is None or not (f.exists() or f.is_symlink()):
        return {}
    meta = read_json(f, 1 << 20)
    if not isinstance(meta, dict):
        raise MLBenchError(f"{TRAIN_META} is not a JSON object", str(f), "pass an adapter `mlbench train` wrote")
    return meta


def _publish(trainer: Any, cfg: LearnConfig, out: Path, method: str) -> Path:
    """The trained adapter as ``OUT/adapter`` (whole or not at all), its lineage beside it, and TRL's log."""
    final = out / "adapter"
    with atomic_dir(final) as tmp:
        trainer.model.save_pretrained(str(tmp))
        meta = adapter_lineage(cfg)
        meta["learned"] = {"method": method, "from_adapter": cfg.adapter, "steps": trainer.state.global_step}
        write_json_atomic(tmp / TRAIN_META, meta)
    write_jsonl_atomic(out / "metrics.jsonl", trainer.state.log_history)
    print(f"learn: {method} done, {trainer.state.global_step} steps; adapter: {final}", file=sys.stderr)
    return final


def progress_callback(method: str) -> Any:
    """A TRL/transformers callback printing ``learn: METHOD: i/N steps (p%), loss L, elapsed, ETA`` (a bar on a
    terminal, else a line every 30 s and at the end): TRL's own bars are off (``disable_tqdm``), and a DPO or GRPO
    step takes minutes on CPU."""
    from transformers import TrainerCallback

    class _Progress(TrainerCallback):
        def __init__(self) -> None:
            self.bar: Progress | None = None
            self.loss = ""

        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.bar = Progress(state.max_steps, f"learn: {method}", "step", initial=state.global_step)

        def on_log(self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kw: Any) -> None:
            if logs and isinstance(logs.get("loss"), (int, float)):
                self.loss = f"loss {logs['loss']:.4f}"

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if self.bar is not None:
                self.bar.update(state.global_step - self.bar.done, self.loss)

        def on_train_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            if self.bar is not None:
                self.bar.close()
                self.bar = None
    return _Progress()


def _bos_prompt(rec_prompt: str, template: str, tok: Any) -> str:
    """The prompt as training and inference tokenize it: TRL tokenizes without specials, so a non-chat template's
    BOS is written as text (a chat prompt carries its specials already)."""
    return (tok.bos_token or "") + rec_prompt if adds_bos(template) else rec_prompt


class DPORecipe:
    """DPO on pass/fail pairs: the SFT adapter is the policy and, frozen, the reference (TRL copies it)."""

    def __init__(self, cfg: LearnConfig, pairs: Path, templates: dict[tuple[int, int], str]) -> None:
        self.cfg, self.pairs, self.templates = cfg, pairs, templates
        self.out = Path(str(cfg.out))

    def setup(self) -> None:
        from datasets import Dataset
        from trl import DPOConfig, DPOTrainer

        cfg, d = self.cfg, self.cfg.dpo
        tok = load_tokenizer(str(cfg.model))
        rows = []
        for _, r in read_jsonl(self.pairs):
            template = self.templates[(int(r["github_id"]), int(r["id"]))]
            rows.append({"prompt": _bos_prompt(r["prompt"], template, tok), "chosen": r["chosen"] + tok.eos_token,
                         "rejected": r["rejected"] + tok.eos_token})
        if not rows:
            raise MLBenchError("no preference pairs: no training row has both a passing and a failing answer",
                               str(self.pairs), "sample more answers per row (k), or set dpo.gold_as_chosen")
        args = DPOConfig(**_common_args(cfg, self.out), beta=d.beta, loss_type=[d.loss_type], learning_rate=d.lr,
                         num_train_epochs=d.epochs, max_steps=d.max_steps, per_device_train_batch_size=d.batch_size,
                         gradient_accumulation_steps=d.grad_accum, max_length=d.max_length, save_steps=50)
        self.trainer = DPOTrainer(model=load_policy(cfg), args=args, train_dataset=Dataset.from_list(rows),
                                  processing_class=tok, callbacks=[progress_callback("dpo")])

    def train(self) -> Path:
        self.trainer.train(resume_from_checkpoint=_newest_checkpoint(self.out))
        return _publish(self.trainer, self.cfg, self.out, "dpo")


class GRPORecipe:
    """GRPO online: ``num_generations`` answers per training prompt, each executed in the sandbox for its reward."""

    def __init__(self, cfg: LearnConfig, prompts: dict[tuple[int, int], PrepRecord]) -> None:
        self.cfg, self.prompts = cfg, prompts
        self.out = Path(str(cfg.out))

    def setup(self) -> None:
        from datasets import Dataset
        from trl import GRPOConfig, GRPOTrainer

        cfg, g, s = self.cfg, self.cfg.grpo, self.cfg.sampling
        tok = load_tokenizer(str(cfg.model))
        # the prompt as training tokenized it: GRPO tokenizes with the tokenizer's specials, so a chat prompt
        # (specials already written) must not get a second BOS
        if any(not adds_bos(r.template) for r in self.prompts.values()) and tok("x")["input_ids"][:1] == \
                [tok.bos_token_id] and tok.bos_token_id is not None:
            raise MLBenchError("this tokenizer adds BOS to chat prompts that carry their specials already", "grpo",
                               "prep the training split with a non-chat template for grpo")
        rows = [{"prompt": r.prompt, "github_id": k[0], "id": k[1]} for k, r in sorted(self.prompts.items())]
        args = GRPOConfig(**_common_args(cfg, self.out), learning_rate=g.lr, max_steps=g.max_steps,
                          num_generations=g.num_generations,
                          per_device_train_batch_size=g.num_generations * g.prompts_per_step,
                          gradient_accumulation_steps=1, beta=g.beta, loss_type=g.loss_type,
                          temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
                          max_completion_length=s.max_new_tokens, save_steps=g.save_steps, use_vllm=False,
                          log_completions=False)
        self.reward = ExecutionReward(cfg, self.out, evaluated_answers(cfg))
        self.trainer = GRPOTrainer(model=load_policy(cfg), reward_funcs=[self.reward], args=args,
                                   train_dataset=Dataset.from_list(rows), processing_class=tok,
                                   callbacks=[progress_callback("grpo")])

    def train(self) -> Path:
        self.trainer.train(resume_from_checkpoint=_newest_checkpoint(self.out))
        return _publish(self.trainer, self.cfg, self.out, "grpo")
