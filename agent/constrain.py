"""Constrained decoding of ML-Agent's JSON steps (``decoding: json``): each step's reply as a JSON schema that the
engine's structured outputs enforce token by token (vLLM's ``StructuredOutputsParams(json=...)``).

The schema is the step's function (``prompts.FUNCTIONS``: the same fields, in the same order) made exact:

- the flags are their enums, and each flag's other fields follow it (``CODE`` needs its code, ``FILE`` its path),
  so every reply :func:`agent.parse.parse_reply` accepts is one the schema allows and the other way round;
- where a step chooses names, only the names the harness offered in that prompt: the README files step 3 lists
  (``repo_name/README.md``, as shown), the files of the directory index step 4 shows (as cut to its cap), the
  candidate URLs of step 2. A name the harness did not offer cannot be written.

Free text (code, argument code, keywords) stays free; a reply cut by the token cap is still unparseable."""

from __future__ import annotations

import json
from typing import Any

from .parse import KEYS


def _names(names: list[str]) -> list[str]:
    """The offered names that can be written as UTF-8 text, each once, in order (a checkout's file names are
    untrusted: one a filesystem holds as undecodable bytes cannot be named in a reply anyway)."""
    out: list[str] = []
    for n in names:
        try:
            n.encode("utf-8")
        except UnicodeEncodeError:
            continue
        if n not in out:
            out.append(n)
    return out


def _obj(props: dict[str, Any]) -> dict[str, Any]:
    return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}


def _choice(names: list[str]) -> dict[str, Any]:
    """A list of one or more of ``names``, at most as many as there are (a model cannot loop on one name until its
    token cap); an empty list when there is no name to choose."""
    if not names:
        return {"type": "array", "maxItems": 0}
    return {"type": "array", "items": {"type": "string", "enum": names}, "minItems": 1, "maxItems": len(names)}


def step_schema(step: str, offered: list[str]) -> dict[str, Any]:
    """The JSON schema of a reply to ``step``; ``offered``: the names the step's prompt offers (plan: the README
    files as listed, code_or_file: the index's files as shown, rank: the candidates' URLs; others: unused)."""
    if step not in KEYS:
        raise ValueError(f"unknown step {step!r}")
    text = {"type": "string"}
    code = {"type": "string", "minLength": 1}
    empty = {"type": "string", "const": ""}
    names = _names(offered)
    if step == "keywords":
        return _obj({"keywords": {"type": "array", "items": text, "minItems": 1}})
    if step == "rank":
        return _obj({"ranked_repos": _choice(names)})
    if step == "plan":
        readmes = _choice(names)
        return {"anyOf": [_obj({"task_flag": {"type": "string", "const": "Yes"}, "ranked_readmefiles": readmes}),
                          _obj({"task_flag": {"type": "string", "const": "No"},
                                "ranked_readmefiles": {"type": "array", "maxItems": 0}})]}
    if step == "read_args":
        return _obj({"args_code": text})
    if step == "write_code":
        return {"anyOf": [_obj({"flag": {"type": "string", "const": "CODE"}, "finally_code": code}),
                          _obj({"flag": {"type": "string", "const": "No"}, "finally_code": empty})]}
    variants = [_obj({"flag": {"type": "string", "const": "CODE"}, "file_path": empty, "code": code})]
    if names:  # an index with no file offers no FILE answer
        variants.append(_obj({"flag": {"type": "string", "const": "FILE"},
                              "file_path": {"type": "string", "enum": names}, "code": empty}))
    variants.append(_obj({"flag": {"type": "string", "const": "No"}, "file_path": empty, "code": empty}))
    return {"anyOf": variants}


def schema_text(step: str, offered: list[str]) -> str:
    """:func:`step_schema` as the JSON text an engine request carries (compact, names as written)."""
    return json.dumps(step_schema(step, offered), ensure_ascii=False, separators=(",", ":"))
