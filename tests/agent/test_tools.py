"""ML-Agent's steps as tool calls (``actions: tools``): what a tool-call reply parses to and which ones are format
errors, where the option is refused, and a whole episode through the real openai client against a scripted chat
endpoint on loopback (the request's tools and named tool_choice, the transcript's calls, resume, `agent show`).
tests/agent/test_agent_model.py runs it against a real `vllm serve`."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from test_agent import SAMPLE, _rows, _transcripts, encode, toy_repo  # noqa: F401 (a fixture)
from test_agent_config import Loopback

from mlbench_kit.agent import prompts as P
from mlbench_kit.agent.episode import Episode
from mlbench_kit.agent.parse import FormatError, parse_reply
from mlbench_kit.agent.repo import RepoView
from mlbench_kit.agent.run import run_episodes
from mlbench_kit.agent.show import render
from mlbench_kit.agent.tools import parse_call, tool
from mlbench_kit.agent_config import AgentConfig
from mlbench_kit.config import load
from mlbench_kit.engine import CHARS_PER_TOKEN, Endpoint, EngineSpec, GenParams, GenRequest, make_engine
from mlbench_kit.errors import MLBenchError

PLAN = '{"task_flag": "Yes", "ranked_readmefiles": ["toy/examples/a/README.md"]}'


@pytest.mark.parametrize("calls,why", [
    ([], "called no function; this step's is Evaluation_task"),
    ([("Evaluation_readme", PLAN)], "called 'Evaluation_readme'; this step's function is Evaluation_task"),
    ([("Evaluation_task", PLAN), ("Evaluation_task", PLAN)], "2 function calls"),
    ([("Evaluation_task", '{"task_flag": "Yes", "ranked_readmefiles": ["a"]')], "arguments are not JSON"),
    ([("Evaluation_task", '["Yes"]')], "a JSON list, not an object"),
    ([("Evaluation_task", '{"ranked_readmefiles": []}')], "no `task_flag`"),
    ([("Evaluation_task", '{"task_flag": "Maybe"}')], "`task_flag` must be one of Yes, No"),
    ([("Evaluation_task", '{"task_flag": "Yes", "x": "' + "a" * 10 * CHARS_PER_TOKEN + '"}')],
     "more than 10 tokens can hold"),
])
def test_a_tool_call_reply_that_cannot_be_acted_on_is_a_format_error(calls, why):
    with pytest.raises(FormatError, match=re.escape(why)):
        parse_call(calls, "plan", 10)


def test_a_tool_call_reply_is_parsed_as_the_same_text_reply():
    for step, args in (("plan", PLAN), ("code_or_file", '{"flag": "FILE", "file_path": "main.py", "code": ""}'),
                       ("read_args", '{"args_code": "p.add_argument(\'--lr\')"}'),
                       ("write_code", '{"flag": "CODE", "finally_code": "python main.py"}')):
        assert parse_call([(P.FUNCTIONS[step]["name"], args)], step, 512) == parse_reply(args, step)


def test_each_tool_is_the_step_s_function_strict_with_its_flag_an_enum():
    """The function the text mode shows (name, the paper's captions, fields), strict (vLLM then decodes a forced
    call's arguments to the schema, not only its envelope), the flag's values as an enum."""
    t = tool("plan")
    assert t["type"] == "function" and t["function"]["name"] == "Evaluation_task" and t["function"]["strict"]
    assert t["function"]["parameters"]["additionalProperties"] is False
    assert t["function"]["parameters"]["required"] == ["task_flag", "ranked_readmefiles"]
    props = t["function"]["parameters"]["properties"]
    assert props["task_flag"]["enum"] == ["Yes", "No"]
    assert "Remember that the result must be a list!" in props["ranked_readmefiles"]["description"]
    assert {k: {kk: vv for kk, vv in v.items() if kk != "enum"} for k, v in props.items()} == \
        P.FUNCTIONS["plan"]["parameters"]["properties"]
    assert "enum" not in json.dumps(P.FUNCTIONS)  # the text mode's prompt is unchanged
    assert tool("code_or_file")["function"]["parameters"]["properties"]["flag"]["enum"] == ["CODE", "FILE", "No"]


def test_actions_tools_is_refused_where_it_cannot_run(tmp_path: Path):
    """The bash policy, an engine without tools, or a completions endpoint: one error at the file's line; an engine
    refuses a request carrying tools before sending anything."""
    f = tmp_path / "a.yaml"
    for text, why in (("policy: bash\nactions: tools\n", "2: actions: tools offers the ml-agent policy's"),
                      ("backend: hf\nactions: tools\n", "2: actions: tools needs an OpenAI-compatible chat endpoint; "
                                                        "backend hf"),
                      ("backend: openai\nactions: tools\n", "2: actions: tools needs an OpenAI-compatible chat "
                                                            "endpoint; openai.api: completions"),
                      ("actions: calls\n", "1")):
        f.write_text(text)
        with pytest.raises(MLBenchError, match=rf"{re.escape(str(f))}:{re.escape(why)}"):
            load(AgentConfig, f)
    f.write_text("backend: openai\nactions: tools\nopenai:\n  api: chat\n")
    assert load(AgentConfig, f).actions == "tools"
    assert "actions" not in AgentConfig().settings()  # a run folder from before the option resumes
    assert AgentConfig(actions="tools").sha() != AgentConfig().sha()
    # nothing listens on port 9 (discard): a request that were sent would fail otherwise
    engine = make_engine(EngineSpec("openai", "m", endpoint=Endpoint("http://127.0.0.1:9/v1", max_retries=0,
                                                                     timeout_s=2)))
    try:
        with pytest.raises(MLBenchError, match=r"openai \(api: completions\) engine cannot offer tools.*\n  fix: use "
                                               "backend: openai with openai.api: chat"):
            engine.generate([GenRequest((1, 2), 0, tools="[]", tool_choice="f")], GenParams())
    finally:
        engine.close()


def test_the_hf_engine_refuses_tools_before_generating(tiny_model_dir: Path):
    from mlbench_kit.hf import load_tokenizer
    engine = make_engine(EngineSpec("hf", str(tiny_model_dir)), load_tokenizer(str(tiny_model_dir), fast=False))
    try:
        with pytest.raises(MLBenchError, match="hf engine cannot offer tools"):
            engine.generate([GenRequest((1, 2), 0, tools="[]", tool_choice="f")], GenParams(max_new_tokens=4))
    finally:
        engine.close()


class ChatServer(Loopback):
    """A loopback chat completions endpoint that answers each step with a call of the function the request forces:
    the gold path of the toy row (rank its README, read main.py, its argument code, submit), the first reply of
    each episode a call of the wrong function. Keeps every request body."""

    def __init__(self) -> None:
        self.bodies: list[dict] = []
        replies = {"Evaluation_readme": '{"flag": "FILE", "file_path": "examples/a/main.py", "code": ""}',
                   "read_code": '{"args_code": "p.add_argument(\'--lr\')"}',
                   "write_code": '{"flag": "CODE", "finally_code": "python main.py --lr 0.1"}',
                   "Evaluation_task": PLAN}

        def answer(body: dict) -> bytes:
            self.bodies.append(body)
            forced = body["tool_choice"]["function"]["name"]
            name = "write_code" if len(self.bodies) == 1 else forced
            call = {"id": f"c{len(self.bodies)}", "type": "function",
                    "function": {"name": name, "arguments": replies[name]}}
            return json.dumps({"id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
                               "choices": [{"index": 0, "finish_reason": "tool_calls",
                                            "message": {"role": "assistant", "content": None, "tool_calls": [call]}}],
                               "usage": {"prompt_tokens": 100, "completion_tokens": 7, "total_tokens": 107}}).encode()
        super().__init__(answer)


def _tools_cfg(url: str) -> AgentConfig:
    cfg = AgentConfig(episodes=1, backend="openai", actions="tools")
    cfg.openai.api, cfg.openai.base_url = "chat", url
    return cfg


def _run(cfg: AgentConfig, toy_repo: Path, out: Path) -> dict:  # noqa: F811
    """The episodes of the toy row on the engine `mlbench agent` builds from ``cfg`` (its ``openai.*``)."""
    from mlbench_kit.agent.run import make_engine as agent_engine
    cfg.model = "served"
    engine = agent_engine(cfg, None, 10**6)
    try:
        return run_episodes(cfg, [SAMPLE], {"toy": toy_repo}, lambda: engine, encode, 10**6, out,
                            {"model": "served", "adapter": None, "backend": "openai"})
    finally:
        engine.close()


def test_an_episode_of_tool_calls_over_a_chat_endpoint(toy_repo: Path, tmp_path: Path, capsys):  # noqa: F811
    server = ChatServer()
    try:
        cfg = _tools_cfg(server.url)
        stats = _run(cfg, toy_repo, tmp_path / "run")
    finally:
        server.close()
    assert stats["exits"] == {"submitted": 1}
    # each request: the step's prompt as the user message (no answer-format line: the tool is the format), the
    # step's one tool, forced by name
    first = server.bodies[1]
    assert [m["role"] for m in first["messages"]] == ["user"]
    assert first["messages"][0]["content"].startswith(P.PLAN[:60]) and "Answer by calling" not in \
        first["messages"][0]["content"]
    assert first["tools"] == [tool("plan")]
    assert first["tool_choice"] == {"type": "function", "function": {"name": "Evaluation_task"}}
    assert [b["tool_choice"]["function"]["name"] for b in server.bodies] == \
        ["Evaluation_task", "Evaluation_task", "Evaluation_readme", "read_code", "write_code"]
    # the transcript: each turn's calls; the wrong function was a format error of its turn, asked again
    (turns,) = _transcripts(tmp_path / "run").values()
    turns = [t for t in turns if "turn" in t]
    assert turns[0]["tool_calls"][0]["name"] == "write_code" and "this step's function is Evaluation_task" in \
        turns[0]["error"]
    assert [t["step"] for t in turns] == ["plan", "plan", "code_or_file", "read_args", "write_code"]
    assert all("error" not in t for t in turns[1:])
    assert turns[-1]["raw"] == turns[-1]["tool_calls"][0]["arguments"] and turns[-1]["tokens_out"] == 7
    # the prompt's tokens: the server's count (its usage), the estimate made here kept beside it
    assert all(t["tokens_in"] == 100 and t["tokens_in_estimate"] > 100 for t in turns)
    gens = _rows(tmp_path / "run")
    assert gens[0]["output"] == ["python main.py --lr 0.1"] and gens[0]["agent"]["episodes"][0]["tokens_in"] == 500
    # resume: a run killed after its transcript's turns replays them from the recorded calls, sending nothing
    (tmp_path / "run" / "generations.jsonl").unlink()
    server = ChatServer()
    try:
        _run(_tools_cfg(server.url), toy_repo, tmp_path / "run")
    finally:
        server.close()
    assert server.bodies == [] and _rows(tmp_path / "run") == gens
    render(tmp_path / "run", episode=0)
    shown = capsys.readouterr().out
    assert "[assistant: call Evaluation_readme]\n" in shown and "[assistant: call write_code]" in shown


def test_a_bad_tool_call_reply_is_a_format_error_and_replays_as_one(toy_repo: Path):  # noqa: F811
    """Calls fed to an episode: each malformed one is a format error of its turn (counted against
    ``max_format_errors``); a transcript record replays to the same turn."""
    cfg = AgentConfig(episodes=1, backend="openai", actions="tools")
    ep = Episode(SAMPLE, RepoView(toy_repo, "toy"), cfg, 0, encode, 10**6)
    p = ep.prepare()
    assert p is not None and p.tool_choice == "Evaluation_task" and json.loads(str(p.tools)) == [tool("plan")]
    assert "Answer by calling" not in p.text
    bad = [(), (("Evaluation_task", "{not json"),),
           (("Evaluation_task", '{"task_flag": "' + "Y" * (p.max_new_tokens * CHARS_PER_TOKEN) + '"}'),)]
    for calls in bad:
        ep.prepare()
        rec = ep.feed("", 5, 0.1, False, calls)
        assert "error" in rec and rec["tool_calls"] == [{"name": n, "arguments": a} for n, a in calls]
    assert ep.exit == "format_errors" and ep.format_errors == 3
    again = Episode(SAMPLE, RepoView(toy_repo, "toy"), cfg, 0, encode, 10**6)
    for rec in ep.turns:
        again.prepare()
        again.replay(rec)
    assert again.turns == ep.turns and again.exit == "format_errors"


def test_gold_episodes_refuse_tool_calls(tmp_path: Path):
    """Gold episodes are text turns (SFT records of a prompt and its JSON reply): with ``actions: tools`` they are
    refused before anything is read or written."""
    from mlbench_kit.agent.gold import write_gold_episodes
    cfg = AgentConfig(actions="tools", backend="openai")
    with pytest.raises(MLBenchError, match="actions: tools has no such records"):
        write_gold_episodes(cfg, [SAMPLE], {}, None, encode, "plain", 10**6, tmp_path / "out")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("call,fault", [
    ({"name": 5, "arguments": "{}"}, "tool call 0's name is int, not a string"),
    ({"name": "f", "arguments": {"task_flag": "Yes"}}, "tool call 0's arguments is dict, not a string"),
    ({"name": "f", "arguments": '{"a": "\\ud800"}'}, None),  # an escaped surrogate is JSON text: the parser's
])
def test_a_tool_call_the_engine_cannot_read_is_a_refused_reply(call, fault):
    """The openai engine reads a reply's calls as (name, arguments) strings; a call whose name or arguments is not a
    string is no reply (``fault``: the episode ends as one), before any parsing."""
    def answer(body: dict) -> bytes:
        return json.dumps({"id": "x", "object": "chat.completion", "created": 0, "model": "m",
                           "choices": [{"index": 0, "finish_reason": "tool_calls", "message": {
                               "role": "assistant", "content": None,
                               "tool_calls": [{"id": "c", "type": "function", "function": call}]}}],
                           "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}}).encode()
    server = Loopback(answer)
    engine = make_engine(EngineSpec("openai", "m", endpoint=Endpoint(server.url, "chat", max_retries=0)))
    try:
        (g,), = engine.generate([GenRequest((), 0, messages=({"role": "user", "content": "hi"},), tools="[]",
                                            tool_choice="f")], GenParams(max_new_tokens=8))
    finally:
        engine.close()
        server.close()
    assert g.fault == fault
    if fault is None:
        assert g.tool_calls == (("f", call["arguments"]),) and g.prompt_tokens == 3 and g.text == ""


def test_text_actions_over_a_chat_endpoint_send_the_prompt_as_a_message(toy_repo: Path, tmp_path: Path):  # noqa: F811
    """``openai.api: chat`` with ``actions: text``: each turn is the step's whole prompt (its answer-format line
    too) as one user message, no tools; the reply's text is parsed as any text reply."""
    from test_agent import gold_reader
    bodies: list[dict] = []

    def answer(body: dict) -> bytes:
        bodies.append(body)
        reply = gold_reader(body["messages"][0]["content"], 0)
        return json.dumps({"id": "x", "object": "chat.completion", "created": 0, "model": body["model"],
                           "choices": [{"index": 0, "finish_reason": "stop",
                                        "message": {"role": "assistant", "content": reply}}],
                           "usage": {"prompt_tokens": 9, "completion_tokens": 5, "total_tokens": 14}}).encode()
    server = Loopback(answer)
    try:
        cfg = AgentConfig(episodes=1, backend="openai")
        cfg.openai.api, cfg.openai.base_url = "chat", server.url
        _run(cfg, toy_repo, tmp_path / "run")
    finally:
        server.close()
    assert len(bodies) == 4 and all("tools" not in b and len(b["messages"]) == 1 for b in bodies)
    assert "Answer by calling this function" in bodies[0]["messages"][0]["content"]
    assert _rows(tmp_path / "run")[0]["output"] == ["python main.py --lr 0.1"]
