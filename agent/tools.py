"""ML-Agent's JSON steps as OpenAI tool calls (``actions: tools``), the way the released agent and every API model
act: each step's function (``prompts.FUNCTIONS``: its name, the paper's captions as descriptions, the same fields)
is offered as the one tool of the turn and forced by name (``tool_choice``); the call's ``arguments`` (JSON text)
is the step's reply.

Two changes to the function the text mode shows: each flag field is an ``enum`` of the values its caption names
('Yes'/'No', 'CODE'/'FILE'/'No'), and the function is ``strict`` (OpenAI's word for "the arguments follow the
schema": ``"strict": true``, no other properties). Without ``strict``, vLLM 0.32 with a parser that has a
structural tag (hermes) constrains only a forced call's envelope: the function's name, then any JSON as arguments
(with the tests' tiny model 15 of 18 calls had a number, a boolean or a string as arguments, the other 3 were cut
at the token cap); with it, the arguments are decoded to the schema, so a flag is one the harness takes.

A reply is untrusted: no call, more than one, a call of another function, arguments over the size the turn's new
tokens can hold, arguments that are not one JSON object, or an object the step's parser refuses
(:func:`agent.parse.parse_object`) is a :class:`~agent.parse.FormatError` of that turn, counted as a text reply's."""

from __future__ import annotations

import copy
import json
from typing import Any

from mlbench_kit.engine import CHARS_PER_TOKEN

from . import prompts as P
from .parse import FLAGS, KEYS, FormatError, parse_object


def tool(step: str) -> dict[str, Any]:
    """The OpenAI tool of ``step``: its function as the text mode shows it, strict, the flag an enum."""
    fn = copy.deepcopy(P.FUNCTIONS[step])
    fn["strict"] = True
    fn["parameters"]["additionalProperties"] = False  # what strict asks of a schema (every field is required)
    if step in FLAGS:  # the values the step's parser takes
        fn["parameters"]["properties"][KEYS[step]]["enum"] = list(FLAGS[step])
    return {"type": "function", "function": fn}


def tools_text(step: str) -> str:
    """The ``tools`` list of a turn of ``step`` (its one tool) as the JSON text a request carries."""
    return json.dumps([tool(step)], ensure_ascii=False)


def function_name(step: str) -> str:
    """The name of ``step``'s function (the one a turn of it forces)."""
    return str(P.FUNCTIONS[step]["name"])


def parse_call(calls: list[tuple[str, str]], step: str, max_new_tokens: int) -> dict[str, Any]:
    """The action of a reply to ``step`` made of tool ``calls`` (name, arguments): exactly one call of the step's
    function whose arguments (at most what ``max_new_tokens`` tokens can hold) are one JSON object the step's
    parser takes; else a :class:`FormatError` saying which of these failed."""
    want = function_name(step)
    if not calls:
        raise FormatError(f"the reply called no function; this step's is {want}")
    if len(calls) > 1:
        raise FormatError(f"the reply made {len(calls)} function calls; one call of {want} is the answer")
    name, args = calls[0]
    if name != want:
        raise FormatError(f"the reply called {name[:60]!r}; this step's function is {want}")
    limit = max_new_tokens * CHARS_PER_TOKEN
    if len(args) > limit:
        raise FormatError(f"the call's arguments are {len(args)} characters, more than {max_new_tokens} tokens "
                          f"can hold ({limit})")
    try:
        obj = json.loads(args)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise FormatError(f"the call's arguments are not JSON: {str(exc)[:120]}") from None
    if not isinstance(obj, dict):
        raise FormatError(f"the call's arguments are a JSON {type(obj).__name__}, not an object")
    return parse_object(obj, step)
