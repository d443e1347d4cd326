"""An OpenAI-compatible endpoint (`vllm serve`, or an API model): retries, a request-rate limit, concurrency.

The key comes from an environment variable, never from a file or the command line; which variable, and a server
other than this machine, only from the command line (mlbench_kit.engine.check_endpoint).
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, cast

from mlbench_kit.engine import openai_client, refused_reply
from mlbench_kit.infer_config import InferConfig

from .backends import Completion
from .prompts import PromptItem

if TYPE_CHECKING:
    from openai.types.chat import ChatCompletionMessageParam  # role/content dicts, as prompts.py makes them


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


class OpenAIBackend:
    """``api: completions`` sends the rendered prompt (as token ids when a tokenizer is known, so BOS and the
    chat template are exactly training's); ``api: chat`` sends the user turn for API chat models."""

    def __init__(self, model: str, cfg: InferConfig, send_token_ids: bool) -> None:
        o = cfg.openai
        self.client = openai_client(o["base_url"], o["api_key_env"], o["max_retries"], o["timeout_s"],
                                    "--backend openai")
        self.model, self.cfg, self.ids = model, cfg, send_token_ids
        self.limit = RateLimiter(int(o["requests_per_minute"]))
        self.pool = ThreadPoolExecutor(max_workers=max(1, int(o["concurrency"])))

    def _one(self, it: PromptItem) -> list[Completion]:
        s, api = self.cfg.sampling, self.cfg.openai["api"]
        common: dict[str, Any] = dict(model=self.model, n=s.n, temperature=s.temperature, top_p=s.top_p,
                                      max_tokens=s.max_new_tokens, seed=s.for_prompt(it.key), stop=list(s.stop) or None)
        self.limit.wait()
        texts: list[Any]  # what the server sent, checked with every engine's replies (infer.run._record)
        try:
            if api == "chat":
                r = self.client.chat.completions.create(
                    messages=cast("list[ChatCompletionMessageParam]", it.messages), **common)
                texts = [getattr(getattr(c, "message", None), "content", None) for c in _choices(r)]
            else:
                if s.top_k:
                    common["extra_body"] = {"top_k": s.top_k}  # vLLM's extension; plain OpenAI has no top_k
                prompt: Any = list(it.token_ids) if self.ids else it.text
                r = self.client.completions.create(prompt=prompt, **common)
                texts = [getattr(c, "text", None) for c in sorted(_choices(r), key=_index)]
        except Exception as exc:
            why = refused_reply(exc)
            if why is None:
                raise  # the server is unreachable or failed: the run's problem, not this prompt's
            return [Completion("", 0, why)] * s.n
        tokens = _tokens(r, s.n)
        out = [Completion(t, tokens) for t in texts[:s.n]]
        return out + [Completion("", 0, f"{len(texts)} choices for n={s.n}")] * (s.n - len(out))

    def generate(self, items: list[PromptItem], adapter: str | None = None) -> list[list[Completion]]:
        return list(self.pool.map(self._one, items))

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def _choices(response: Any) -> list[Any]:
    choices = getattr(response, "choices", None)
    return choices if isinstance(choices, list) else []


def _index(choice: Any) -> int:
    i = getattr(choice, "index", 0)
    return i if isinstance(i, int) else 0


def _tokens(response: Any, n: int) -> Any:
    """Per-choice completion tokens (the usage block only has the total); a count that is not a number is kept as
    it is, for the reply's check (:func:`~mlbench_kit.engine.reply_fault`) to refuse."""
    used = getattr(getattr(response, "usage", None), "completion_tokens", None)
    if used is None:
        return 0
    return used // n if isinstance(used, int) and not isinstance(used, bool) and used >= 0 else used
