"""`mlbench agent` end to end through its command line, the model a scripted OpenAI-compatible server on loopback
(the openai backend: prompts go as token ids, so the server reads each prompt back with the run's tokenizer): the
run writes its resolved config, `--config OUT/config.yaml` replays it, and a run folder made before the inputs
became config keys still resumes."""

from __future__ import annotations

import json
import re
import shutil
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import yaml
from conftest import SAMPLE, run_cli
from test_agent import _rows, _transcripts

from mlbench_kit.agent_config import AgentConfig

# the inputs as paths relative to the checkout (run_cli runs there): a run folder records --data as given
AGENT = ("mlbench", "agent", "--backend", "openai", "--model", "served", "--data", "examples/sample/samples.jsonl",
         "--repos-dir", "examples/sample/repos", "--repos", "toyvision", "--limit", "2", "--episodes", "2",
         "--seed", "3", "--max-turns", "6")
BASE_RUN = Path(__file__).parent / "data" / "base-run"  # made with AGENT by the code before this file (9e8f523)


def policy(prompt: str, seed: int) -> str:
    """Ranks the repository's README, then reads a file or submits by the seed: episodes differ, and a replay must
    reproduce which."""
    if "I will provide you with the name of a GitHub repository" in prompt:
        repo = re.search(r"repo_name: (\S+)", prompt)
        return json.dumps({"task_flag": "Yes", "ranked_readmefiles": [f"{repo[1] if repo else 'x'}/README.md"]}) \
            if seed % 3 else "hm"
    if "Read the code in the following py file" in prompt:
        return '{"args_code": "None"}'
    if seed % 2 and "code_arguments:" not in prompt:
        return '{"flag": "FILE", "file_path": "train_cnn.py", "code": ""}'
    return '{"flag": "CODE", "code": "python train_cnn.py", "finally_code": "python train_cnn.py --epochs 1"}'


class Loopback:
    """An OpenAI endpoint on loopback: ``answer(body)`` gives the bytes of each POST's reply (under a lock)."""

    def __init__(self, answer: Callable[[dict], bytes]) -> None:
        lock = threading.Lock()

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with lock:
                    data = answer(body)
                try:
                    self.send_response(200)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:  # the client stopped reading (a reply over its cap)
                    pass

            def log_message(self, *args) -> None:
                pass

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.http.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()
        self.thread.join()


class Server(Loopback):
    """A loopback OpenAI completions endpoint answering with :func:`policy`; counts the requests it served."""

    def __init__(self, tokenizer) -> None:
        self.requests = 0

        def answer(body: dict) -> bytes:
            self.requests += 1
            reply = policy(tokenizer.decode(body["prompt"]), int(body["seed"]))
            return json.dumps({"id": "x", "object": "text_completion", "created": 0, "model": body["model"],
                               "choices": [{"index": 0, "text": reply, "finish_reason": "stop", "logprobs": None}],
                               "usage": {"prompt_tokens": len(body["prompt"]),
                                         "completion_tokens": len(reply) // 4 + 1,
                                         "total_tokens": len(body["prompt"]) + len(reply) // 4 + 1}}).encode()
        super().__init__(answer)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A byte-level BPE tokenizer (with a chat template) trained on the sample rows."""
    from tiny import build_tokenizer
    rows = [json.loads(x) for x in (SAMPLE / "samples.jsonl").read_text().splitlines()]
    return build_tokenizer([r["instruction"] + "\n" + r["oracle"] for r in rows], tmp_path_factory.mktemp("tok"),
                           vocab_size=400)


@pytest.fixture
def server(tokenizer_dir: Path) -> Iterator[Server]:
    from mlbench_kit.hf import load_tokenizer
    s = Server(load_tokenizer(str(tokenizer_dir)))
    yield s
    s.close()


def _agent(server: Server, tokenizer_dir: Path, *argv) -> None:
    r = run_cli(*AGENT, "--tokenizer", tokenizer_dir, "--set", f"openai.base_url={server.url}", *argv)
    assert r.returncode == 0, r.stderr[-3000:]


def test_a_run_writes_its_config_and_replays_from_it(tmp_path: Path, server: Server, tokenizer_dir: Path):
    a = tmp_path / "a"
    _agent(server, tokenizer_dir, "--out", a)
    served = server.requests
    assert served > 0 and len(_rows(a)) == 2
    cfg = yaml.safe_load((a / "config.yaml").read_text())
    assert {k: cfg[k] for k in ("model", "data", "repos_dir", "repos", "limit", "episodes", "tokenizer", "out")} == {
        "model": "served", "data": "examples/sample/samples.jsonl", "repos_dir": "examples/sample/repos",
        "repos": ["toyvision"], "limit": 2, "episodes": 2, "tokenizer": str(tokenizer_dir), "out": str(a)}
    assert (cfg["sampling"]["seed"], cfg["limits"]["max_turns"], cfg["openai"]["base_url"]) == (3, 6, server.url)
    # the run again from its config alone, into another folder: the same settings, generations and transcripts
    b = tmp_path / "b"
    r = run_cli("mlbench", "agent", "--config", a / "config.yaml", "--out", b)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((b / "agent.json").read_text()) == json.loads((a / "agent.json").read_text())
    assert _rows(b) == _rows(a) and _transcripts(b) == _transcripts(a)
    # and into its own folder: the same run, so it resumes with nothing to redo
    before = (a / "generations.jsonl").read_text()
    served = server.requests
    r = run_cli("mlbench", "agent", "--config", a / "config.yaml")
    assert r.returncode == 0, r.stderr[-3000:]
    assert server.requests == served and (a / "generations.jsonl").read_text() == before


def _yaml(value: object) -> str:
    """A value as ``--set KEY=VALUE`` takes it (YAML)."""
    return yaml.safe_dump(value, default_flow_style=True).strip().removesuffix("...").strip()


def test_a_run_folder_made_before_the_inputs_were_config_keys_resumes(tmp_path: Path, server: Server,
                                                                     tokenizer_dir: Path):
    old = tmp_path / "old"
    shutil.copytree(BASE_RUN, old)
    before = {p.relative_to(old): p.read_bytes() for p in old.rglob("*") if p.is_file()}
    # the command that made it, with the keys added since at what the code did before them (AgentConfig.BEFORE)
    before_keys = [a for k, v in AgentConfig.BEFORE.items() for a in ("--set", f"{k}={_yaml(v)}")]
    _agent(server, tokenizer_dir, "--out", old, *before_keys)
    assert server.requests == 0  # every row was done: nothing replayed, nothing asked
    assert {p: old.joinpath(p).read_bytes() for p in before} == before  # its records untouched
    assert (old / "config.yaml").is_file()
    # the folder's settings are still checked: another seed is refused
    r = run_cli(*AGENT, "--tokenizer", tokenizer_dir, "--set", f"openai.base_url={server.url}", "--seed", "4",
                "--out", old, *before_keys)
    assert r.returncode == 2 and "other settings" in r.stderr, r.stderr[-2000:]
    # and today's defaults are other settings too: the folder was made with what the code did then
    r = run_cli(*AGENT, "--tokenizer", tokenizer_dir, "--set", f"openai.base_url={server.url}", "--out", old)
    assert r.returncode == 2 and "other settings" in r.stderr, r.stderr[-2000:]


@pytest.mark.parametrize("drop, why", [("--model", "--model"), ("--repos-dir", "--repos-dir or --tarballs")])
def test_the_inputs_are_still_required(tmp_path: Path, drop: str, why: str):
    argv = list(AGENT)
    i = argv.index(drop)
    del argv[i:i + 2]
    r = run_cli(*argv, "--tokenizer", "unused", "--out", tmp_path / "out")
    assert r.returncode == 2 and f"missing {why}" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "out").exists()
    r = run_cli(*AGENT, "--tarballs", "examples/sample/repos", "--out", tmp_path / "out")
    assert r.returncode == 2 and "not allowed with argument" in r.stderr, r.stderr[-2000:]
    assert not (tmp_path / "out").exists()
