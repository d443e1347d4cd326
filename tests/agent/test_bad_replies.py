"""A model server's reply is checked before anything uses it (issue 41 item 6): a lone surrogate, `"text": null`,
empty `choices`, a negative or an impossible token count and a reply far larger than its request's `max_tokens`
allow each ended the run with a traceback (or bloated it: a 200 MB reply was kept whole). Now each is a recorded
`fault` exit of its episode in `mlbench agent` and a per-sample error in `mlbench infer`, and the run goes on. The
server is a scripted OpenAI endpoint on loopback; each request gets the next bad reply."""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import run_cli
from test_agent_config import AGENT, Loopback, tokenizer_dir  # noqa: F401 (a fixture)

# the bad replies, each with what the refusal says
BAD = {"surrogate": "UTF-8 cannot encode", "null": "NoneType, not a string", "empty": "0 choices",
       "negative": "token count -100", "over": "token count 1000000", "huge": "a reply of more than"}


def _reply(mode: str, body: dict) -> bytes:
    choice = {"index": 0, "text": "fine", "finish_reason": "stop", "logprobs": None}
    tokens = {"negative": -100, "over": 1_000_000}.get(mode, 3)
    if mode == "surrogate":
        choice["text"] = "ok \ud800 then"  # json.dumps writes it as the escape \ud800, which JSON allows
    elif mode == "null":
        choice["text"] = None
    elif mode == "huge":
        choice["text"] = "a" * (4 << 20)  # over the cap of any request here (2.5 MiB for 1,024 tokens)
    choices = [] if mode == "empty" else [choice]
    return json.dumps({"id": "x", "object": "text_completion", "created": 0, "model": body.get("model", "m"),
                       "choices": choices, "usage": {"prompt_tokens": 1, "completion_tokens": tokens,
                                                     "total_tokens": tokens + 1}}).encode()


class BadServer(Loopback):
    """Answers request i with the i-th bad reply of :data:`BAD` (then empty choices)."""

    def __init__(self) -> None:
        self.served: list[str] = []

        def answer(body: dict) -> bytes:
            mode = list(BAD)[len(self.served)] if len(self.served) < len(BAD) else "empty"
            self.served.append(mode)
            return _reply(mode, body)
        super().__init__(answer)


@pytest.fixture
def bad_server() -> Iterator[BadServer]:
    s = BadServer()
    yield s
    s.close()


def test_each_bad_reply_is_a_fault_exit_of_its_episode_and_the_agent_run_goes_on(tmp_path: Path,
                                                                                   bad_server: BadServer,
                                                                                   tokenizer_dir: Path):  # noqa: F811
    out = tmp_path / "run"
    r = run_cli(*AGENT, "--tokenizer", tokenizer_dir, "--set", f"openai.base_url={bad_server.url}", "--set",
                "openai.max_retries=0", "--limit", "2", "--episodes", "3", "--out", out)
    assert r.returncode == 0, r.stderr[-3000:]
    assert sorted(bad_server.served) == sorted(BAD)  # one request per episode: each ended at its first reply
    rows = [json.loads(x) for x in (out / "generations.jsonl").read_text().splitlines()]
    episodes = [e for row in rows for e in row["agent"]["episodes"]]
    assert len(rows) == 2 and [e["exit"] for e in episodes] == ["fault"] * 6
    details = " | ".join(e["detail"] for e in episodes)
    assert all(why in details for why in BAD.values()), details
    assert json.loads((out / "summary.json").read_text())["exits"] == {"fault": 6}
    transcripts = b"".join(p.read_bytes() for p in (out / "transcripts").rglob("*.jsonl"))
    transcripts.decode("utf-8")  # every record UTF-8 (a lone surrogate crashed the writer)
    assert len(transcripts) < 100_000  # nothing of the 4 MiB reply kept


def test_each_bad_reply_is_a_per_sample_error_and_infer_goes_on(tmp_path: Path, bad_server: BadServer):
    from mlbench_kit.infer.prompts import PromptItem
    from mlbench_kit.infer.run import generate_plan, make_backend
    from mlbench_kit.infer_config import InferConfig
    cfg = InferConfig(backend="openai", model="served")
    cfg.sampling.n = 1
    cfg.openai = {**cfg.openai, "base_url": bad_server.url, "max_retries": 0}
    items = [PromptItem(3, i, i, f"prompt {i}", [{"role": "user", "content": f"prompt {i}"}], "plain", f"p:{i}")
             for i in range(len(BAD))]
    ident = {"model": {"name": "served"}, "adapter": None, "backend": "openai", "sampling": {}}
    backend = make_backend(cfg, None, 4096, {})
    out = tmp_path / "task3.jsonl"
    try:
        generate_plan(backend, [(None, ident, items, out)], cfg, stream=io.StringIO())
    finally:
        backend.close()
    assert sorted(bad_server.served) == sorted(BAD)
    text = out.read_bytes().decode("utf-8")
    lines = [json.loads(x) for x in text.splitlines()]
    assert len(lines) == len(BAD) and all(x["raw"] == [""] and x["output"] == [""] for x in lines)
    errors = " | ".join(x["errors"][0] for x in lines)
    assert all(why in errors for why in BAD.values()), errors
    assert len(text) < 100_000


def test_chat_choices_are_taken_in_index_order_and_their_tokens_never_undercharged():
    """`api: chat` took the choices in the order the server sent them (completions sorted them by ``index``), so
    sample i could be another sample's text; and the usage's completion tokens were split over the choices rounding
    down: 2 tokens over 3 choices charged 0 each, and an episode's token budget never ran out. Now the choices are
    in index order on both APIs, each is charged the total over n rounded up (together never less than the server
    counted), and a total over n times max_tokens is refused."""
    from test_agent_config import Loopback

    from mlbench_kit.engine import Endpoint, EngineSpec, GenParams, GenRequest, OpenAIEngine
    totals: list[int] = []

    def answer(body: dict) -> bytes:
        choices = [{"index": i, "message": {"role": "assistant", "content": "abc"[i]}, "finish_reason": "stop",
                    "logprobs": None} for i in (2, 0, 1)]
        used = totals.pop(0)
        return json.dumps({"id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
                           "choices": choices, "usage": {"prompt_tokens": 1, "completion_tokens": used,
                                                         "total_tokens": used + 1}}).encode()
    server = Loopback(answer)
    engine = OpenAIEngine(EngineSpec("openai", "served", endpoint=Endpoint(base_url=server.url, api="chat",
                                                                           max_retries=0)))
    try:
        def sample(used: int) -> list:
            totals.append(used)
            request = GenRequest((), 0, messages=({"role": "user", "content": "hi"},))
            return engine.generate([request], GenParams(max_new_tokens=8, n=3))[0]
        got = sample(4)
        assert [(g.text, g.n_tokens, g.fault) for g in got] == [("a", 2, None), ("b", 2, None), ("c", 2, None)]
        assert [g.n_tokens for g in sample(2)] == [1, 1, 1]
        assert [g.n_tokens for g in sample(0)] == [0, 0, 0]
        assert all("token count 9" in str(g.fault) for g in sample(3 * 8 + 1))  # more than 3 choices of 8 can hold
    finally:
        engine.close()
        server.close()
