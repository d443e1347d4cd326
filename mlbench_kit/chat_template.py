"""A model folder's chat template rendered within bounds: it is untrusted code (Jinja) that prep, infer and the
agent run on every prompt.

transformers (5.19, ``utils/chat_template_utils.py``) already compiles it in Jinja's ``ImmutableSandboxedEnvironment``
(no attribute of Python internals, no mutation of lists and dicts), but renders it with no bound on time or size: a
template with nested loops grew memory until the machine ran out (issue 30). :func:`render_chat` renders the very
same compiled template with the very same variables as ``tokenizer.apply_chat_template(messages, tokenize=False)``
(so the text is identical), and stops it with one clear error when it runs longer than ``seconds`` or makes more
than ``max_chars`` characters:

- the output is read chunk by chunk and counted;
- every call, attribute, item and ``* ** + %`` the template evaluates checks the clock and the size of what it makes
  (``'x' * 10**9``, ``'x'|center(10**9)`` and a string doubled in a loop are refused before they are allocated, or
  as soon as they exceed the budget);
- a loop that makes nothing and calls nothing is stopped by a watchdog that raises in the rendering thread.
"""

from __future__ import annotations

import ctypes
import functools
import re
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from .errors import MLBenchError

SECONDS = 10.0  # a real template renders a prompt in well under 10 ms
MIN_CHARS = 1 << 20  # the budget: 4x the messages' text, and at least this


class _Overrun(BaseException):
    """The render went past its budget (a BaseException: nothing in Jinja or the template may catch it)."""


class _Budget(threading.local):
    deadline: float | None = None
    max_chars: int = 0
    why: str = ""

    def over(self, why: str) -> _Overrun:
        self.why = why
        return _Overrun(why)

    def check(self, value: Any = None) -> Any:
        if self.deadline is None:  # not inside render_chat
            return value
        if time.monotonic() > self.deadline:
            raise self.over("time")
        if isinstance(value, (str, bytes, list, tuple, dict, set)) and len(value) > self.max_chars:
            raise self.over("size")
        return value

    def check_args(self, args: tuple, kwargs: dict) -> None:
        if self.deadline is None:
            return
        for a in (*args, *kwargs.values()):
            self.check(a)
            if isinstance(a, int) and not isinstance(a, bool) and abs(a) > self.max_chars:
                raise self.over("size")  # a width, a count or a repeat this large makes a value past the budget

    def check_format(self, fmt: Any) -> None:
        if self.deadline is not None and isinstance(fmt, str) and re.search(r"[%{][^%{]*?\d{7,}", fmt):
            raise self.over("size")  # a format width of 7+ digits ('%999999999d', '{:>999999999}')


_budget = _Budget()


def _bounded_env_class() -> type:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Bounded(ImmutableSandboxedEnvironment):
        intercepted_binops = frozenset({"*", "**", "+", "%"})

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
            _budget.check_args(args, kwargs)
            if getattr(__obj, "__name__", "") in ("format", "format_map"):
                _budget.check_format(getattr(__obj, "__self__", None))
            return _budget.check(super().call(__context, __obj, *args, **kwargs))

        def getattr(self, obj: Any, attribute: str) -> Any:
            return _budget.check(super().getattr(obj, attribute))

        def getitem(self, obj: Any, argument: Any) -> Any:
            return _budget.check(super().getitem(obj, argument))

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            _budget.check()
            if operator == "**" and isinstance(right, int) and right > 64 and isinstance(left, int) and abs(left) > 1:
                raise _budget.over("size")
            if operator == "*":
                n, seq = (right, left) if isinstance(right, int) else (left, right)
                if isinstance(n, int) and hasattr(seq, "__len__") and len(seq) * max(n, 0) > _budget.max_chars:
                    raise _budget.over("size")
            if operator == "%":
                _budget.check_format(left)
            return _budget.check(super().call_binop(context, operator, left, right))

    return Bounded


@functools.lru_cache(maxsize=8)
def _compile(template: str) -> Any:
    """transformers' own compiled template (its environment, filters and globals), re-made on a bounded sandbox."""
    from transformers.utils.chat_template_utils import _cached_compile_jinja_template

    # a fresh environment of transformers' making (from an empty template: Jinja folds constants while compiling,
    # and `'x' * 2000000000` would be made right there), then bounded before the template is compiled
    env = _cached_compile_jinja_template("").environment
    env.__class__ = _bounded_env_class()  # same state, bounded hooks (Bounded only overrides methods)
    for name, f in list(env.filters.items()):
        env.filters[name] = _bounded_filter(f, name == "format")
    return env.from_string(template)  # operators are intercepted, filters bounded, at compile time too


def _bounded_filter(f: Any, formats: bool) -> Any:
    @functools.wraps(f)  # keeps jinja's pass_context/pass_eval_context marks
    def bounded(*args: Any, **kwargs: Any) -> Any:
        _budget.check_args(args[1:], kwargs)  # the first argument is what is filtered, or the context
        if formats:
            _budget.check_format(args[0] if args else None)
        return _budget.check(f(*args, **kwargs))
    return bounded


@contextmanager
def _watchdog(seconds: float) -> Iterator[dict[str, bool]]:
    """Raise :class:`_Overrun` in this thread after ``seconds``, wherever it is in pure-Python code (a Jinja loop
    that neither outputs nor calls anything)."""
    tid = threading.get_ident()
    lock = threading.Lock()
    state = {"done": False, "fired": False}

    def fire() -> None:
        with lock:
            if not state["done"]:
                state["fired"] = True
                ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(tid), ctypes.py_object(_Overrun))

    timer = threading.Timer(seconds, fire)
    timer.daemon = True
    timer.start()
    try:
        yield state
    finally:
        with lock:
            state["done"] = True
        timer.cancel()
        if state["fired"]:  # raised already, or still pending: never let it out of render_chat
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(tid), None)


def _template_line(compiled: Any, tb: Any, gen: Any) -> int | None:
    """The template's line the render was at: the innermost frame of the template's code in the traceback (a
    budget hook or the watchdog raised there), else where its generator last yielded (the size of the output)."""
    frames = []
    while tb is not None:
        frames.append((tb.tb_frame, tb.tb_lineno))
        tb = tb.tb_next
    while gen is not None and getattr(gen, "gi_frame", None) is not None:
        frames.append((gen.gi_frame, gen.gi_frame.f_lineno))
        gen = gen.gi_yieldfrom
    lines = [n for f, n in frames if f.f_code.co_filename == "<template>"]
    return compiled.get_corresponding_lineno(lines[-1]) if lines else None


def _where(tokenizer: Any, template: str, line: int | None) -> str:
    """The file and line of the chat template: the model folder's ``chat_template.jinja`` (transformers 5 keeps it
    there) or the ``chat_template`` entry of its ``tokenizer_config.json``."""
    folder = Path(getattr(tokenizer, "name_or_path", "") or "")
    jinja = folder / "chat_template.jinja"
    try:
        if str(folder) not in ("", ".") and jinja.is_file() and jinja.read_text(encoding="utf-8") == template:
            return f"{jinja}:{line}" if line else str(jinja)
    except (OSError, UnicodeDecodeError):
        pass
    base = f"{folder / 'tokenizer_config.json'}" if str(folder) not in ("", ".") else "the tokenizer"
    return f"{base}: chat_template" + (f", line {line}" if line else "")


def render_chat(tokenizer: Any, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                seconds: float = SECONDS, max_chars: int | None = None) -> str:
    """``tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=...)``, the same text, within
    ``seconds`` and ``max_chars`` characters (default: 4x the messages' text, at least 1 MiB); past either, an
    :class:`MLBenchError` naming the template."""
    template = tokenizer.get_chat_template()
    size = sum(len(str(m.get("content", ""))) for m in messages)
    limit = max_chars if max_chars is not None else max(4 * size, MIN_CHARS)
    variables = {**tokenizer.special_tokens_map, "messages": messages, "tools": None, "documents": None,
                 "add_generation_prompt": add_generation_prompt}
    out: list[str] = []
    n = 0
    watch = {"fired": False}
    compiled = gen = None
    _budget.deadline, _budget.max_chars, _budget.why = time.monotonic() + seconds, limit, ""
    try:
        with _watchdog(seconds) as watch:
            compiled = _compile(template)
            gen = compiled.generate(**variables)
            for chunk in gen:
                n += len(chunk)
                out.append(chunk)
                if n > limit:
                    raise _budget.over("size")
                _budget.check()
    except _Overrun as exc:
        what = (f"ran past {seconds:g} s" if watch["fired"] or _budget.why == "time" else
                f"made more than {limit} characters (4x the messages' text, at least {MIN_CHARS})")
        line = _template_line(compiled, exc.__traceback__, gen) if compiled is not None else None
        raise MLBenchError(f"the chat template {what} while rendering one prompt", _where(tokenizer, template, line),
                           "the model folder's chat template is unusable: fix or replace it (tokenizer_config.json or "
                           "chat_template.jinja), or use a plain template (--template paper or llama-inst)") from None
    finally:
        _budget.deadline = None
    return "".join(out)
