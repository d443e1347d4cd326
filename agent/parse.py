"""The model's replies to ML-Agent's steps: one JSON object per reply, checked against the step's fields.

A reply that is not one JSON object with the step's required fields is a format error (:class:`FormatError`,
whose text is recorded in the transcript); the harness counts consecutive ones against ``limits.max_format_errors``.
The JSON may stand alone or in a fenced block; text around it is ignored (small models talk)."""

from __future__ import annotations

import json
import re
from typing import Any

_FENCE = re.compile(r"```(?:json|JSON)?[ \t]*\n(.*?)```", re.DOTALL)


# each step's reply: the field that identifies its JSON object
KEYS = {"plan": "task_flag", "code_or_file": "flag", "read_args": "args_code", "write_code": "flag",
        "keywords": "keywords", "rank": "ranked_repos"}
# the values each step's flag takes (its field is KEYS[step]); the tool-call mode offers them as enums (agent/tools.py)
FLAGS = {"plan": ("Yes", "No"), "code_or_file": ("CODE", "FILE", "No"), "write_code": ("CODE", "No")}


class FormatError(ValueError):
    """A reply the harness cannot act on."""


def _objects(text: str) -> list[Any]:
    """Every JSON object in ``text``: fenced blocks first, then each balanced ``{...}`` span, in order."""
    found: list[Any] = []
    for body in _FENCE.findall(text):
        try:
            found.append(json.loads(body))
        except json.JSONDecodeError:
            pass
    dec = json.JSONDecoder()
    i = text.find("{")
    while i != -1:
        try:
            obj, end = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            i = text.find("{", i + 1)
            continue
        found.append(obj)
        i = text.find("{", end)
    return [o for o in found if isinstance(o, dict)]


def _flag(value: Any, allowed: tuple[str, ...], key: str) -> str:
    if not isinstance(value, str):
        raise FormatError(f"`{key}` must be one of {', '.join(allowed)}")
    v = value.strip().strip(".!'\" ").lower()
    for a in allowed:
        if v == a.lower():
            return a
    raise FormatError(f"`{key}` must be one of {', '.join(allowed)}, got {value[:40]!r}")


def _text(obj: dict[str, Any], key: str) -> str:
    v = obj.get(key, "")
    if v is None:
        return ""
    if not isinstance(v, str):
        raise FormatError(f"`{key}` must be a string")
    return v


def _list(value: Any, key: str) -> list[str]:
    """The ranked README list: a JSON list, or the comma-separated string the released agent also accepted."""
    if isinstance(value, str):
        return [s.strip() for s in value.split(",") if s.strip()]
    if isinstance(value, list) and all(isinstance(x, str) for x in value):
        return [x.strip() for x in value if x.strip()]
    raise FormatError(f"`{key}` must be a list of file names")


def parse_reply(text: str, step: str) -> dict[str, Any]:
    """The action a reply to ``step`` asks for, as a dict with ``kind``:

    - keywords (step 1): ``{"kind": "keywords", "keywords": [...]}``
    - rank (step 2): ``{"kind": "rank", "repos": [...]}``
    - plan: ``{"kind": "plan", "flag": "Yes"|"No", "readmes": [...]}``
    - code_or_file: ``{"kind": "code", "code": ...}`` | ``{"kind": "file", "path": ...}`` | ``{"kind": "reject"}``
    - read_args: ``{"kind": "args", "args": ...}``
    - write_code: ``{"kind": "code", "code": ...}`` | ``{"kind": "reject"}``
    """
    if step not in KEYS:
        raise ValueError(f"unknown step {step!r}")
    objs = [o for o in _objects(text) if KEYS[step] in o]
    if not objs:
        raise FormatError(f"no JSON object with `{KEYS[step]}` in the reply")
    return parse_object(objs[0], step)


def parse_object(obj: dict[str, Any], step: str) -> dict[str, Any]:
    """The action of the reply's JSON object (:func:`parse_reply`'s, or a tool call's arguments); a
    :class:`FormatError` when it lacks the step's field or a field's value is not one the step takes."""
    if step not in KEYS:
        raise ValueError(f"unknown step {step!r}")
    if KEYS[step] not in obj:
        raise FormatError(f"no `{KEYS[step]}` in the reply's JSON object")
    if step == "keywords":
        return {"kind": "keywords", "keywords": _list(obj["keywords"], "keywords")}
    if step == "rank":
        return {"kind": "rank", "repos": _list(obj["ranked_repos"], "ranked_repos")}
    if step == "plan":
        flag = _flag(obj["task_flag"], FLAGS[step], "task_flag")
        readmes = _list(obj.get("ranked_readmefiles", []), "ranked_readmefiles") if flag == "Yes" else []
        return {"kind": "plan", "flag": flag, "readmes": readmes}
    if step == "read_args":
        v = obj["args_code"]
        return {"kind": "args", "args": v if isinstance(v, str) else json.dumps(v)}
    if step == "code_or_file":
        flag = _flag(obj["flag"], FLAGS[step], "flag")
        if flag == "FILE":
            path = _text(obj, "file_path").strip()
            if not path:
                raise FormatError("flag FILE needs `file_path`")
            return {"kind": "file", "path": path}
        code_key = "code"
    else:
        flag = _flag(obj["flag"], FLAGS[step], "flag")
        code_key = "finally_code"
    if flag == "No":
        return {"kind": "reject"}
    code = _text(obj, code_key)
    if not code.strip():
        raise FormatError(f"flag CODE needs `{code_key}`")
    return {"kind": "code", "code": code}
