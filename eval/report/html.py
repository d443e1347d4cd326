"""``report.html``: every scored row of the compared runs on one self-contained page, to browse in a browser.

One file, no server and nothing fetched: the rows are embedded as JSON (in a ``<script type="application/json">``
block, ``<``, ``>`` and ``&`` escaped so no text can close it), and one inline script builds the page from them with
``textContent`` only, so every instruction, answer and output tail is shown as text, never parsed as HTML. The
Content-Security-Policy allows exactly that inline script and style (by hash) and nothing else: no remote load, no
inline handler, no other script, even one that found a way into the markup.

Per row: repository, ids, type and instruction, then one column per compared run (each seed of a setting apart),
each with its answers, their verdict, error class and the tail of their output; an agent run's answer also with its
episode (how it ended, and each turn: step, the model's reply, the observation it got or its format error), read
from the run's transcript beside its generations (``transcripts/<github_id>-<id>/ep<k>.jsonl``; no link followed).
Filters (repository, verdict, error class) also read the page's ``#repo=…&verdict=…&class=…`` fragment, so a
filtered view can be linked.

Every file it reads is data: the answers come only from a generations file inside the working folder or beside the
eval folder (:func:`~.data.generations_file`; another path a summary names is not read, and the page says the
answers are not at hand), and a line of ``results.jsonl``, of the generations or of the summary's ``per_sample``
that is not a record (not JSON, not an object) is skipped and counted on the page.
"""

from __future__ import annotations

import base64
import hashlib
import json
import sys
from pathlib import Path
from typing import Any

from mlbench_kit.escape import visible
from mlbench_kit.io import split_records, write_atomic
from mlbench_kit.records import transcript_file

from .data import MAX_GENERATIONS, Setting, generations_file

MAX_TEXT = 20_000  # characters of one instruction or answer shown
MAX_TAIL = 2_000  # characters of an output's tail
MAX_FILE = MAX_GENERATIONS  # a generations file larger than this is not read (the page says so)
MAX_TURNS = 50  # turns of one episode shown

STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:0 1.5em 3em;color:#222}
header{position:sticky;top:0;background:#fff;padding:.6em 0;border-bottom:1px solid #ccc;z-index:1}
h1{font-size:1.3em;margin:.2em 0}
label{margin-right:1em}
.row{border-bottom:1px solid #ddd;padding:.8em 0}
.meta{color:#555;font-size:.9em}
.instruction{white-space:pre-wrap;margin:.3em 0 .6em}
.runs{display:grid;grid-auto-flow:column;grid-auto-columns:minmax(22em,1fr);gap:1em;overflow-x:auto}
.run h3{font-size:1em;margin:0 0 .3em}
.answer{border-left:4px solid #bbb;padding:.2em .5em;margin:.3em 0}
.answer.pass{border-color:#2a2}
.answer.fail{border-color:#c33}
pre{white-space:pre-wrap;word-break:break-word;margin:.2em 0;background:#f6f6f6;padding:.3em;
  max-height:20em;overflow:auto}
.none{color:#888;font-style:italic}
"""

SCRIPT = """
"use strict";
const D = JSON.parse(document.getElementById("rows").textContent);
function el(tag, cls, text) {
  const e = document.createElement(tag);
  if (cls) e.className = cls;
  if (text !== undefined && text !== null) e.textContent = String(text);
  return e;
}
function options(select, values) {
  for (const v of values) { const o = el("option", null, v); o.value = v; select.appendChild(o); }
}
const repo = document.getElementById("repo"), verdict = document.getElementById("verdict"),
      klass = document.getElementById("class"), count = document.getElementById("count");
options(repo, D.repos);
options(klass, D.classes);
for (const n of D.notes) document.getElementById("notes").appendChild(el("div", "meta", n));
const list = document.getElementById("list"), shown = [];
for (const r of D.rows) {
  const s = el("section", "row");
  s.appendChild(el("div", "meta", r.repo + " \\u00b7 github_id " + r.github_id + " id " + r.id + " \\u00b7 " + r.type));
  s.appendChild(el("div", "instruction",
                   r.instruction === null ? "(instruction not in the summaries)" : r.instruction));
  const runs = el("div", "runs");
  r.cells.forEach(function (cell, i) {
    const c = el("div", "run");
    c.appendChild(el("h3", null, D.columns[i]));
    if (cell === null) c.appendChild(el("div", "none", "not scored in this run"));
    else for (const a of cell) {
      const box = el("div", "answer " + (a.passed ? "pass" : "fail"));
      box.appendChild(el("div", "meta", "answer " + (a.idx + 1) + ": " + (a.passed ? "passed" : "failed") +
                                        (a.cls ? " \\u00b7 " + a.cls : "")));
      box.appendChild(a.answer === null ? el("div", "none", "(answer text not at hand)") : el("pre", null, a.answer));
      if (a.tail) {
        const d = el("details");
        d.appendChild(el("summary", null, "output tail"));
        d.appendChild(el("pre", null, a.tail));
        box.appendChild(d);
      }
      if (a.episode) {
        const d = el("details", "episode");
        d.appendChild(el("summary", null, "episode: " + a.episode.exit + " \u00b7 " + a.episode.turns.length +
                                          " turn(s)" + (a.episode.more ? " (+" + a.episode.more + " not shown)" : "")));
        a.episode.turns.forEach(function (t, j) {
          d.appendChild(el("div", "meta", "turn " + (j + 1) + " \u00b7 " + t.step));
          d.appendChild(el("pre", "reply", t.reply === null ? "(no reply)" : t.reply));
          if (t.error) d.appendChild(el("div", "meta", "format error: " + t.error));
          if (t.observation !== null) d.appendChild(el("pre", "observation", t.observation));
        });
        box.appendChild(d);
      }
      c.appendChild(box);
    }
    runs.appendChild(c);
  });
  s.appendChild(runs);
  list.appendChild(s);
  shown.push([r, s]);
}
function keep(r) {
  if (repo.value && r.repo !== repo.value) return false;
  const ok = r.cells.filter(function (c) { return c !== null; })
                    .map(function (c) { return c.some(function (a) { return a.passed; }); });
  if (verdict.value === "pass" && !(ok.length && ok.every(Boolean))) return false;
  if (verdict.value === "fail" && !ok.some(function (x) { return !x; })) return false;
  if (verdict.value === "differs" && !(ok.some(Boolean) && ok.some(function (x) { return !x; }))) return false;
  if (klass.value && !r.cells.some(function (c) {
    return c !== null && c.some(function (a) { return (a.cls || "none") === klass.value; });
  })) return false;
  return true;
}
function apply() {
  let n = 0;
  for (const [r, s] of shown) { const k = keep(r); s.hidden = !k; if (k) n += 1; }
  count.textContent = n + " of " + shown.length + " rows";
  const h = new URLSearchParams();
  if (repo.value) h.set("repo", repo.value);
  if (verdict.value) h.set("verdict", verdict.value);
  if (klass.value) h.set("class", klass.value);
  try { history.replaceState(null, "", h.toString() ? "#" + h.toString() : location.pathname); } catch (e) { }
}
const start = new URLSearchParams(location.hash.slice(1));
for (const [sel, key] of [[repo, "repo"], [verdict, "verdict"], [klass, "class"]]) {
  const v = start.get(key);
  if (v !== null && Array.from(sel.options).some(function (o) { return o.value === v; })) sel.value = v;
  sel.addEventListener("change", apply);
}
apply();
document.body.setAttribute("data-ready", "1");
"""


def _sha256(text: str) -> str:
    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


def _clip(text: Any, limit: int, tail: bool = False) -> str | None:
    if not isinstance(text, str):
        return None
    if len(text) <= limit:
        return text
    return f"[… {len(text) - limit} characters before]\n" + text[-limit:] if tail else \
        text[:limit] + f"\n[… {len(text) - limit} characters more]"


def _refused(path: Path) -> bool:
    """Whether a file that is there is one the page does not read: a link, or over :data:`MAX_FILE` bytes."""
    return path.is_symlink() or (path.is_file() and path.stat().st_size > MAX_FILE)


def _records(path: Path) -> tuple[list[Any], int]:
    """The records (JSON objects) of a JSONL file, and how many of its lines were not one (skipped). A file that is
    missing or :func:`_refused` is not read (none, 0 skipped: the caller notes it)."""
    if not path.is_file() or _refused(path):
        return [], 0
    out: list[Any] = []  # JSON objects (mapped by the caller field by field, as untrusted data)
    skipped = 0
    for line in split_records(path.read_text(encoding="utf-8", errors="replace")):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except (ValueError, RecursionError):  # RecursionError: nested too deeply
            obj = None
        if isinstance(obj, dict):
            out.append(obj)
        else:
            skipped += 1
    return out, skipped


Answers = dict[tuple[int, int], tuple[list[Any], Path | None]]


def _answers(summary: dict[str, Any], run_dir: Path) -> tuple[Answers, int, bool]:
    """The answers the eval scored, from the generations file its summary names (:func:`~.data.generations_file`:
    relative to the working folder, else to the run folder, and inside the working folder or beside the run
    folder), each row's with the agent run folder holding its transcripts when an agent wrote it (else None); the
    lines skipped; whether a file the summary names was refused (outside, a link, too large)."""
    f = generations_file(summary, run_dir)
    if f is None:
        gens = summary.get("generations")
        return {}, 0, isinstance(gens, str) and gens.endswith(".jsonl")
    out: Answers = {}
    records, skipped = _records(f)
    for r in records:
        gid, rid, outputs = r.get("github_id"), r.get("id"), r.get("output")
        if isinstance(outputs, str):
            outputs = [outputs]
        if isinstance(gid, int) and isinstance(rid, int) and isinstance(outputs, list):
            agent = isinstance(r.get("agent"), dict)
            out[(gid, rid)] = outputs, f.parent if agent else None
    return out, skipped, False


def _episode(run: Path, key: tuple[int, int], idx: int) -> dict[str, Any] | None:
    """Episode ``idx`` of row ``key`` as the page shows it, from its transcript in the agent run folder ``run``;
    None when it is not there or is refused (a link at or below the run's ``transcripts/``, or too large)."""
    path = transcript_file(run, key, idx)
    if path is None or not path.is_file() or _refused(path):
        return None
    records, _ = _records(path)
    end: dict[str, Any] = next((r["end"] for r in records if isinstance(r.get("end"), dict)), {})
    turns = [r for r in records if "end" not in r]
    return {"exit": str(end.get("exit", "not ended")), "more": max(0, len(turns) - MAX_TURNS),
            "turns": [{"step": str(t.get("step", "")), "reply": _clip(t.get("raw"), MAX_TAIL),
                       "observation": _clip(t.get("observation"), MAX_TAIL), "error": _clip(t.get("error"), 300)}
                      for t in turns[:MAX_TURNS]]}


def page_rows(settings: list[Setting]) -> dict[str, Any]:
    """What the page shows: its columns (one per eval folder) and, per row, each column's answers."""
    columns: list[str] = []
    notes: list[str] = []
    rows: dict[tuple[int, int], dict[str, Any]] = {}
    cells: list[dict[tuple[int, int], list[dict[str, Any]]]] = []
    for s in settings:
        for i, (summary, d) in enumerate(zip(s.summaries, s.dirs, strict=True)):
            cp = s.checkpoints[i] if i < len(s.checkpoints) else None
            column = s.label + (f" · seed {i + 1}" if len(s.dirs) > 1 else "") + (f" · {cp.label}" if cp else "")
            columns.append(column)
            answers, skipped, refused = _answers(summary, Path(d))
            if refused:
                notes.append(f"{column}: answer texts not at hand: the generations file its summary.json names "
                             f"({_clip(summary.get('generations'), 300)}) is missing, outside both the working "
                             f"folder and the folder holding {d}, a link, or too large")
            per_sample = summary.get("per_sample")
            samples: list[Any] = per_sample if isinstance(per_sample, list) else []
            skipped += sum(not isinstance(ps, dict) for ps in samples)
            for ps in samples:
                if not isinstance(ps, dict):
                    continue
                gid, rid = ps.get("github_id"), ps.get("id")
                if isinstance(gid, int) and isinstance(rid, int) and isinstance(ps.get("instruction"), str):
                    rows.setdefault((gid, rid), {})["instruction"] = _clip(ps["instruction"], MAX_TEXT)
            col: dict[tuple[int, int], list[dict[str, Any]]] = {}
            results_file = Path(d) / "results.jsonl"
            if _refused(results_file):
                notes.append(f"{column}: verdicts not shown: its results.jsonl is a link or over {MAX_FILE} bytes")
            results, bad = _records(results_file)
            if skipped + bad:
                notes.append(f"{column}: skipped {skipped + bad} line(s) that are not records ({bad} of "
                             f"results.jsonl, {skipped} of the generations and the summary's per_sample)")
            for r in results:
                key, idx = (r.get("github_id"), r.get("id")), r.get("idx")
                if not isinstance(key[0], int) or not isinstance(key[1], int) or not isinstance(idx, int):
                    continue
                row = rows.setdefault(key, {})
                row.setdefault("repo", str(r.get("repo", "")))
                row.setdefault("type", str(r.get("type", "")))
                outs, agent_run = answers.get(key, ([], None))
                col.setdefault(key, []).append({
                    "idx": idx, "passed": r.get("passed") is True,
                    "cls": r.get("error_class") if isinstance(r.get("error_class"), str) else None,
                    "answer": _clip(outs[idx], MAX_TEXT) if 0 <= idx < len(outs) else None,
                    "tail": _clip(r.get("log") or "", MAX_TAIL, tail=True),
                    "episode": _episode(agent_run, key, idx) if agent_run is not None and idx >= 0 else None})
            cells.append(col)
    out = []
    for key in sorted(k for k in rows if "repo" in rows[k]):
        row = rows[key]
        out.append({"github_id": key[0], "id": key[1], "repo": row["repo"], "type": row["type"],
                    "instruction": row.get("instruction"),
                    "cells": [sorted(c[key], key=lambda a: a["idx"]) if key in c else None for c in cells]})
    classes = sorted({a["cls"] or "none" for r in out for c in r["cells"] if c for a in c})
    return {"columns": columns, "rows": out, "repos": sorted({r["repo"] for r in out}), "classes": classes,
            "notes": notes}


def _json_in_html(obj: Any) -> str:
    """JSON that no text inside can end the ``<script>`` element holding it."""
    return json.dumps(obj).replace("&", "\\u0026").replace("<", "\\u003c").replace(">", "\\u003e")


def render_html(settings: list[Setting], data: dict[str, Any] | None = None) -> str:
    """The whole page (``data``: :func:`page_rows`'s, when already read)."""
    data = page_rows(settings) if data is None else data
    csp = (f"default-src 'none'; script-src {_sha256(SCRIPT)}; style-src {_sha256(STYLE)}; img-src 'none'; "
           "base-uri 'none'; form-action 'none'")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{csp}">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>mlbench report: every row</title>
<style>{STYLE}</style></head>
<body><header><h1>mlbench report: every row, side by side</h1>
<label>repository <select id="repo"><option value="">all</option></select></label>
<label>verdict <select id="verdict"><option value="">any</option><option value="pass">passed in every run</option>
<option value="fail">failed in some run</option><option value="differs">differs between runs</option></select></label>
<label>error class <select id="class"><option value="">any</option></select></label>
<span id="count"></span><div id="notes"></div></header>
<main id="list"></main>
<script type="application/json" id="rows">{_json_in_html(data)}</script>
<script>{SCRIPT}</script>
</body></html>
"""


def write_html(settings: list[Setting], path: Path) -> None:
    """Write ``report.html`` (atomically); what it could not show is said on the page and here."""
    data = page_rows(settings)
    for note in data["notes"]:
        print(f"report: report.html: {visible(note, keep='')}", file=sys.stderr)
    write_atomic(path, render_html(settings, data))
