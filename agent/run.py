"""`mlbench agent`: k ML-Agent episodes per row -> the generations file `mlbench eval` scores, plus transcripts.

Writes into ``OUT``:

- ``generations.jsonl``: one line per row once its k episodes have ended, in the format infer writes
  (``{"github_id", "id", "output": [k answers], "raw", "n_tokens", "model", "adapter", "backend", "sampling"}``)
  plus ``"agent"``: the policy, each episode's exit status, turns, tokens and generation time. An episode without
  an answer gives ``""`` (no row has empty ``arguments``, so eval fails it: it keeps its place in Pass@k).
- ``transcripts/<github_id>-<id>/ep<k>.jsonl``: one line per turn (flushed when the turn ends), then one ``end``
  line with the exit status.
- ``summary.json``: exit counts, answers, mean turns, tokens and generation time per episode.
- ``agent.json``: the settings; a folder made with other settings is refused. A killed run re-run with the same
  command replays each transcript (checking every prompt's hash) and goes on from the last complete turn.

Lockstep: at each round every live episode's next prompt goes into one engine call.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from mlbench_kit import tree
from mlbench_kit.agent_config import AgentConfig
from mlbench_kit.config import save_resolved
from mlbench_kit.dataset import Sample, load_samples
from mlbench_kit.engine import (
    Endpoint,
    Engine,
    EngineSpec,
    GenParams,
    GenRequest,
    adapter_config,
    adapter_targets,
    backend,
    context_length,
    reply_fault,
    serving_dtype,
)
from mlbench_kit.engine import make_engine as build_engine
from mlbench_kit.envspec import EnvConfig
from mlbench_kit.errors import MLBenchError
from mlbench_kit.escape import visible
from mlbench_kit.flags import resolve
from mlbench_kit.io import AppendLog, claim_run_folder, read_jsonl, read_jsonl_tolerant, write_json_atomic
from mlbench_kit.progress import Progress
from mlbench_kit.sandbox import LayerCaps, Sandbox, check_backend
from mlbench_kit.stages import stage
from mlbench_kit.untar import safe_extract

from .bash import BashEpisode
from .episode import BaseEpisode, Encoder, Episode
from .prompts import render_prompt
from .repo import RepoView


def _identity(path: str | None) -> dict[str, Any] | None:
    """A model or adapter folder named by its path and a digest of its small files (config, adapter weights)."""
    if path is None:
        return None
    p = Path(path)
    if not p.is_dir():
        return {"name": path}
    h = hashlib.sha256()
    for f in sorted(p.iterdir()):
        if f.is_file() and f.suffix in (".json", ".safetensors") and f.stat().st_size < 512 * 2**20:
            h.update(f.name.encode() + f.read_bytes())
    return {"name": str(p.resolve()), "sha": h.hexdigest()[:16]}


def checkouts(cfg: AgentConfig, repos: set[str], out: Path) -> dict[str, Path]:
    """One pristine checkout per repository: from --repos-dir, or unpacked once from --tarballs by the core's
    checked extractor (:func:`mlbench_kit.untar.safe_extract`: nothing outside the folder, bounded)."""
    found = {}
    for name in sorted(repos):
        if cfg.repos_dir:
            d = Path(cfg.repos_dir) / name
            if not d.is_dir():
                raise MLBenchError(f"no checkout of {name}", str(d), "pass --repos-dir holding <repo>/ folders")
        else:
            d = out / "checkouts" / name
            if not d.is_dir():
                tar = Path(str(cfg.tarballs)) / f"{name}.tar.gz"
                if not tar.is_file():
                    raise MLBenchError(f"no checkout tarball for {name}", str(tar),
                                       "pass --tarballs DIR holding <repo>.tar.gz")
                unpack = out / "checkouts" / f".{name}.unpack"
                tree.remove(unpack)
                # untrusted data: every member checked before anything is written (tarfile's filter is not
                # relied on: Python 3.11.7 lacks the CVE-2025-4517 fix), bounded in bytes and members
                safe_extract(tar, unpack, under=name)
                if not (unpack / name).is_dir():
                    raise MLBenchError(f"{tar.name} has no top folder {name}/", str(tar))
                (unpack / name).rename(d)  # whole or not at all: a killed unpack is redone
                tree.remove(unpack)
        found[name] = d
    return found


def select_rows(cfg: AgentConfig) -> list[Sample]:
    """The rows the run works on: --data's split, then --repos, --rows-of and --limit."""
    rows = load_samples(str(cfg.data), cfg.split)
    if cfg.repos:
        unknown = set(cfg.repos) - {s.repo for s in rows}
        if unknown:
            raise MLBenchError(f"no rows of {sorted(unknown)}", "--repos", f"repositories: "
                               f"{sorted({s.repo for s in rows})}")
        rows = [s for s in rows if s.repo in cfg.repos]
    if cfg.rows_of:
        keys = rows_named(cfg.rows_of)
        absent = keys - {s.key for s in rows}
        if absent:
            raise MLBenchError(f"{len(absent)} rows named here are not in --data (first: {sorted(absent)[:3]})",
                               str(cfg.rows_of), "name rows of the same data (github_id, id)")
        rows = [s for s in rows if s.key in keys]
    return rows[: cfg.limit] if cfg.limit else rows


def rows_named(path: str | Path) -> set[tuple[int, int]]:
    """The (github_id, id) keys of a JSONL file's lines (bounded: at most 64 MiB); a line without both, or a
    line that is not JSON, is an error at file:line. Lines end at "\n" only: a prep record holds U+2028 and the
    like raw (``str.splitlines()`` split it there, and refused the file at a line that was no line)."""
    p = Path(path)
    if not p.is_file():
        raise MLBenchError("no such file", str(p), "pass a JSONL file of rows (github_id, id) to --rows-of")
    if p.stat().st_size > 64 * 2**20:
        raise MLBenchError("over 64 MiB", str(p), "pass a JSONL file of rows (github_id, id) to --rows-of")
    keys = set()
    for i, rec in read_jsonl(p, errors="replace"):
        try:
            keys.add((int(rec["github_id"]), int(rec["id"])))
        except (ValueError, KeyError, TypeError, OverflowError):
            raise MLBenchError("not a JSON object with github_id and id", f"{p}:{i}",
                               "pass a JSONL file of rows (github_id, id) to --rows-of") from None
    return keys


def make_encoder(tokenizer: Any, template: str) -> tuple[Any, str]:
    """Prompt text -> token ids: the model's chat template (a user turn) when it has one (``auto``), else the
    text with the tokenizer's specials (BOS), as prep's plain templates are encoded."""
    from mlbench_kit.hf import prompt_ids
    chat = template == "chat" or (template == "auto" and bool(getattr(tokenizer, "chat_template", None)))
    if template == "chat" and not getattr(tokenizer, "chat_template", None):
        raise MLBenchError("template: chat, but this model's tokenizer has no chat template", "template")

    def encode(text: str | list[dict[str, str]]) -> list[int]:
        """One prompt text (a user turn), or a conversation (the bash policy's user/assistant messages)."""
        return prompt_ids(tokenizer, render_prompt(tokenizer, text, chat), "chat" if chat else "plain")
    return encode, "chat" if chat else "plain"


def engine_spec(cfg: AgentConfig, max_model_len: int, adapters: dict[str, str] | None = None) -> EngineSpec:
    """What the agent's engine is built from: ``adapters`` (engine name -> folder; default: ``cfg.adapter``, if any,
    under the name ``adapter``) loaded once, in the precision they were trained in (infer's rule)."""
    o = cfg.openai
    if adapters is None:
        adapters = {"adapter": cfg.adapter} if cfg.adapter else {}
    dtype = serving_dtype("auto", list(adapters.values()), "--adapter") if backend(cfg.backend).adapter_folders \
        else "auto"
    return EngineSpec(cfg.backend, str(cfg.model), cfg.tokenizer, max_model_len, cfg.sampling.seed, adapters,
                      dtype=dtype, gpu_memory_utilization=cfg.gpu_memory_utilization, enforce_eager=cfg.enforce_eager,
                      endpoint=Endpoint(o.base_url, o.api, o.api_key_env, o.max_retries, 0, o.concurrency,
                                        o.timeout_s))


def make_engine(cfg: AgentConfig, tokenizer: Any, max_model_len: int,
                adapters: dict[str, str] | None = None) -> Engine:
    """The engine of ``cfg.backend`` (:func:`engine_spec`)."""
    return build_engine(engine_spec(cfg, max_model_len, adapters), tokenizer)


def run(args: argparse.Namespace) -> int:
    """The `mlbench agent` command."""
    from mlbench_kit.hf import check_model_available, load_tokenizer, model_positions
    cfg = resolve(stage("agent"), args)
    cfg.require_inputs(args.config)
    model = str(cfg.model)
    local = backend(cfg.backend).local
    if not local:  # a served name: the prompts' tokens and the context come from --tokenizer's folder
        if not cfg.tokenizer:
            raise MLBenchError(f"backend {cfg.backend} needs --tokenizer (the served model's tokenizer folder): "
                               "prompts are sent as token ids (openai.api: chat: counted with it)", "--tokenizer",
                               "pass the model's folder, e.g. --tokenizer DIR")
        check_model_available(cfg.tokenizer, "--tokenizer")
    else:
        check_model_available(model, "--model")
    tokenizer = load_tokenizer(cfg.tokenizer or model, "--tokenizer" if cfg.tokenizer else "--model",
                               fast=False)
    positions = model_positions(model if local else str(cfg.tokenizer))
    max_model_len = context_length(cfg.max_model_len, positions, positions or 4096, "max_model_len")
    rows = select_rows(cfg)
    out = Path(str(cfg.out))
    # one engine for every adapter (--adapters NAME=DIR ...), each adapter's episodes in a run folder of its own
    # that is the same as a single --adapter run's (its config.yaml replays that run alone)
    variants = [(name, replace(cfg, adapter=path, adapters=[], with_base=False, out=str(v_out)))
                for name, path, v_out in adapter_targets(cfg.adapter, cfg.adapters, cfg.with_base, out)]
    if local:
        for _, vcfg in variants:
            if vcfg.adapter:
                adapter_config(vcfg.adapter)  # a folder train/ wrote, before any run folder is made
    out.mkdir(parents=True, exist_ok=True)
    encode, template = make_encoder(tokenizer, cfg.template)
    if cfg.gold_episodes:  # training data: each row's correct episode through the same episode code; no engine
        from .gold import write_gold_episodes
        save_resolved(cfg, out / "config.yaml")
        repos = checkouts(cfg, {s.repo for s in rows}, out)
        box = sandbox_for(cfg, rows, repos) if cfg.policy == "bash" else None
        try:
            write_gold_episodes(cfg, rows, repos, tokenizer, encode, template, max_model_len, out, box)
        finally:
            if box is not None:
                box[0].close()
        return 0
    pool_urls: dict[str, str] | None = None
    if cfg.steps == "1-4":  # step 2's candidates: every repository of the data (the 14 of the test set)
        pool_urls = {}
        for s in load_samples(str(cfg.data), cfg.split):
            pool_urls.setdefault(s.repo, s.github or s.repo)
    for _, vcfg in variants:
        settings = {"config": vcfg.settings(), "config_sha": vcfg.sha(), "model": _identity(model),
                    "adapter": _identity(vcfg.adapter), "template": template, "max_model_len": max_model_len,
                    "data": str(cfg.data), "split": cfg.split, "rows": [list(s.key) for s in rows]}
        if cfg.policy == "bash":
            settings["envs"] = str(Path(cfg.envs).resolve()) if cfg.envs else None
        if pool_urls is not None:
            settings["candidates"] = sorted(pool_urls)
        v_out = Path(str(vcfg.out))
        v_out.mkdir(parents=True, exist_ok=True)
        claim_run_folder(v_out / "agent.json", settings)
        save_resolved(vcfg, v_out / "config.yaml")  # `mlbench agent --config OUT/config.yaml` replays (resumes) it
    repos = checkouts(cfg, {s.repo for s in rows} | set(pool_urls or ()), out)
    engines: list[Engine] = []

    def engine() -> Engine:
        if not engines:
            engines.append(make_engine(cfg, tokenizer, max_model_len,
                                       {name: str(v.adapter) for name, v in variants if name and v.adapter}))
        return engines[0]
    box = None
    try:
        if cfg.policy == "bash":
            box = sandbox_for(cfg, rows, repos)
        for name, vcfg in variants:
            v_out = Path(str(vcfg.out))
            stats = run_episodes(vcfg, rows, repos, engine, encode, max_model_len, v_out,
                                 ident={"model": model, "adapter": vcfg.adapter, "backend": cfg.backend}, box=box,
                                 pool_urls=pool_urls, lora=name)
            summary = json.loads((v_out / "summary.json").read_text())
            print(f"agent: {summary['rows']} rows x {cfg.episodes} episodes ({stats['rows']} this time, "
                  f"{stats['rounds']} lockstep rounds); exits {summary['exits']}; mean turns {summary['mean_turns']}, "
                  f"new tokens {summary['mean_tokens_out']}; generations in {v_out / 'generations.jsonl'} (score with "
                  "`mlbench eval --generations`)", file=sys.stderr)
    finally:
        for e in engines:
            e.close()
        if box is not None:
            box[0].close()
    return 0


def sandbox_for(cfg: AgentConfig, rows: list[Sample], repos: dict[str, Path]) -> tuple[Sandbox, EnvConfig]:
    """The bash policy's sandbox and the rows' environments (``--envs``, resolved as eval resolves them), each
    environment probed once inside the sandbox before any episode starts."""
    if cfg.bash.sandbox not in ("bwrap", "podman", "docker"):
        raise MLBenchError(f"bash.sandbox {cfg.bash.sandbox!r} cannot keep files between actions", "bash.sandbox",
                           "use bwrap, docker, or podman as root")
    check_backend(cfg.bash.sandbox, unsafe_local=False)
    repos_dir = cfg.repos_dir or (next(iter(repos.values())).parent if repos else None)
    envs = EnvConfig(cfg.envs, repos_dir)
    box = Sandbox(cfg.bash.sandbox)
    try:
        if not box.layers_ok:
            raise MLBenchError(f"the {cfg.bash.sandbox} sandbox cannot keep files between actions here",
                               "bash.sandbox", "use bwrap or docker (podman keeps them only as root)")
        for name in sorted(repos):
            box.preflight(envs.for_repo(name), sorted({s.path for s in rows if s.repo == name}))
    except BaseException:
        box.close()
        raise
    return box, envs


def new_episode(cfg: AgentConfig, sample: Sample, k: int, encode: Encoder, max_model_len: int,
                views: dict[str, RepoView], pool: dict[str, tuple[RepoView, str, str]] | None,
                box: tuple[Sandbox, EnvConfig] | None) -> BaseEpisode:
    """Episode ``k`` of ``sample`` under ``cfg.policy``: the one place that knows which policies there are."""
    if cfg.policy == "bash":
        if box is None:
            raise MLBenchError("the bash policy needs a sandbox", "policy", "pass box= (see sandbox_for)")
        return BashEpisode(sample, box[1].for_repo(sample.repo), box[0], cfg, k, encode, max_model_len)
    return Episode(sample, views[sample.repo], cfg, k, encode, max_model_len, pool=pool)


def run_episodes(cfg: AgentConfig, rows: list[Sample], repos: dict[str, Path], engine: Any, encode: Encoder,
                 max_model_len: int, out: Path, ident: dict[str, Any],
                 box: tuple[Sandbox, EnvConfig] | None = None,
                 pool_urls: dict[str, str] | None = None, lora: str | None = None) -> dict[str, Any]:
    """Every row's k episodes in lockstep rounds (``engine`` is a callable giving the engine, made on first use,
    so a finished run starts none). ``box``: the bash policy's sandbox and environments; ``pool_urls``: steps
    1-4's candidate repositories (name -> URL; default: every repository of ``repos`` by name); ``lora``: the
    engine's name of the adapter (default ``adapter`` when ``ident`` names one). Returns counts for the summary
    line."""
    gens_path = out / "generations.jsonl"
    done = {(int(r["github_id"]), int(r["id"])) for r in read_jsonl_tolerant(gens_path)}
    views = {name: RepoView(path, name, cfg.read.max_file_bytes) for name, path in repos.items()}
    pool = None
    if cfg.steps == "1-4":
        urls = pool_urls or {name: name for name in repos}
        pool = {name: (views[name], urls[name], views[name].description()) for name in sorted(urls)}
    if box is not None:  # the bounds on the episodes' layers together are the run's
        b = cfg.bash
        box[0].layer_caps = LayerCaps(b.layer_entries, b.layers_mb, b.layers_entries)
    live: list[tuple[BaseEpisode, Path, bool]] = []  # episode, transcript path, whether its end line is written
    by_row: dict[tuple[int, int], list[BaseEpisode]] = {}
    for s in rows:
        if s.key in done:
            continue
        for k in range(cfg.episodes):
            ep = new_episode(cfg, s, k, encode, max_model_len, views, pool, box)
            path = out / "transcripts" / f"{s.github_id}-{s.id}" / f"ep{k}.jsonl"
            ended = ep.resume(path) if path.exists() else False
            by_row.setdefault(s.key, []).append(ep)
            live.append((ep, path, ended))
    logs: dict[Path, AppendLog] = {}
    gens = AppendLog(gens_path)
    params = GenParams(temperature=cfg.sampling.temperature, top_p=cfg.sampling.top_p, top_k=cfg.sampling.top_k,
                       max_new_tokens=cfg.sampling.max_new_tokens)  # n = 1: one completion per turn
    adapter = lora or ("adapter" if ident.get("adapter") else None)
    rounds = turns = 0
    written: set[tuple[int, int]] = set()
    # infer's and eval's progress: a bar on a terminal, else a line every 30 s (episodes ended of those to run)
    bar = Progress(sum(not e for _, _, e in live), "agent", "episode")
    try:
        while True:
            todo = []
            for ep, path, _ in live:
                p = ep.prepare()
                if p is not None:
                    todo.append((ep, path, p))
            was = sum(e for _, _, e in live)
            _finish(live, by_row, written, logs, gens, ident, cfg)
            bar.update(sum(e for _, _, e in live) - was, f"round {rounds}, {turns} turns, {len(written)} rows written")
            if not todo:
                break
            t0 = time.perf_counter()
            requests = [GenRequest(tuple(p.ids), p.seed, adapter, p.max_new_tokens, text=p.text,
                                   messages=tuple(p.messages or [{"role": "user", "content": p.text}]),
                                   json_schema=p.json_schema, tools=p.tools, tool_choice=p.tool_choice)
                        for _, _, p in todo]
            outs = [samples[0] for samples in engine().generate(requests, params)]
            wall = time.perf_counter() - t0
            rounds += 1
            for (ep, path, _), req, g in zip(todo, requests, outs, strict=True):
                # any engine's reply is checked before it is a turn: a bad one ends its episode as a fault
                why = g.fault or reply_fault(g.text, g.n_tokens, req.cap(params))
                if why is not None:
                    ep.fault(f"the engine's reply was refused: {visible(why)}")
                    continue
                # the turn's share of the call: a batch of 100 turns in 100 s gives each 1 s (the time limit
                # counts shares, so lockstep batches do not make each episode "take" the whole call)
                # the calls go only to a turn that offered tools: a policy without any keeps feed's four arguments
                calls = {"tool_calls": g.tool_calls, "prompt_tokens": g.prompt_tokens} \
                    if req.tool_choice is not None else {}
                rec = ep.feed(g.text, g.n_tokens, wall / len(todo), g.truncated, **calls)
                rec["call_s"], rec["call_size"] = round(wall, 4), len(todo)
                _log(logs, path).append(rec)
                turns += 1
    finally:
        bar.close()
        gens.close()
        for log in logs.values():
            log.close()
        for ep, _, _ in live:
            ep.discard()
    exits: dict[str, int] = {}
    for eps in by_row.values():
        for ep in eps:
            exits[str(ep.exit)] = exits.get(str(ep.exit), 0) + 1
    write_json_atomic(out / "summary.json", summarize(gens_path, cfg))
    return {"rows": len(by_row), "exits": exits, "rounds": rounds}


def summarize(gens_path: Path, cfg: AgentConfig) -> dict[str, Any]:
    """The run's episodes at a glance, from ``generations.jsonl`` (every row written so far): exit counts, answers,
    mean turns, tokens and generation time per episode."""
    eps = [e for r in read_jsonl_tolerant(gens_path) for e in r["agent"]["episodes"]]
    n = max(len(eps), 1)
    exits: dict[str, int] = {}
    for e in eps:
        exits[e["exit"]] = exits.get(e["exit"], 0) + 1
    extra: dict[str, Any] = {}
    if cfg.policy == "bash" and cfg.bash.openhands_check:
        # OpenHands' rule: one attempt per episode; a fault is no verdict (left out, and counted apart)
        faults = sum(e["exit"] == "fault" or bool((e.get("openhands") or {}).get("fault")) for e in eps)
        passed = sum(bool((e.get("openhands") or {}).get("passed")) for e in eps)
        scored = len(eps) - faults
        extra["openhands"] = {"rule": "openhands: timeout 120 bash run.sh in the task folder of the episode's own "
                                      "files; exit 0 or 124, or KeyboardInterrupt printed",
                              "passed": passed, "scored": scored, "faults": faults,
                              "success_rate": round(passed / scored, 4) if scored else None}
    return {**extra, "policy": cfg.policy, "steps": cfg.steps, "config_sha": cfg.sha(), "episodes": len(eps),
            "rows": len(read_jsonl_tolerant(gens_path)), "exits": dict(sorted(exits.items())),
            "answered": sum(e["answer"] is not None for e in eps),
            "mean_turns": round(sum(e["turns"] for e in eps) / n, 3),
            "mean_tokens_in": round(sum(e["tokens_in"] for e in eps) / n, 1),
            "mean_tokens_out": round(sum(e["tokens_out"] for e in eps) / n, 1),
            "mean_seconds": round(sum(e["seconds"] for e in eps) / n, 3)}


def _log(logs: dict[Path, AppendLog], path: Path) -> AppendLog:
    if path not in logs:
        logs[path] = AppendLog(path)
    return logs[path]


def _finish(live: list[tuple[BaseEpisode, Path, bool]], by_row: dict[tuple[int, int], list[BaseEpisode]],
            written: set[tuple[int, int]], logs: dict[Path, AppendLog], gens: AppendLog, ident: dict[str, Any],
            cfg: AgentConfig) -> None:
    """Write the end line of every episode that has ended, and the generations line of every row whose k
    episodes have all ended."""
    for i, (ep, path, ended) in enumerate(live):
        if ep.exit is not None and not ended:
            _log(logs, path).append({"end": ep.summary()})
            live[i] = (ep, path, True)
    for key, eps in by_row.items():
        if key not in written and all(e.exit is not None for e in eps):
            gens.append(generation_line(key, eps, ident, cfg))
            written.add(key)


def generation_line(key: tuple[int, int], eps: list[BaseEpisode], ident: dict[str, Any],
                    cfg: AgentConfig) -> dict[str, Any]:
    """A row's line of ``generations.jsonl`` once its k episodes have ended: infer's format plus ``agent``."""
    return {"github_id": key[0], "id": key[1], "output": [ep.answer or "" for ep in eps],
            "raw": [ep.turns[-1]["raw"] if ep.turns else "" for ep in eps],
            "n_tokens": [ep.tokens_out for ep in eps], "model": ident["model"], "adapter": ident.get("adapter"),
            "backend": ident["backend"], "sampling": {**cfg.to_dict()["sampling"], "n": cfg.episodes},
            "agent": {"policy": cfg.policy, "steps": cfg.steps, "config_sha": cfg.sha(),
                      "episodes": [ep.summary() for ep in eps]}}
