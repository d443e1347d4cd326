"""`mlbench infer`: prep records -> n sampled responses per prompt -> the generations file eval/ scores.

Output per task, ``OUT/task{t}.jsonl``, one line per prompt, appended as each batch finishes (a killed run
resumes with the prompts not yet written):
``{"github_id", "id", "task", "output": [n code strings], "raw": [n responses], "n_tokens", "prompt_sha",
"model", "adapter", "backend", "sampling"}``. ``OUT/infer.json`` holds the settings; a different run
cannot be resumed into the same folder.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from mlbench_kit.config import rename_old_keys, save_resolved
from mlbench_kit.engine import reply_fault
from mlbench_kit.errors import MLBenchError
from mlbench_kit.escape import visible
from mlbench_kit.flags import resolve
from mlbench_kit.hf import (
    TRAIN_META,
    check_model_available,
    load_tokenizer,
    model_positions,
)
from mlbench_kit.infer_config import Dtype, InferConfig, Sampling
from mlbench_kit.io import AppendLog, claim_run_folder, read_jsonl_tolerant
from mlbench_kit.parse import parse_response
from mlbench_kit.progress import Console, Progress, logs_to_file
from mlbench_kit.records import GenerationRecord
from mlbench_kit.stages import stage

from .adapters import (
    adapter_config,
    adapter_identity,
    check_base,
    engine_lora_rank,
    model_identity,
)
from .backends import Backend, Completion
from .prompts import PromptItem, encode, evaluation_split, load_prompts, task_file

ENGINE_LOG = "logs/engine.log"  # under --out: vLLM's / transformers' own output unless --verbose


def _load_tokenizer(name: str, backend: str, flag: str) -> Any:
    try:
        return load_tokenizer(name, flag, fast=False)
    except MLBenchError:
        if backend == "openai":
            return None  # an API model: prompts go as text
        raise


def context_length(cfg: InferConfig, longest: int, positions: int | None) -> int:
    """vLLM's ``max_model_len`` (prompt + new tokens per sequence): the configured one, else the longest prompt +
    max_new_tokens; never above the model's positions (vLLM refuses more, e.g. for Llama-2's 4,096)."""
    if cfg.max_model_len and positions and cfg.max_model_len > positions:
        raise MLBenchError(f"max_model_len {cfg.max_model_len} is above the model's {positions} positions",
                           "--max-model-len", f"use at most {positions}")
    want = cfg.max_model_len or longest + cfg.sampling.max_new_tokens
    return min(want, positions) if positions else want


def check_lengths(items: list[PromptItem], cfg: InferConfig, max_model_len: int) -> None:
    """A prompt that leaves no room for the answer is an error, named by its prep record."""
    new = cfg.sampling.max_new_tokens
    room = max_model_len - new
    long = [it for it in items if len(it.token_ids) > room]
    if long:
        it = max(long, key=lambda x: len(x.token_ids))
        raise MLBenchError(f"{len(long)} prompts are longer than the context {max_model_len} - max_new_tokens "
                           f"{new} (longest: {len(it.token_ids)} tokens)", it.where,
                           f"re-run `mlbench prep --max-new-tokens {new}` with this model's tokenizer (it cuts the "
                           "README context to leave that room), or lower --max-new-tokens")


def engine_dtype(cfg: InferConfig, adapters: list[str]) -> Dtype:
    """auto: the precision the adapters were trained in (bf16 stays bf16: vLLM's own auto serves Llama-2 in fp16),
    else the model config's. One engine has one dtype, so adapters trained in different precisions need
    ``--dtype``."""
    if cfg.dtype != "auto" or not adapters:
        return cfg.dtype
    import json
    found: dict[str, Dtype] = {}
    for adapter in adapters:
        meta = Path(adapter) / TRAIN_META
        precision = json.loads(meta.read_text()).get("precision") if meta.is_file() else ""
        found[adapter] = "bfloat16" if precision == "bf16" else "float16" if precision == "fp16" else "auto"
    if len(set(found.values())) > 1:
        listed = ", ".join(f"{a}: {d}" for a, d in found.items())
        raise MLBenchError(f"the adapters were trained in different precisions ({listed}); one engine serves them "
                           "all in one dtype", "--adapters", "pass --dtype bfloat16 (or float16), or run them apart")
    return next(iter(found.values()))


def make_backend(cfg: InferConfig, tokenizer: Any, max_model_len: int,
                 adapters: dict[str, str]) -> Backend:
    """The engine, with every adapter it has to serve loaded once."""
    model = str(cfg.model)
    if cfg.backend == "vllm":
        from .backends import VllmBackend
        rank = None
        if adapters:
            ranks = [int(adapter_config(a)["r"]) for a in adapters.values()]
            rank = engine_lora_rank(max(ranks), cfg.max_lora_rank, next(iter(adapters.values())))
        return VllmBackend(model, cfg, max_model_len, adapters, rank, cfg.tokenizer)
    if cfg.backend == "hf":
        from .backends import HfBackend
        return HfBackend(model, cfg, adapters, tokenizer)
    from .openai_backend import OpenAIBackend
    if adapters:
        raise MLBenchError("the openai backend cannot load an adapter itself", "--adapter",
                           "serve it (`vllm serve BASE --enable-lora --lora-modules NAME=DIR`) and pass --model NAME")
    return OpenAIBackend(model, cfg, send_token_ids=tokenizer is not None)


def targets(cfg: InferConfig) -> list[tuple[str | None, str | None, Path]]:
    """What to generate for: ``(adapter name, adapter folder, output folder)``; the base model has no adapter."""
    out = Path(str(cfg.out))
    if not cfg.adapters:
        if cfg.with_base:
            raise MLBenchError("--with-base goes with --adapters", "--with-base")
        return [("adapter" if cfg.adapter else None, cfg.adapter, out)]
    if cfg.adapter:
        raise MLBenchError("pass either --adapter DIR or --adapters NAME=DIR ...", "--adapter")
    found: list[tuple[str | None, str | None, Path]] = []
    for spec in cfg.adapters:
        name, eq, path = spec.partition("=")
        if not eq or not name or not name.replace("-", "").replace("_", "").isalnum() or name == "base":
            raise MLBenchError(f"--adapters takes NAME=DIR (NAME: letters, digits, - and _; not 'base'), got {spec!r}",
                               "--adapters")
        found.append((name, path, out / name))
    if len({n for n, _, _ in found}) != len(found):
        raise MLBenchError("adapter names must differ", "--adapters")
    base: list[tuple[str | None, str | None, Path]] = [(None, None, out / "base")] if cfg.with_base else []
    return base + found


def run(args: argparse.Namespace) -> int:
    """Run the infer stage; returns the exit status. The terminal gets one line per step and a progress line; the
    engine's and libraries' own output goes to ``OUT/logs/engine.log`` (``--verbose``: to the terminal)."""
    return infer(resolve(stage("infer"), args), args.config)


def infer(cfg: InferConfig, source: str | None = None) -> int:
    """The infer stage's entry on a resolved config (``mlbench infer``, ``mlbench run``); ``source`` names the
    config file in the error a config without inputs gets. Returns the exit status."""
    cfg.require_inputs(source)
    todo_targets = targets(cfg)
    log = None if cfg.verbose else Path(str(cfg.out)) / ENGINE_LOG
    with logs_to_file(log, "infer") as con:
        if log is not None:
            con.say(f"infer: engine and library logs in {log} (--verbose shows them here)")
        return _run(cfg, todo_targets, con)


def _run(cfg: InferConfig, todo_targets: list[tuple[str | None, str | None, Path]],
         con: Console) -> int:
    model_name, prompts = str(cfg.model), str(cfg.prompts)  # both given (require_inputs)
    adapters = {name: path for name, path, _ in todo_targets if name is not None and path}
    for adapter_dir in adapters.values():
        adapter_config(adapter_dir)
        check_base(model_name, adapter_dir, cfg.allow_base_mismatch)
    if cfg.backend != "openai":  # an API model is a served name, not something to load here
        check_model_available(model_name, "--model")
        if cfg.tokenizer:
            check_model_available(cfg.tokenizer, "--tokenizer")
    tokenizer = _load_tokenizer(cfg.tokenizer or model_name, cfg.backend,
                                "--tokenizer" if cfg.tokenizer else "--model")
    split = evaluation_split(prompts, cfg.split)
    if split != cfg.split:
        con.say(f"infer: {prompts} has no split {cfg.split!r} (a --build-splits prep): reading its {split!r}")
        cfg.split = split
    tasks: dict[int, list[PromptItem]] = {}
    for t in cfg.tasks:
        items = load_prompts(task_file(prompts, cfg.split, t), t)[: cfg.limit]
        tasks[t] = encode(items, tokenizer) if tokenizer is not None else items
    longest = max((len(it.token_ids) for items in tasks.values() for it in items), default=0)
    max_model_len = context_length(cfg, longest, model_positions(model_name) if cfg.backend != "openai" else None)
    cfg.dtype = engine_dtype(cfg, list(adapters.values()))
    if tokenizer is not None:
        for items in tasks.values():
            check_lengths(items, cfg, max_model_len)
    plan = []
    model, sampling = model_identity(model_name), cfg.to_dict()["sampling"]
    for name, path, out in todo_targets:
        ident = {"model": model, "adapter": adapter_identity(path) if path else None, "backend": cfg.backend,
                 "sampling": sampling, "parser": cfg.parser}
        # a folder written before sampling.max_tokens became max_new_tokens resumes: its record is read renamed
        claim_run_folder(out / "infer.json", {**ident, "prompts": str(Path(prompts).resolve()),
                                              "split": cfg.split},
                         upgrade=lambda old: rename_old_keys(Sampling, old.get("sampling")))
        label = f"{name or 'base'}: " if len(todo_targets) > 1 else ""
        for t, items in tasks.items():
            done = {(r["github_id"], r["id"]) for r in read_jsonl_tolerant(out / f"task{t}.jsonl")}
            todo = [it for it in items if it.key not in done]
            con.say(f"infer: {label}task {t}: {len(items)} prompts, {len(items) - len(todo)} already written")
            if todo:
                plan.append((name if path else None, ident, todo, out / f"task{t}.jsonl", f"{label}task {t}"))
    # the resolved options beside the outputs: `mlbench infer --config OUT/config.yaml` replays (resumes) the run
    save_resolved(cfg, Path(str(cfg.out)) / "config.yaml")
    if not plan:
        con.say(f"infer: nothing to do; generations in {cfg.out}")
        return 0
    t0 = time.monotonic()
    if cfg.backend != "openai":
        what = f"{len(adapters)} adapter{'s' * (len(adapters) != 1)}" if adapters else "no adapter"
        con.say(f"infer: starting the {cfg.backend} engine: {cfg.model}, {what}")
    backend = make_backend(cfg, tokenizer, max_model_len, adapters)
    if cfg.backend != "openai":
        con.say(f"infer: engine ready in {time.monotonic() - t0:.0f} s")
    try:
        calls = generate_plan(backend, plan, cfg, con.stream)
    finally:
        backend.close()
    n = sum(len(p[2]) for p in plan)
    con.say(f"infer: {n} prompts of {len(plan)} target/task pairs in {calls} engine call{'s' * (calls != 1)}; "
            f"generations in {cfg.out} (score with `mlbench eval --generations`)")
    return 0


def generate_plan(backend: Backend, plan: list[tuple], cfg: InferConfig, stream: Any = None) -> int:
    """Every prompt of every (adapter, task) entry of ``plan`` through the engine in as few calls as
    ``batch_size`` allows: one for all of them by default. vLLM then schedules the base model's and every
    adapter's prompts together (a ``LoRARequest`` per prompt) instead of draining the engine at the end of each
    of, say, 9 calls (3 tasks x base, ID and OOD). Backends that cannot mix adapters in one call get one call per
    adapter in each chunk, all tasks together. Each chunk's lines are appended to their files when it finishes (a
    killed run resumes). Per-prompt seeds make the samples the same either way. Progress goes to ``stream``
    (default stderr): a bar on a terminal, else a line every 30 s. Returns the number of calls."""
    work = [(k, it) for k, entry in enumerate(plan) for it in entry[2]]
    mixed = getattr(backend, "generate_mixed", None) if getattr(backend, "mixes_adapters", False) else None
    if mixed is None:  # one adapter per call: keep each adapter's prompts together, whatever the batch size
        first = {a: i for i, a in reversed(list(enumerate(e[0] for e in plan)))}
        work.sort(key=lambda w: first[plan[w[0]][0]])
    calls, n_tok, t0 = 0, 0, time.perf_counter()
    bar = Progress(len(work), "infer", "prompt", stream=stream)
    logs = [AppendLog(entry[3]) for entry in plan]
    try:
        for start in range(0, len(work), cfg.batch_size):
            chunk = work[start: start + cfg.batch_size]
            if mixed is not None:
                outs = mixed([it for _, it in chunk], [plan[k][0] for k, _ in chunk])
                calls += 1
            else:
                outs = [None] * len(chunk)
                for adapter in dict.fromkeys(plan[k][0] for k, _ in chunk):
                    idx = [i for i, (k, _) in enumerate(chunk) if plan[k][0] == adapter]
                    for i, comps in zip(idx, backend.generate([chunk[i][1] for i in idx], adapter), strict=True):
                        outs[i] = comps
                    calls += 1
            for (k, it), comps in zip(chunk, outs, strict=True):
                logs[k].append(_record(it, comps, plan[k][1], cfg).to_json())
                n_tok += sum(c.n_tokens for c in comps)
            bar.update(len(chunk), f"{n_tok / max(time.perf_counter() - t0, 1e-9):.0f} tok/s")
    finally:
        for log in logs:
            log.close()
        bar.close()
    return calls


def _record(it: PromptItem, comps: list, ident: dict[str, Any], cfg: InferConfig) -> GenerationRecord:
    """A prompt's line; any engine's replies are checked first (:func:`reply_fault`): a bad one is an empty sample
    with its reason in ``errors``, said on the terminal, and the run goes on."""
    errors = [c.error or reply_fault(c.text, c.n_tokens, cfg.sampling.max_new_tokens) for c in comps]
    comps = [Completion("", 0) if e else c for c, e in zip(comps, errors, strict=True)]
    for k, e in enumerate(errors):
        if e:
            print(f"infer: {it.github_id}/{it.id} sample {k}: the engine's reply was refused: {visible(e)}",
                  file=sys.stderr)
    raw = [c.text for c in comps]
    return GenerationRecord(it.github_id, it.id, [parse_response(r, cfg.parser) for r in raw], task=it.task, raw=raw,
                            n_tokens=[c.n_tokens for c in comps], prompt_sha=it.sha, model=ident["model"]["name"],
                            adapter=ident["adapter"]["name"] if ident["adapter"] else None,
                            backend=ident["backend"], sampling=ident["sampling"],
                            errors=[e or None for e in errors] if any(errors) else None)
