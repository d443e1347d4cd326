"""ML-Agent's harness on fixed replies: the reply parser, the confined repository reads, each limit's exit, the
paper's prompt texts, the run folder, transcripts and resume. A scripted engine answers from the prompt text (no
model); tests/agent/test_agent_model.py runs a real model."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from mlbench_kit import tree
from mlbench_kit.agent import prompts as P
from mlbench_kit.agent.episode import BaseEpisode, Episode, Prepared, sha, turn_seed
from mlbench_kit.agent.parse import FormatError, parse_reply
from mlbench_kit.agent.repo import Refused, RepoView
from mlbench_kit.agent.run import run_episodes
from mlbench_kit.agent_config import AgentConfig
from mlbench_kit.cli import stage_config
from mlbench_kit.dataset import Sample, load_samples
from mlbench_kit.engine import Generated, GenParams, GenRequest
from mlbench_kit.errors import MLBenchError

# ---------------------------------------------------------------------------------------------------------- parser


def test_parser_reads_each_step():
    assert parse_reply('{"task_flag": "Yes", "ranked_readmefiles": ["r/README.md", "r/a/README.md"]}', "plan") == \
        {"kind": "plan", "flag": "Yes", "readmes": ["r/README.md", "r/a/README.md"]}
    # the released agent's comma-separated string, a fenced block with chatter around it, "No." with its dot
    assert parse_reply('Sure!\n```json\n{"task_flag": "yes", "ranked_readmefiles": "a/README.md, b/README.md"}\n```',
                       "plan")["readmes"] == ["a/README.md", "b/README.md"]
    assert parse_reply('{"task_flag": "No."}', "plan") == {"kind": "plan", "flag": "No", "readmes": []}
    assert parse_reply('{"flag": "CODE", "file_path": "", "code": "python main.py --lr 0.1"}', "code_or_file") == \
        {"kind": "code", "code": "python main.py --lr 0.1"}
    assert parse_reply('{"flag": "FILE", "file_path": "main.py", "code": ""}', "code_or_file") == \
        {"kind": "file", "path": "main.py"}
    assert parse_reply('{"flag": "NO", "file_path": "", "code": ""}', "code_or_file") == {"kind": "reject"}
    assert parse_reply('{"args_code": "parser.add_argument(\'--lr\')"}', "read_args")["args"].startswith("parser")
    assert parse_reply('{"flag": "CODE", "finally_code": "python x.py"}', "write_code")["code"] == "python x.py"
    # a first object of another shape is skipped for the one with the step's key
    assert parse_reply('{"a": 1} then {"flag": "No"}', "write_code") == {"kind": "reject"}


@pytest.mark.parametrize("reply,step,why", [
    ("python main.py --lr 0.1", "code_or_file", "no JSON object"),
    ('{"flag": "MAYBE", "code": "x"}', "code_or_file", "must be one of"),
    ('{"flag": "CODE", "code": "  "}', "code_or_file", "needs `code`"),
    ('{"flag": "FILE", "file_path": ""}', "code_or_file", "needs `file_path`"),
    ('{"task_flag": "Yes", "ranked_readmefiles": 3}', "plan", "list of file names"),
    ('{"flag": "CODE", "finally_code": ["a"]}', "write_code", "must be a string"),
    ('{"task_flag": "Yes"', "plan", "no JSON object"),  # cut off at the token limit
])
def test_parser_refuses_what_it_cannot_act_on(reply, step, why):
    with pytest.raises(FormatError, match=re.escape(why)):
        parse_reply(reply, step)


# ---------------------------------------------------------------------------------------------------- repository


@pytest.fixture
def toy_repo(tmp_path: Path) -> Path:
    """A checkout with two READMEs, a task folder, a link out of the tree, a link inside it and a binary file."""
    root = tmp_path / "repos" / "toy"
    (root / "examples" / "a").mkdir(parents=True)
    (root / "README.md").write_text("# toy\nRun examples/a/main.py.\n")
    (root / "examples" / "a" / "README.md").write_text("python main.py --lr LR\n")
    (root / "examples" / "a" / "main.py").write_text("import argparse\np = argparse.ArgumentParser()\n"
                                                     "p.add_argument('--lr')\n")
    (root / "big.py").write_text("x = 1\n" * 50_000)
    (root / "blob.bin").write_bytes(b"\x00\x01\x02")
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP SECRET")
    (root / "escape.py").symlink_to(secret)
    (root / "examples" / "inner").symlink_to(root / "examples" / "a")
    (root / ".git").mkdir()
    (root / ".git" / "config").write_text("[core]\n")
    return root


def test_reads_stay_in_the_checkout(toy_repo: Path, tmp_path: Path):
    view = RepoView(toy_repo, "toy", max_file_bytes=100_000)
    assert view.read("examples/a/main.py").startswith("import argparse")
    assert view.read("toy/examples/a/main.py") == view.read("./examples/a/main.py")  # the name the model sees
    refused = {
        "../secret.txt": "leaves the repository",
        "examples/../../secret.txt": "leaves the repository",
        str(tmp_path / "secret.txt"): "absolute path",
        "/etc/passwd": "absolute path",
        "escape.py": "symbolic link",
        "examples/inner/main.py": "symbolic link",  # a link inside the tree is not followed either
        "blob.bin": "not a text file",
        "big.py": "over the 100000-byte limit",
        "examples/a": "not a regular file",
        "nope.py": "not in the repository index",
        "main\0.py": "not a file name",
        "a/" * 3000: "not a file name",
        "x" * 300 + ".py": "cannot be read",  # too long for the file system
    }
    for path, why in refused.items():
        with pytest.raises(Refused, match=re.escape(why)):
            view.read(path)
    files = view.files()
    assert "escape.py" not in files and not any(f.startswith((".git", "examples/inner")) for f in files)
    assert view.readmes() == ["README.md", "examples/a/README.md"]  # shortest path first


def test_a_checkout_deeper_than_the_recursion_limit_is_listed(tmp_path: Path):
    """Issue 41, item 1: a folder 1,100 levels deep stopped `mlbench agent` before its first model call (os.walk's
    RecursionError in the repository view)."""
    deep = tmp_path / "repo"
    for _ in range(1101):  # one level at a time: Path.mkdir(parents=True) recurses too
        deep.mkdir()
        deep = deep / "d"
    (deep.parent / "f.py").write_text("x = 1\n")
    (tmp_path / "repo" / "README.md").write_text("# deep\n")
    view = RepoView(tmp_path / "repo", "deep")
    try:
        assert view.files() == ["README.md", "/".join(["d"] * 1100 + ["f.py"])]
        assert view.read(view.files()[1]) == "x = 1\n"
    finally:
        tree.remove(tmp_path / "repo")  # pytest's own clean-up of tmp_path recurses


def test_index_keeps_the_task_folder_first(toy_repo: Path):
    view = RepoView(toy_repo, "toy")
    text, left = view.index("./examples/a", 41)
    assert text.splitlines()[:2] == ["examples/a/README.md", "examples/a/main.py"]
    assert left == len(view.files()) - 2 and text.endswith(f"[... {left} more files not listed]")
    full, none_left = view.index("./examples/a", 10_000)
    assert none_left == 0 and "more files" not in full


# ------------------------------------------------------------------------------------------------------ episodes

SAMPLE = Sample(github_id=9, id=1, repo="toy", path="./examples/a", arguments={"lr": "0.1"},
                instruction="Train the model in examples/a with a learning rate of 0.1.", oracle="",
                type="Bash Script", output="python main.py --lr 0.1")


def encode(text: str) -> list[int]:
    """One token per character: the scripted engine reads the prompt back from its ids."""
    return [ord(c) for c in text]


class Scripted:
    """An engine that answers from the prompt: ``policy(prompt_text, seed) -> reply``."""

    def __init__(self, policy, tokens_per_reply: int | None = None) -> None:
        self.policy, self.calls, self.sizes, self.tokens = policy, 0, [], tokens_per_reply

    def generate(self, requests: list[GenRequest], params: GenParams) -> list[list[Generated]]:
        self.calls += 1
        self.sizes.append(len(requests))
        out = []
        for r in requests:
            text = self.policy("".join(map(chr, r.token_ids)), r.seed)
            out.append([Generated(text, self.tokens or max(1, len(text) // 4))])
        return out

    def close(self) -> None:
        pass


def gold_reader(prompt: str, seed: int) -> str:
    """Ranks the task folder's README first, asks for main.py, reads its options, then submits the gold answer."""
    if prompt.startswith("I will provide you with the name of a GitHub repository"):
        return json.dumps({"task_flag": "Yes", "ranked_readmefiles": ["toy/examples/a/README.md", "toy/README.md"]})
    if prompt.startswith("I will provide you with a github readme file and directory index"):
        return json.dumps({"flag": "FILE", "file_path": "examples/a/main.py", "code": ""})
    if prompt.startswith("Read the code in the following py file"):
        assert "p.add_argument('--lr')" in prompt  # the file, as the harness read it
        return json.dumps({"args_code": "p.add_argument('--lr')"})
    assert "code_arguments:p.add_argument('--lr')" in prompt
    return 'Here it is: {"flag": "CODE", "finally_code": "python main.py --lr 0.1"}'


def _cfg(**limits) -> AgentConfig:
    cfg = AgentConfig(episodes=2)
    for k, v in limits.items():
        setattr(cfg.limits, k, v)
    return cfg


def _episode(toy_repo: Path, cfg: AgentConfig | None = None, max_model_len: int = 1_000_000) -> Episode:
    return Episode(SAMPLE, RepoView(toy_repo, "toy"), cfg or _cfg(), 0, encode, max_model_len)


def drive(ep: Episode, policy, tokens: int = 10, wall: float = 0.01) -> Episode:
    while (p := ep.prepare()) is not None:
        ep.feed(policy("".join(map(chr, p.ids)), p.seed), tokens, wall)
    return ep


def test_an_episode_reads_a_file_then_submits(toy_repo: Path):
    ep = drive(_episode(toy_repo), gold_reader)
    assert (ep.exit, ep.answer) == ("submitted", "python main.py --lr 0.1")
    assert [t["step"] for t in ep.turns] == ["plan", "code_or_file", "read_args", "write_code"]
    assert ep.turns[1]["inputs"]["readme"] == "toy/examples/a/README.md"
    assert ep.turns[2]["observation"] is None and ep.turns[1]["observation"].startswith("import argparse")
    assert ep.turns[-1]["exit"] == "submitted"


def test_a_refused_file_is_what_the_model_sees(toy_repo: Path):
    shown = []

    def policy(prompt: str, seed: int) -> str:
        if prompt.startswith("I will provide you with the name"):
            return '{"task_flag": "Yes", "ranked_readmefiles": ["toy/README.md"]}'
        if prompt.startswith("I will provide you with a github readme file and directory"):
            return '{"flag": "FILE", "file_path": "../secret.txt", "code": ""}'
        if prompt.startswith("Read the code"):
            shown.append(prompt)
            return '{"args_code": "None"}'
        return '{"flag": "No", "finally_code": ""}'
    ep = drive(_episode(toy_repo), policy)
    assert ep.exit == "no_answer" and ep.answer is None
    refusal = ep.turns[1]["observation"]
    assert refusal.startswith("refused:") and "leaves the repository" in refusal
    assert f"py_file:{refusal}" in shown[0] and "TOP SECRET" not in shown[0]


def test_step3_no_rejects_and_every_readme_rejected_is_no_answer(toy_repo: Path):
    ep = drive(_episode(toy_repo), lambda p, s: '{"task_flag": "No"}')
    assert (ep.exit, len(ep.turns)) == ("rejected", 1)

    def reject_all(prompt: str, seed: int) -> str:
        if prompt.startswith("I will provide you with the name"):
            return '{"task_flag": "Yes", "ranked_readmefiles": ["toy/README.md", "toy/nope/README.md", "../x"]}'
        return '{"flag": "No", "file_path": "", "code": ""}'
    ep = drive(_episode(toy_repo), reject_all)
    # unknown and escaping names are dropped from the ranking: one README, rejected, then no answer
    assert (ep.exit, len(ep.turns), ep.ranked) == ("no_answer", 2, ["README.md"])


def test_format_errors_are_asked_again_then_end_the_episode(toy_repo: Path):
    seeds = []

    def chatter(prompt: str, seed: int) -> str:
        seeds.append(seed)
        return "I think you should run main.py"
    ep = drive(_episode(toy_repo), chatter)
    assert (ep.exit, len(ep.turns)) == ("format_errors", 3)
    assert all(t["error"] and t["action"] is None for t in ep.turns)
    assert len({t["prompt_sha"] for t in ep.turns}) == 1 and len(set(seeds)) == 3  # same prompt, new seed
    # a parseable reply in between resets the count
    replies = iter(["x", "y", '{"task_flag": "Yes", "ranked_readmefiles": ["toy/README.md"]}', "z", "w", "v"])
    ep = drive(_episode(toy_repo), lambda p, s: next(replies))
    assert (ep.exit, len(ep.turns)) == ("format_errors", 6)


def looper(prompt: str, seed: int) -> str:
    """Never submits: ranks both READMEs, then FILE, args and No for each in turn (1 + 3 turns per README)."""
    if prompt.startswith("I will provide you with the name"):
        return '{"task_flag": "Yes", "ranked_readmefiles": ["toy/README.md", "toy/examples/a/README.md"]}'
    if prompt.startswith("Read the code"):
        return '{"args_code": "None"}'
    if prompt.startswith("I will provide you with a github readme file and code"):
        return '{"flag": "No", "finally_code": ""}'
    return '{"flag": "FILE", "file_path": "examples/a/main.py", "code": ""}'


@pytest.mark.parametrize("limits,tokens,wall,status,turns", [
    ({"max_turns": 2}, 10, 0.01, "turn_limit", 2),
    ({"max_episode_tokens": 25}, 10, 0.01, "token_limit", 3),
    ({"max_episode_seconds": 1.0}, 10, 0.4, "time_limit", 3),
])
def test_each_limit_ends_the_episode_with_its_status(toy_repo: Path, limits, tokens, wall, status, turns):
    ep = drive(_episode(toy_repo, _cfg(**limits)), looper, tokens, wall)
    assert (ep.exit, len(ep.turns), ep.answer) == (status, turns, None)
    assert ep.turns[-1]["exit"] == status


def test_the_last_turn_gets_only_the_tokens_left(toy_repo: Path):
    cfg = _cfg(max_episode_tokens=600)
    ep = _episode(toy_repo, cfg)
    assert ep.prepare().max_new_tokens == 512  # sampling.max_new_tokens
    ep.feed("x", 500, 0.1)
    assert ep.prepare().max_new_tokens == 100


def test_a_prompt_over_the_context_ends_the_episode_unsent(toy_repo: Path):
    ep = _episode(toy_repo, max_model_len=700)  # the plan prompt is longer than 700 - 512
    assert ep.prepare() is None
    assert ep.exit == "context_exceeded" and ep.turns == [] and "max_model_len 700" in ep.detail


def test_repository_texts_are_cut_to_fit_the_context_never_the_task(toy_repo: Path):
    (toy_repo / "README.md").write_text("# toy\n" + "All about the toy model. " * 400)  # 10,000 characters
    cfg = _cfg()
    cfg.sampling.max_new_tokens = 100
    ep = _episode(toy_repo, cfg, max_model_len=3000)  # one token per character here
    p = ep.prepare()
    assert p is not None and len(p.ids) + 100 <= 3000 and len(p.ids) > 2500  # cut, not emptied
    assert p.inputs["fitted"]["readme"] < cfg.read.max_readme_chars
    assert SAMPLE.instruction in p.text and "more characters not shown]" in p.text
    assert p.text.endswith(ep.prepare().text[-200:])  # the answer format survives
    cfg.fit_context = False
    ep = _episode(toy_repo, cfg, max_model_len=3000)
    assert ep.prepare() is None and ep.exit == "context_exceeded"


def test_turn_seeds_depend_on_row_episode_and_turn():
    seeds = {turn_seed(42, (9, 1), e, t) for e in range(3) for t in range(4)}
    assert len(seeds) == 12 and turn_seed(42, (9, 1), 1, 2) == turn_seed(42, (9, 1), 1, 2)
    assert turn_seed(43, (9, 1), 1, 2) != turn_seed(42, (9, 1), 1, 2)


# ----------------------------------------------------------------------------------------------- prompts / config


def _words(text: str) -> str:
    return " ".join(text.split())


def test_the_prompts_are_the_papers_tables(shared: Path, toy_repo: Path):
    """Tables 22 and 23 of the paper, word for word (the paper's text, whitespace aside), in the prompts sent."""
    paper = _words((shared / "paper" / "ml-bench-paper.txt").read_text())
    t22 = paper[paper.index("I will provide you with the name of a GitHub"): paper.index("Table 22:")]
    t23 = paper[paper.index("I will provide you with a github readme file and directory"): paper.index("Table 23:")]
    ep = _episode(toy_repo)
    plan = _words(ep.prepare().text)
    fixed22 = t22[: t22.index("repo_name:")]
    assert plan.startswith(fixed22) and "repo_name: toy main_readmefile: # toy" in plan
    assert f"task: {SAMPLE.instruction}" in plan
    ep.feed('{"task_flag": "Yes", "ranked_readmefiles": ["toy/README.md"]}', 5, 0.1)
    code = _words(ep.prepare().text)
    fixed23 = t23[: t23.index("repository_index_file:")]
    assert code.startswith(fixed23) and "repository_index_file: examples/a/README.md" in code


def test_config_errors_name_the_line(tmp_path: Path):
    f = tmp_path / "a.yaml"
    f.write_text("episodes: 5\nlimits:\n  max_turns: 0\n")
    with pytest.raises(MLBenchError, match=rf"{re.escape(str(f))}:3"):
        stage_config("agent", ["--config", str(f)])
    f.write_text("episodes: 5\nlimit:\n  max_turns: 3\n")
    with pytest.raises(MLBenchError, match=rf"{re.escape(str(f))}:2"):
        stage_config("agent", ["--config", str(f)])
    shipped = Path(__file__).resolve().parents[2] / "configs" / "agent"
    for y in shipped.glob("*.yaml"):
        stage_config("agent", ["--config", str(y)])
    shipped_defaults = stage_config("agent", ["--config", str(shipped / "ml-agent.yaml")])
    assert shipped_defaults.sha() == AgentConfig().sha()  # the file is the defaults


# ----------------------------------------------------------------------------------------- runs, transcripts, resume


def _run(toy_repo: Path, out: Path, engine, cfg: AgentConfig | None = None, rows=(SAMPLE,)):
    return run_episodes(cfg or _cfg(), list(rows), {"toy": toy_repo}, lambda: engine, encode, 1_000_000, out,
                        {"model": "scripted", "adapter": None, "backend": "scripted"})


RUN_ONLY = ("wall_s", "call_s", "call_size")  # how the turn ran, not what it was: a re-run may differ


def _transcripts(out: Path) -> dict[str, list[dict]]:
    """Every transcript, without the wall times (the only thing a re-run may change)."""
    found = {}
    for f in sorted((out / "transcripts").rglob("*.jsonl")):
        recs = [{k: v for k, v in json.loads(x).items() if k not in RUN_ONLY} for x in f.read_text().splitlines()]
        for r in recs:
            if "end" in r:
                r["end"].pop("seconds")
        found[str(f.relative_to(out))] = recs
    return found


def _rows(out: Path) -> list[dict]:
    rows = [json.loads(x) for x in (out / "generations.jsonl").read_text().splitlines()]
    for r in rows:
        for e in r["agent"]["episodes"]:
            e.pop("seconds")
    return sorted(rows, key=lambda r: (r["github_id"], r["id"]))


OTHER = Sample(github_id=9, id=2, repo="toy", path="./examples/a", arguments={"lr": "0.5"},
               instruction="Train with lr 0.5", oracle="", type="Bash Script", output="python main.py --lr 0.5")


def seeded(prompt: str, seed: int) -> str:
    """Submits or rejects by the seed's parity: episodes differ, and a resume must reproduce which."""
    if prompt.startswith("I will provide you with the name"):
        return '{"task_flag": "Yes", "ranked_readmefiles": ["toy/examples/a/README.md"]}' if seed % 3 else "hm"
    if seed % 2:
        return '{"flag": "FILE", "file_path": "examples/a/main.py", "code": ""}'
    if prompt.startswith("Read the code"):
        return '{"args_code": "None"}'
    return '{"flag": "CODE", "code": "python main.py --lr 0.1", "finally_code": "python main.py --lr 0.1"}'


def test_generations_and_transcripts_in_lockstep(toy_repo: Path, tmp_path: Path):
    engine = Scripted(gold_reader)
    stats = _run(toy_repo, tmp_path / "run", engine, rows=(SAMPLE, OTHER))
    rows = _rows(tmp_path / "run")
    assert [r["output"] for r in rows] == [["python main.py --lr 0.1"] * 2] * 2
    assert stats["exits"] == {"submitted": 4} and stats["rounds"] == 4
    assert engine.sizes == [4, 4, 4, 4]  # every live episode's turn in one call
    ts = _transcripts(tmp_path / "run")
    assert len(ts) == 4 and all(len(t) == 5 and t[-1]["end"]["exit"] == "submitted" for t in ts.values())
    turn = ts["transcripts/9-1/ep0.jsonl"][1]
    assert {"turn", "step", "seed", "prompt_sha", "inputs", "tokens_in", "raw", "tokens_out", "action",
            "observation"} <= set(turn)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert (summary["episodes"], summary["rows"], summary["exits"], summary["answered"]) == (4, 2, {"submitted": 4}, 4)
    assert summary["mean_turns"] == 4 and summary["mean_tokens_out"] > 0
    # each turn counts its share of the lockstep call against the time limit
    raw = json.loads((tmp_path / "run" / "transcripts" / "9-1" / "ep0.jsonl").read_text().splitlines()[1])
    assert raw["call_size"] == 4 and raw["wall_s"] == pytest.approx(raw["call_s"] / 4, abs=1e-3)
    # eval's reader takes the file as is
    from mlbench_kit.eval.generations import load_generations
    gens = load_generations(tmp_path / "run" / "generations.jsonl", {SAMPLE.key: SAMPLE, OTHER.key: OTHER})
    assert gens.n == 2 and gens.outputs[SAMPLE.key] == ["python main.py --lr 0.1"] * 2


def test_agent_show_escapes_every_field_of_a_handed_over_transcript(tmp_path: Path, capsys):
    """Not only the texts: a crafted transcript's exits, roles, counts and odd shapes print as escapes, never as a
    terminal's commands, and never as a traceback."""
    from mlbench_kit.cli import main
    d = tmp_path / "run" / "transcripts" / "1-2"
    d.mkdir(parents=True)
    (d / "ep0.jsonl").write_text(json.dumps({"turn": "\x1b[2J", "step": "bash", "tokens_in": "\x07", "messages": [
        "not a message", {"role": "\x1b]0;title\x07", "content": "hi"}], "exit": "\x1b[31m"}) + "\n" + json.dumps(
        {"end": {"exit": "\x1b[1m", "seconds": "\x9b2J", "openhands": "not a mapping"}}) + "\n")
    assert main(["agent", "show", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    assert not any(c in out for c in "\x1b\x07\x9b") and "\\x1b[2J" in out and "\\x1b]0;title" in out


def test_transcripts_hold_every_prompt_and_agent_show_renders_an_episode(toy_repo: Path, tmp_path: Path, capsys):
    """Each turn records the whole prompt the engine got; `mlbench agent show` prints it, the reply and the end,
    escaping what could drive a terminal; a run prints its progress (the last line at least, off a terminal)."""
    from mlbench_kit.cli import main
    seen: list[str] = []

    def policy(prompt: str, seed: int) -> str:
        seen.append(prompt)
        return gold_reader(prompt, seed) + ("\nclear \x1b[2J" if len(seen) == 1 else "")  # talk around the JSON
    cfg = _cfg()
    cfg.episodes = 1
    _run(toy_repo, tmp_path / "run", Scripted(policy), cfg)
    assert "agent: 1/1 episodes (100%), round 4, 4 turns, 1 rows written" in capsys.readouterr().err
    t = [json.loads(x) for x in (tmp_path / "run" / "transcripts" / "9-1" / "ep0.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in t if "turn" in r] == seen and len(seen) == 4
    assert main(["agent", "show", str(tmp_path / "run"), "--row", "1", "--full"]) == 0
    shown = capsys.readouterr().out
    assert all(p in shown for p in seen) and "\x1b" not in shown and "\\x1b[2J" in shown
    assert shown.startswith("== row 9-1, episode 0: 4 turns, exit submitted") and "[answer]" in shown
    assert main(["agent", "show", str(tmp_path / "run"), "--episode", "3"]) == 2
    assert "no episode 3 for row 9-1" in capsys.readouterr().err
    assert main(["agent", "show", str(tmp_path / "nothing")]) == 2


def test_an_episode_without_an_answer_keeps_its_place(toy_repo: Path, tmp_path: Path):
    _run(toy_repo, tmp_path / "run", Scripted(lambda p, s: '{"task_flag": "No"}'))
    (row,) = _rows(tmp_path / "run")
    assert row["output"] == ["", ""] and [e["exit"] for e in row["agent"]["episodes"]] == ["rejected"] * 2


class Killed(Exception):
    pass


class KillAfter(Scripted):
    """Dies in its (n+1)-th call, as a killed process would: the turns of that round are never written."""

    def __init__(self, policy, n: int) -> None:
        super().__init__(policy)
        self.n = n

    def generate(self, requests, params):
        if self.calls >= self.n:
            raise Killed
        return super().generate(requests, params)


@pytest.mark.parametrize("kill_after", [1, 2, 3])
def test_a_killed_run_resumes_to_the_same_result(toy_repo: Path, tmp_path: Path, kill_after: int):
    cfg = _cfg(max_turns=6)
    cfg.episodes = 3
    whole = Scripted(seeded)
    _run(toy_repo, tmp_path / "whole", whole, cfg, rows=(SAMPLE, OTHER))
    with pytest.raises(Killed):
        _run(toy_repo, tmp_path / "part", KillAfter(seeded, kill_after), cfg, rows=(SAMPLE, OTHER))
    before = sum(1 for t in _transcripts(tmp_path / "part").values() for r in t if "turn" in r)
    again = Scripted(seeded)
    _run(toy_repo, tmp_path / "part", again, cfg, rows=(SAMPLE, OTHER))
    assert _transcripts(tmp_path / "part") == _transcripts(tmp_path / "whole")
    assert _rows(tmp_path / "part") == _rows(tmp_path / "whole")
    assert sum(again.sizes) == sum(whole.sizes) - before  # finished turns are not generated again
    assert before > 0


class Echo(BaseEpisode):
    """A third policy, defined outside agent/: two turns of its own prompts, then ``submitted`` with its last reply;
    it records when the loop releases it."""

    def __init__(self, cfg: AgentConfig, sample: Sample, k: int, released: list[tuple[int, int]]) -> None:
        self.cfg, self.sample, self.episode, self.released = cfg, sample, k, released
        self.turns, self.exit, self.answer, self.detail = [], None, None, ""
        self.format_errors = self.tokens_in = self.tokens_out = 0
        self.seconds, self._prepared = 0.0, None

    def prepare(self) -> Prepared | None:
        if self.exit is None and self._prepared is None:
            text = f"echo {self.sample.id}/{self.episode}/{len(self.turns)}"
            seed = turn_seed(self.cfg.sampling.seed, self.sample.key, self.episode, len(self.turns))
            self._prepared = Prepared(text, encode(text), seed, 8, {"step": "echo"})
        return self._prepared

    def feed(self, raw: str, n_tokens: int, wall_s: float, truncated: bool = False) -> dict:
        p = self._prepared
        assert p is not None
        self._prepared = None
        self.tokens_in, self.tokens_out, self.seconds = self.tokens_in + len(p.ids), self.tokens_out + n_tokens, \
            self.seconds + wall_s
        rec = {"turn": len(self.turns), "seed": p.seed, "prompt_sha": sha(p.text), "raw": raw, "tokens_out": n_tokens,
               "wall_s": wall_s}
        if len(self.turns) == 1:
            self.answer = raw
            self._end("submitted", "")
        return self._close_turn(rec, "generation")

    def replay(self, rec: dict) -> None:
        self.feed(rec["raw"], rec["tokens_out"], rec["wall_s"])

    def summary(self) -> dict:
        return {"episode": self.episode, "exit": self.exit, "detail": self.detail, "answer": self.answer,
                "turns": len(self.turns), "tokens_in": self.tokens_in, "tokens_out": self.tokens_out,
                "seconds": round(self.seconds, 4)}

    def discard(self) -> None:
        self.released.append((self.sample.id, self.episode))


def test_the_lockstep_loop_drives_any_episode_of_the_one_shape(toy_repo: Path, tmp_path: Path, monkeypatch):
    """Issue 42, item 2: the loop knows the episode's shape (BaseEpisode), never which policy it holds: a policy of
    its own runs, resumes from its transcripts after a kill (its own turns replayed, none generated again) and is
    released (discard) at the end of each run, killed or not, as the bash policy's layers are."""
    from mlbench_kit.agent import run as agent_run
    released: list[tuple[int, int]] = []
    monkeypatch.setattr(agent_run, "new_episode", lambda cfg, s, k, *_: Echo(cfg, s, k, released))

    def reply(prompt: str, seed: int) -> str:
        return prompt.upper()
    _run(toy_repo, tmp_path / "whole", Scripted(reply), rows=(SAMPLE, OTHER))
    assert [r["output"] for r in _rows(tmp_path / "whole")] == [["ECHO 1/0/1", "ECHO 1/1/1"],
                                                                 ["ECHO 2/0/1", "ECHO 2/1/1"]]
    assert sorted(released) == [(1, 0), (1, 1), (2, 0), (2, 1)]
    released.clear()
    with pytest.raises(Killed):
        _run(toy_repo, tmp_path / "part", KillAfter(reply, 1), rows=(SAMPLE, OTHER))
    assert len(released) == 4  # released on the way out of a killed run too
    again = Scripted(reply)
    _run(toy_repo, tmp_path / "part", again, rows=(SAMPLE, OTHER))
    assert _transcripts(tmp_path / "part") == _transcripts(tmp_path / "whole")
    assert _rows(tmp_path / "part") == _rows(tmp_path / "whole") and again.sizes == [4]  # only the second turns


def test_a_torn_transcript_line_is_redone(toy_repo: Path, tmp_path: Path):
    _run(toy_repo, tmp_path / "whole", Scripted(gold_reader))
    with pytest.raises(Killed):
        _run(toy_repo, tmp_path / "part", KillAfter(gold_reader, 2))
    f = tmp_path / "part" / "transcripts" / "9-1" / "ep0.jsonl"
    with f.open("a") as fh:
        fh.write('{"turn": 2, "step": "read_a')  # killed mid-write
    _run(toy_repo, tmp_path / "part", Scripted(gold_reader))
    assert _transcripts(tmp_path / "part") == _transcripts(tmp_path / "whole")


def test_a_transcript_from_another_repository_is_refused(toy_repo: Path, tmp_path: Path):
    with pytest.raises(Killed):
        _run(toy_repo, tmp_path / "part", KillAfter(gold_reader, 2))
    (toy_repo / "README.md").write_text("# changed\n")
    with pytest.raises(MLBenchError, match="does not replay"):
        _run(toy_repo, tmp_path / "part", Scripted(gold_reader))


def test_engine_requests_carry_turn_seeds(toy_repo: Path, tmp_path: Path):
    got = []

    class Recorder(Scripted):
        def generate(self, requests, params):
            got.extend(r.seed for r in requests)
            return super().generate(requests, params)
    _run(toy_repo, tmp_path / "run", Recorder(gold_reader))
    want = {turn_seed(42, SAMPLE.key, e, t) for e in range(2) for t in range(4)}
    assert set(got) == want


def test_no_symlink_is_followed_even_in_the_index(toy_repo: Path):
    view = RepoView(toy_repo, "toy")
    text, _ = view.index("./examples/inner", 10_000)
    assert "secret" not in text.lower() and "examples/inner/" not in text
    assert os.path.islink(toy_repo / "escape.py")


def test_a_hostile_tarball_is_refused_before_anything_is_written(tmp_path: Path):
    """--tarballs are untrusted: a member that climbs out of the repository's folder is refused with the member
    named, and nothing is written outside (nor the checkout published)."""
    import io
    import tarfile

    from mlbench_kit.agent.run import checkouts
    from mlbench_kit.errors import MLBenchError
    tars = tmp_path / "tars"
    tars.mkdir()
    with tarfile.open(tars / "toy.tar.gz", "w:gz") as tf:
        for name, data in (("toy/README.md", b"# toy\n"), ("toy/../../escaped.txt", b"pwned\n")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    out = tmp_path / "out"
    args = AgentConfig(tarballs=str(tars))
    with pytest.raises(MLBenchError, match=r"toy/\.\./\.\./escaped\.txt"):
        checkouts(args, {"toy"}, out)
    assert not list(tmp_path.rglob("escaped.txt")) and not (out / "checkouts" / "toy").exists()


# ----------------------------------------------------------------------------------------- steps 1-2 (option)


@pytest.fixture
def pool(toy_repo: Path, tmp_path: Path) -> dict:
    other = tmp_path / "repos" / "other"
    other.mkdir()
    (other / "README.md").write_text("# other\n![badge](x.svg)\n\nA library for\n  speech synthesis.\n\nMore.\n")
    return {"other": (RepoView(other, "other"), "https://github.com/x/other", RepoView(other, "other").description()),
            "toy": (RepoView(toy_repo, "toy"), "https://github.com/y/toy", RepoView(toy_repo, "toy").description())}


def ranker(first: str):
    """Keywords, then a ranking with ``first`` on top; step 3 says No to `other` and Yes to `toy`, then CODE."""
    def policy(prompt: str, seed: int) -> str:
        if prompt.startswith("Please help me extract the keywords"):
            return '{"keywords": ["learning rate", "examples/a"]}'
        if prompt.startswith("Sort the names and descriptions"):
            return json.dumps({"ranked_repos": [first, "https://github.com/y/toy"]})
        if prompt.startswith("I will provide you with the name"):
            if "repo_name: other" in prompt:
                return '{"task_flag": "No"}'
            return '{"task_flag": "Yes", "ranked_readmefiles": ["toy/examples/a/README.md"]}'
        return '{"flag": "CODE", "code": "python main.py --lr 0.1"}'
    return policy


def test_steps_1_to_4_rank_the_repositories_then_try_them_in_turn(pool: dict, toy_repo: Path):
    cfg = _cfg()
    cfg.steps = "1-4"
    ep = Episode(SAMPLE, RepoView(toy_repo, "toy"), cfg, 0, encode, 1_000_000, pool=pool)
    prompts = []

    def policy(prompt: str, seed: int) -> str:
        prompts.append(prompt)
        return ranker("https://github.com/x/other/")(prompt, seed)
    drive(ep, policy)
    assert (ep.exit, ep.answer, ep.summary()["repository"]) == ("submitted", "python main.py --lr 0.1", "toy")
    assert [t["step"] for t in ep.turns] == ["keywords", "rank", "plan", "plan", "code_or_file"]
    assert ep.turns[1]["action"]["resolved"] == ["other", "toy"]
    assert [t["inputs"].get("repo") for t in ep.turns[2:4]] == ["other", "toy"]
    # the candidates: URL and the main README's first prose paragraph (headings and badges left out)
    assert "{learning rate, examples/a}" in prompts[1]
    assert "'https://github.com/x/other': A library for speech synthesis." in prompts[1]
    assert "'https://github.com/y/toy': Run examples/a/main.py." in prompts[1]


def test_steps_1_to_4_every_repository_rejected_and_an_unknown_ranking(pool: dict, toy_repo: Path):
    cfg = _cfg()
    cfg.steps = "1-4"
    ep = drive(Episode(SAMPLE, RepoView(toy_repo, "toy"), cfg, 0, encode, 1_000_000, pool=pool),
               lambda p, s: ranker("nowhere")(p, s) if not p.startswith("I will provide you with the name")
               else '{"task_flag": "No"}')
    assert ep.exit == "rejected" and "every ranked repository" in ep.detail
    assert ep.turns[1]["action"]["resolved"] == ["toy"]  # the unknown name dropped
    ep = drive(Episode(SAMPLE, RepoView(toy_repo, "toy"), cfg, 0, encode, 1_000_000, pool=pool),
               lambda p, s: '{"ranked_repos": ["../../etc"]}' if p.startswith("Sort") else ranker("x")(p, s))
    assert ep.turns[1]["action"]["fallback"] and ep.turns[1]["action"]["resolved"] == ["other", "toy"]
    assert ep.exit == "submitted"
    with pytest.raises(MLBenchError, match="steps: 1-4"):
        cfg = AgentConfig(policy="bash", steps="1-4")
        cfg.check(lambda key: key)


def test_steps_1_and_2_are_the_papers_tables_20_and_21(shared: Path, pool: dict, toy_repo: Path):
    paper = _words((shared / "paper" / "ml-bench-paper.txt").read_text())
    t20 = paper[paper.index("Please help me extract the keywords"): paper.index("Table 20:")]
    t21 = paper[paper.index("Sort the names and descriptions"): paper.index("Example Below is an example")]
    cfg = _cfg()
    cfg.steps = "1-4"
    ep = Episode(SAMPLE, RepoView(toy_repo, "toy"), cfg, 0, encode, 1_000_000, pool=pool)
    assert _words(ep.prepare().text).startswith(t20[: t20.index("Sentence :")] + f"Sentence :{SAMPLE.instruction}")
    ep.feed('{"keywords": ["lr"]}', 5, 0.1)
    sent = _words(ep.prepare().text)
    assert sent.startswith(t21[: t21.index("{keyword}")] + "{lr}. URLS: {")
    assert "} Make sure your answer is in standard json format, start!" in sent


def test_rows_of_a_split_file_select_those_rows_and_bad_lines_are_errors(tmp_path: Path):
    """`--rows-of FILE` keeps the rows a JSONL file names (prep's split file: the real loop's test rows), in the
    data's order; a line without github_id and id, or a row the data lacks, is one error at file:line."""
    from conftest import SAMPLE

    from mlbench_kit.agent.run import select_rows
    from mlbench_kit.dataset import load_samples
    data = SAMPLE / "samples.jsonl"
    every = load_samples(data)
    picked = [every[-1], every[0]]
    keys = tmp_path / "test.jsonl"
    keys.write_text("".join(json.dumps({"github_id": s.github_id, "id": s.id, "prompt": "..."}) + "\n"
                            for s in picked) + "\n")
    args = AgentConfig(data=str(data), rows_of=str(keys))
    assert [s.key for s in select_rows(args)] == [every[0].key, every[-1].key]
    keys.write_text(json.dumps({"github_id": 1}) + "\n")
    with pytest.raises(MLBenchError) as e:
        select_rows(args)
    assert f"{keys}:1" in str(e.value)
    keys.write_text(json.dumps({"github_id": 99999, "id": 1}) + "\n")
    with pytest.raises(MLBenchError, match="not in --data"):
        select_rows(args)


def test_the_openai_backend_needs_a_tokenizer_and_a_key_off_this_machine(tmp_path: Path, monkeypatch):
    """backend openai: prompts go as token ids, so --tokenizer is required (one error naming it); a server that is
    not this machine's needs the key from the environment variable the config names (no request is sent)."""
    from conftest import SAMPLE, run_cli

    from mlbench_kit.engine import Endpoint, EngineSpec, is_loopback, make_engine
    r = run_cli("mlbench", "agent", "--backend", "openai", "--model", "served", "--data", SAMPLE / "samples.jsonl",
                "--repos-dir", SAMPLE / "repos", "--out", tmp_path / "out")
    assert r.returncode == 2 and "--tokenizer" in r.stderr and "token ids" in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()
    assert is_loopback("http://127.0.0.1:8000/v1") and is_loopback("http://localhost:1/v1")
    assert not is_loopback("https://127.example.com/v1") and not is_loopback("https://api.example.com/v1")
    monkeypatch.delenv("MLBENCH_TEST_KEY", raising=False)
    with pytest.raises(MLBenchError, match="MLBENCH_TEST_KEY"):
        make_engine(EngineSpec("openai", "m", endpoint=Endpoint("https://api.example.com/v1",
                                                                api_key_env="MLBENCH_TEST_KEY")))
    loopback = Endpoint("http://127.0.0.1:9/v1", api_key_env="MLBENCH_TEST_KEY")
    make_engine(EngineSpec("openai", "m", endpoint=loopback)).close()  # loopback: no key needed


# ------------------------------------------------------------------------------------------------ README window


def test_the_readme_window_is_chosen_by_relevance(toy_repo: Path):
    """A README over the cap shows its sections that match the task (in the README's order, each gap said), not its
    beginning; ``prefix`` keeps the beginning. The whole prompt is compared."""
    intro = "# toy\n" + "An introduction to the toy models. " * 40 + "\n"
    other = "## Convolution usage\n```python\n# a comment, not a heading\nfrom toy.conv import Conv\n```\n"
    wanted = "## Halo attention usage\n```python\nfrom toy.halo import Halo\n```\n"
    readme = intro + other + wanted
    (toy_repo / "README.md").write_text(readme)
    cfg = _cfg()
    cfg.read.max_readme_chars = len(wanted) + 20  # the wanted section fits, not with another one
    sample = Sample(github_id=9, id=1, repo="toy", path="./examples/a", arguments={}, instruction="Use the Halo "
                    "attention of toy on an input of (50, 512, 7, 7).", oracle="", type="Python Code", output="")
    ep = Episode(sample, RepoView(toy_repo, "toy"), cfg, 0, encode, 1_000_000)
    shown = (f"[... {len(intro) + len(other)} characters not shown ...]\n{wanted}")
    assert ep.prepare().text == (
        f"{P.PLAN.format(repo_name='toy', readme=shown, instruction=sample.instruction)}"
        "\nreadme_files need to be sorted: toy/README.md, toy/examples/a/README.md"
        f"{P.FUNCTION_LINE.format(function=json.dumps(P.FUNCTIONS['plan']))}")
    cfg.read.readme_window = "prefix"
    ep = Episode(sample, RepoView(toy_repo, "toy"), cfg, 0, encode, 1_000_000)
    cap = cfg.read.max_readme_chars
    prefix = f"main_readmefile: {readme[:cap]}\n[... {len(readme) - cap} more characters not shown]\n"
    assert prefix in ep.prepare().text


def test_the_readme_window_holds_what_each_external_attention_row_imports(shared: Path):
    """All 24 External-Attention-pytorch rows: the module the gold answer imports (``from model.X import``) first
    appears 13,000+ characters into the README, past the old 8,000-character prefix; the window shown at step 3 and
    at step 4 holds it at the default cap."""
    rows = [s for s in load_samples(shared / "full.jsonl") if s.repo == "External-Attention-pytorch"]
    view = RepoView(shared / "readmes" / "External-Attention-pytorch", "External-Attention-pytorch")
    readme = view.read("README.md")
    assert len(rows) == 24
    for s in rows:
        module = re.search(r"^from (model\.\S+) import", s.output, re.M)
        assert module is not None, s.output[:200]
        assert readme.index(module[1]) > AgentConfig().read.max_readme_chars  # the old window could not show it
        ep = Episode(s, view, AgentConfig(), 0, encode, 1_000_000)
        assert module[1] in ep.prepare().text, (s.id, s.instruction)
        ep.feed('{"task_flag": "Yes", "ranked_readmefiles": ["External-Attention-pytorch/README.md"]}', 5, 0.1)
        step4 = ep.prepare().text
        assert ep.step == "code_or_file" and module[1] in step4.split("readmefile: ", 1)[1], (s.id, s.instruction)


# ----------------------------------------------------------------------------------------------- paper fidelity


def test_each_step_sends_its_function_with_the_papers_captions_as_valid_json(shared: Path, toy_repo: Path):
    """Every prompt of the FILE path, whole: the released prompt, then the step's function as JSON (it parses, and
    its descriptions are Table 22's caption and Table 23's); write_code gets the README's path (the released
    code_function prompt); ``fields`` and ``text`` keep the old format line and the README's text."""
    paper = _words((shared / "paper" / "ml-bench-paper.txt").read_text())
    caption22 = paper[paper.index("Table 22: ") + 10: paper.index("Instruction I will provide you with a github")]
    caption23 = paper[paper.index("Table 23: ") + 10: paper.index("M Examples of input-output")]
    plan = P.FUNCTIONS["plan"]
    props = plan["parameters"]["properties"]
    assert _words(" ".join([plan["description"], props["task_flag"]["description"],
                            props["ranked_readmefiles"]["description"]])) == caption22.strip()
    assert P.FUNCTIONS["code_or_file"]["description"] == caption23.strip()
    ep = _episode(toy_repo)
    readme, inner = (toy_repo / "README.md").read_text(), (toy_repo / "examples/a/README.md").read_text()
    index = "\n".join(["examples/a/README.md", "examples/a/main.py", "README.md", "big.py", "blob.bin"])
    main_py = (toy_repo / "examples/a/main.py").read_text()

    def sent(step: str, prompt: str) -> str:
        return prompt + ("\n\nAnswer by calling this function: reply with one JSON object holding its arguments "
                         "(every required field, each a string or, where its description asks for one, a list of "
                         f"strings) and nothing else.\n{json.dumps(P.FUNCTIONS[step])}")
    expected = [
        sent("plan", P.PLAN.format(repo_name="toy", readme=readme, instruction=SAMPLE.instruction)
             + "\nreadme_files need to be sorted: toy/README.md, toy/examples/a/README.md"),
        sent("code_or_file", P.CODE_OR_FILE.format(index=index, readme=inner, instruction=SAMPLE.instruction)),
        sent("read_args", P.READ_ARGS.format(py_file=main_py)),
        sent("write_code", P.WRITE_CODE.format(readme="toy/examples/a/README.md", args="p.add_argument('--lr')",
                                               instruction=SAMPLE.instruction)),
    ]
    prompts = []
    while (p := ep.prepare()) is not None:
        prompts.append(p.text)
        ep.feed(gold_reader(p.text, p.seed), 10, 0.01)
    assert prompts == expected and ep.answer == "python main.py --lr 0.1"
    for text in prompts:
        json.loads(text.rsplit("\n", 1)[1])  # the function line is valid JSON
    # the first versions' choices, by name
    cfg = _cfg()
    cfg.answer_format, cfg.write_code_readme = "fields", "text"
    ep = _episode(toy_repo, cfg)
    old = []
    while (p := ep.prepare()) is not None:
        old.append(p.text)
        ep.feed(gold_reader(p.text, p.seed), 10, 0.01)
    assert old[3] == (P.WRITE_CODE.format(readme=inner, args="p.add_argument('--lr')", instruction=SAMPLE.instruction)
                      + P.FORMAT_LINE.format(schema=P.FORMAT["write_code"]))
    assert old[0].endswith(P.FORMAT_LINE.format(schema=P.FORMAT["plan"]))


def test_a_cost_budget_is_counted_by_the_harness_and_no_turn_that_could_pass_it_is_sent(toy_repo: Path):
    """``limits.max_episode_cost`` at ``prompt_price``/``completion_price`` (per million tokens): each summary
    carries its cost; the turn that would pass the budget gets only the new tokens it can afford, and a turn
    that cannot afford one is never sent (``cost_limit``); a budget without prices is refused."""
    free = drive(_episode(toy_repo, _cfg()), looper)
    p0, p1 = free.turns[0]["tokens_in"], free.turns[1]["tokens_in"]
    cfg = _cfg(prompt_price=1e6, completion_price=2e6)  # 1 per prompt token, 2 per new token
    cfg.limits.max_episode_tokens = 10_000
    cfg.limits.max_episode_cost = p0 + 2 * 10 + p1 + 2 * 4  # the second turn can afford 4 new tokens, not 10
    ep = _episode(toy_repo, cfg)
    caps = []
    while (p := ep.prepare()) is not None:
        caps.append(p.max_new_tokens)
        ep.feed(looper("".join(map(chr, p.ids)), p.seed), min(10, p.max_new_tokens), 0.01)
    assert caps[:2] == [cfg.sampling.max_new_tokens, 4] and (ep.exit, len(ep.turns)) == ("cost_limit", 2)
    assert ep.summary()["cost"] == ep.cost() == p0 + 20 + p1 + 8
    assert "cost" not in free.summary()
    starved = _cfg(prompt_price=1e6, completion_price=2e6)
    starved.limits.max_episode_cost = p0  # the first prompt alone spends it: nothing is sent
    ep = drive(_episode(toy_repo, starved), looper)
    assert (ep.exit, ep.turns) == ("cost_limit", []) and "would pass the limit" in ep.detail
    with pytest.raises(MLBenchError, match="prices that are not both 0"):
        stage_config("agent", ["--set", "limits.max_episode_cost=1.0"])


def test_no_turn_cap_runs_the_released_loop_and_prompt_tokens_count(toy_repo: Path, tmp_path: Path):
    """``max_turns: null`` (configs/agent/paper.yaml): the loop runs to its own end, 1 + 3 calls for each of the
    R ranked READMEs; a total-token limit counts the prompts too and sends no prompt that would pass it."""
    paper = stage_config("agent", ["--config", str(Path(__file__).resolve().parents[2] / "configs/agent/paper.yaml")])
    assert paper.limits.max_turns is None
    ep = drive(_episode(toy_repo, paper), looper)
    assert (ep.exit, len(ep.turns)) == ("no_answer", 1 + 3 * 2)
    ep = drive(_episode(toy_repo, _cfg()), looper)
    assert (ep.exit, len(ep.turns)) == ("no_answer", 7)  # under 10 turns: the same
    capped = drive(_episode(toy_repo, _cfg(max_turns=5)), looper)
    assert (capped.exit, len(capped.turns)) == ("turn_limit", 5)
    cfg = _cfg(max_episode_total_tokens=ep.turns[0]["tokens_in"] + 10 + ep.turns[1]["tokens_in"] + 5)
    cfg.limits.max_episode_tokens = 10_000
    ep = drive(_episode(toy_repo, cfg), looper)  # one token per character: the second prompt gets 5 new tokens
    assert (ep.exit, len(ep.turns)) == ("token_limit", 2) and "leave no room" in ep.detail
    f = tmp_path / "bash.yaml"
    f.write_text("policy: bash\nlimits:\n  max_turns: null\n")
    with pytest.raises(MLBenchError, match=rf"{re.escape(str(f))}:3.*no turn cap"):
        stage_config("agent", ["--config", str(f)])
