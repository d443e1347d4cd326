"""The ``bash`` policy (ML-Agent-Bench offline) on the embedded sample's toybench repository, in the real bwrap
sandbox. The model is a scripted reply list wherever the engine is not what is under test: the harness (actions,
files kept between them, limits, transcripts, resume, the OpenHands rule) is."""

from __future__ import annotations

import json
import os
import random
import shlex
import shutil
from pathlib import Path

import psutil
import pytest
from conftest import REPO_ROOT, SAMPLE

from mlbench_kit.agent.bash import BashEpisode, observation, parse_action
from mlbench_kit.agent.parse import FormatError
from mlbench_kit.agent.run import run_episodes, summarize
from mlbench_kit.agent_config import AgentConfig
from mlbench_kit.dataset import Sample, load_samples
from mlbench_kit.engine import Generated
from mlbench_kit.envspec import EnvConfig
from mlbench_kit.sandbox import ExecResult, Sandbox

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")
ENVS = REPO_ROOT / "configs" / "eval" / "sample.yaml"
REPO = "toybench"
ROWS = [s for s in load_samples(SAMPLE / "samples.jsonl") if s.repo == REPO][:3]
CHECKOUT = SAMPLE / "repos" / REPO


def encode(x: str | list[dict[str, str]]) -> list[int]:
    """One token per character of the conversation's JSON: the scripted engine reads it back."""
    return [ord(c) for c in (x if isinstance(x, str) else json.dumps(x))]


def bash(cmd: str) -> str:
    return f"Let me run this.\n```bash\n{cmd}\n```"


class Replies:
    """A fixed reply list per episode: ``script(messages, sample) -> reply`` from the conversation so far."""

    def __init__(self, script, rows=ROWS) -> None:
        self.script, self.sizes, self.rows = script, [], rows

    def generate(self, requests, params):
        self.sizes.append(len(requests))
        out = []
        for r in requests:
            messages = json.loads("".join(map(chr, r.token_ids)))
            text = self.script(messages, next(s for s in self.rows if s.instruction in messages[0]["content"]))
            out.append([Generated(text, min(10, r.max_new_tokens or params.max_new_tokens))])  # an engine's count
        return out

    def close(self) -> None:
        pass


def gold_writer(messages, sample: Sample) -> str:
    """Reads the README, writes the row's gold answer as run.sh, then submits."""
    if len(messages) == 1:
        return bash("head -3 README.md")
    if len(messages) == 3:
        assert "<returncode>0</returncode>" in messages[-1]["content"] and "toybench" in messages[-1]["content"]
        return bash(f"printf '%s\\n' {shlex.quote(sample.output)} > run.sh")
    return bash("submit")


def _cfg(**bash) -> AgentConfig:
    cfg = AgentConfig(policy="bash", episodes=2)
    cfg.bash.action_wall_s = 10
    for k, v in bash.items():
        setattr(cfg.bash, k, v)
    return cfg


@pytest.fixture(scope="module", params=["bwrap", pytest.param("docker", marks=pytest.mark.integration)])
def box(request):
    """bwrap keeps an episode's files through its stage script's overlay; docker through its runner (the changes
    sent back as a tar): the same tests hold for both."""
    if request.param == "docker":
        request.getfixturevalue("docker_base")  # a daemon (started if none runs), the sample's base image loaded
    envs = EnvConfig(ENVS)
    with Sandbox(request.param) as sb:
        yield sb, envs


def _run(box, out: Path, script, cfg: AgentConfig | None = None, rows=ROWS, max_model_len: int = 10**6):
    engine = Replies(script, rows)
    stats = run_episodes(cfg or _cfg(), list(rows), {REPO: CHECKOUT}, lambda: engine, encode, max_model_len, out,
                         {"model": "scripted", "adapter": None, "backend": "scripted"}, box=box)
    return stats, engine


def _rows(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "generations.jsonl").read_text().splitlines()]


def _layers(box) -> list[Path]:
    d = box[0].root / "layers"
    return list(d.iterdir()) if d.is_dir() else []


def test_gold_run_sh_is_the_answer_and_passes_the_openhands_rule(box, tmp_path: Path):
    stats, engine = _run(box, tmp_path / "run", gold_writer)
    assert stats["exits"] == {"submitted": 6} and engine.sizes == [6, 6, 6]  # lockstep: every episode's turn at once
    rows = {(r["github_id"], r["id"]): r for r in _rows(tmp_path / "run")}
    for s in ROWS:
        r = rows[s.key]
        assert r["output"] == [s.output + "\n"] * 2
        for e in r["agent"]["episodes"]:
            assert (e["exit"], e["turns"], e["openhands"]["passed"], e["openhands"]["exit_code"]) == \
                ("submitted", 3, True, 0)
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["openhands"]["success_rate"] == 1.0 and summary["openhands"]["scored"] == 6
    t = [json.loads(x) for x in (tmp_path / "run" / "transcripts" / "101-9001" / "ep0.jsonl").read_text().splitlines()]
    assert t[0]["action"] == {"kind": "bash", "command": "head -3 README.md"} and t[0]["exec"]["exit_code"] == 0
    assert "exit" not in t[1] and t[2]["action"] == {"kind": "submit"}  # run.sh written: the episode goes on
    assert t[2]["exit"] == "submitted" and t[-1]["end"]["openhands"]["passed"]
    assert _layers(box) == []  # each episode's layer is removed when it ends
    # eval reads the agent's generations as it reads infer's
    from mlbench_kit.eval.generations import load_generations
    gens = load_generations(tmp_path / "run" / "generations.jsonl", {s.key: s for s in ROWS})
    assert gens.n == 2


@pytest.mark.parametrize("mode", ["compat", "strict"])
def test_the_agents_verdicts_equal_the_gold_verdicts(box, tmp_path: Path, mode: str):
    """The run.sh the scripted agent wrote holds each row's gold answer: `mlbench eval` gives its generations the
    verdicts `mlbench eval --gold` gives the rows."""
    from mlbench_kit.cli import main
    cfg = _cfg(openhands_check=False)
    cfg.episodes = 1
    _run(box, tmp_path / "agent", gold_writer, cfg)
    rows_file = tmp_path / "rows.jsonl"
    rows_file.write_text("".join(line + "\n" for line in (SAMPLE / "samples.jsonl").read_text().splitlines()
                                 if any(f'"id": {s.id},' in line for s in ROWS)))
    common = ["--data", str(rows_file), "--envs", str(ENVS), "--mode", mode, "--no-ci", "--k", "1"]
    assert main(["eval", *common, "--generations", str(tmp_path / "agent" / "generations.jsonl"),
                 "--out", str(tmp_path / "eval")]) == 0
    assert main(["eval", *common, "--gold", "--out", str(tmp_path / "gold")]) == 0

    def verdicts(run: Path) -> dict:
        return {(r["github_id"], r["id"]): (r["passed"], r["error_class"])
                for r in map(json.loads, (run / "results.jsonl").read_text().splitlines())}
    assert verdicts(tmp_path / "eval") == verdicts(tmp_path / "gold") and len(verdicts(tmp_path / "gold")) == 3


def _eval(rows: list[Sample], generations: Path, out: Path, mode: str) -> dict:
    """``mlbench eval`` of ``generations`` (one output a row) on ``rows`` of the sample: each row's verdict by id."""
    from mlbench_kit.cli import main
    rows_file = out.with_suffix(".rows.jsonl")
    rows_file.write_text("".join(line + "\n" for line in (SAMPLE / "samples.jsonl").read_text().splitlines()
                                 if any(f'"id": {s.id},' in line for s in rows)))
    assert main(["eval", "--data", str(rows_file), "--envs", str(ENVS), "--mode", mode, "--no-ci", "--k", "1",
                 "--generations", str(generations), "--out", str(out)]) == 0
    return {r["id"]: r["passed"] for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}


def test_run_sh_is_scored_by_what_it_runs(box, tmp_path: Path):
    """Python Code rows answered by a run.sh that works (a heredoc; a Python file an earlier action wrote) pass
    compat and strict, as does a Bash Script row's command; the gold Python text saved as run.sh, which `bash run.sh`
    cannot run, passes neither (nor the openhands rule): the answer is what run.sh runs."""
    by_id = {s.id: s for s in load_samples(SAMPLE / "samples.jsonl")}
    heredoc, from_file, broken, command = by_id[9016], by_id[9017], by_id[9018], by_id[9001]
    rows = [heredoc, from_file, broken, command]

    def script(messages, sample):
        write = {heredoc.id: f"printf '%s\\n' \"python - <<'EOF'\" {shlex.quote(sample.output)} EOF > run.sh",
                 from_file.id: f"printf '%s\\n' {shlex.quote(sample.output)} > task.py && echo python task.py > run.sh",
                 broken.id: f"printf '%s\\n' {shlex.quote(sample.output)} > run.sh",
                 command.id: f"echo {shlex.quote(sample.output)} > run.sh"}[sample.id]
        return [bash(write), bash("bash run.sh"), bash("submit")][len(messages) // 2]
    cfg = _cfg()
    cfg.episodes = 1
    _run(box, tmp_path / "agent", script, cfg, rows=rows)
    eps = {r["id"]: r["agent"]["episodes"][0] for r in _rows(tmp_path / "agent")}
    assert {i: (e["exit"], e["answer_kind"], e["openhands"]["passed"]) for i, e in eps.items()} == {
        heredoc.id: ("submitted", "python", True), from_file.id: ("submitted", "python", True),
        broken.id: ("submitted", "unscorable", False), command.id: ("submitted", "shell", True)}
    assert [eps[s.id]["answer"] for s in rows] == [heredoc.output + "\n", from_file.output + "\n", "",
                                                  command.output + "\n"]
    assert eps[broken.id]["run_sh"] == broken.output + "\n"
    for mode in ("compat", "strict"):
        got = _eval(rows, tmp_path / "agent" / "generations.jsonl", tmp_path / f"eval-{mode}", mode)
        assert got == {heredoc.id: True, from_file.id: True, broken.id: False,
                                                        command.id: True}, (mode, got)


def test_real_rows_run_sh_answers_are_what_they_run(shared: Path):
    """Every row of the real benchmark, both kinds: its gold Python run from a heredoc run.sh is the gold answer
    (the benchmark's checks give it the gold's verdict, compat and strict); the gold Python text saved as run.sh is
    not scorable (it passes no check); a Bash Script row's gold command as run.sh is the gold answer."""
    from mlbench_kit.agent.runsh import read_runsh
    from mlbench_kit.eval.checks import check_output

    def static(out: str, s: Sample, mode: str) -> bool:
        c = check_output(out, s.arguments, s.type, mode)
        return c.params_ok and c.type_ok
    samples = load_samples(shared / "full.jsonl")
    kinds = {t: [s for s in samples if s.type == t] for t in ("Python Code", "Bash Script")}
    assert len(kinds["Python Code"]) == 89 and len(kinds["Bash Script"]) == 171
    for s in kinds["Python Code"]:
        ran = read_runsh(f"#!/bin/bash\npython3 <<'PY'\n{s.output}\nPY\n", "x", lambda p: None)
        assert (ran.kind, ran.answer) == ("python", s.output + "\n"), s.key
        assert read_runsh(s.output, "x", lambda p: None).kind == "unscorable", s.key
        for mode in ("compat", "strict"):
            assert static(ran.answer, s, mode) == static(s.output, s, mode) and not static("", s, mode), s.key
    for s in kinds["Bash Script"]:
        ran = read_runsh(s.output + "\n", "x", lambda p: None)
        assert ran.answer in (s.output + "\n", "") and (ran.answer == "") == (ran.kind == "unscorable"), s.key
        for mode in ("compat", "strict"):
            assert static(ran.answer, s, mode) == static(s.output, s, mode), s.key


def test_the_run_sh_reader_on_fixed_strings():
    from mlbench_kit.agent.runsh import read_runsh
    own = {"sub/t.py": "print(2)\n"}.get
    cases = {
        "python - <<'EOF'\nprint(1)\nEOF\n": ("python", "print(1)\n"),
        "#!/bin/bash\nset -euo pipefail\ncd /sandbox/work/sub\npython3 -u <<-EOF\n\tprint(1)\n\tEOF\n": ("python",
                                                                                                "print(1)\n"),
        "python t.py": ("python", "print(2)\n"),  # the episode's own file
        "cat <<'E' > a.py\nprint(3)\nE\npython a.py\n": ("python", "print(3)\n"),
        "python -c 'print(4)'": ("python", "print(4)"),
        "python <<EOF\nprint('$HOME')\nEOF\n": ("unscorable", ""),  # bash expands it: not this text
        "python - <<'EOF'\nprint(1)\n": ("unscorable", ""),  # never closed
        "cat > a.py <<'E'\nx\nE\ncat > b <<'E'\ny\nE\npython a.py": ("shell", "cat > a.py <<'E'\nx\nE\ncat > b "
                                                                        "<<'E'\ny\nE\npython a.py"),  # b is read
        "python - <<'EOF'\nprint(1)\nEOF\necho a.sh \n": ("shell", "python - <<'EOF'\nprint(1)\nEOF\necho a.sh \n"),
        "python train.py --lr 0.1": ("shell", "python train.py --lr 0.1"),
        "python missing.py": ("unscorable", ""),
        "python ../t.py": ("unscorable", ""),
    }
    for text, want in cases.items():
        got = read_runsh(text, "sub", own)
        assert (got.kind, got.answer) == want, text


def test_a_bash_transcript_reproduces_every_conversation_the_model_saw(box, tmp_path: Path, capsys):
    """The task message on turn 0, then each reply and its feedback (an observation, a format error, a submit
    without run.sh): rebuilt from the transcript, each turn's conversation is the one the engine got."""
    from mlbench_kit.cli import main
    seen: list[list[dict]] = []

    def script(messages, sample):
        seen.append(messages)
        return ["no block", bash("submit"), bash("echo ok > run.sh"), bash("submit")][len(messages) // 2]
    cfg = _cfg(openhands_check=False)
    cfg.episodes = 1
    _run(box, tmp_path / "run", script, cfg, rows=ROWS[:1])
    t = [json.loads(x) for x in (tmp_path / "run" / "transcripts" / "101-9001" / "ep0.jsonl").read_text().splitlines()]
    turns = [r for r in t if "turn" in r]
    rebuilt = list(turns[0]["messages"])
    for i, r in enumerate(turns):
        assert rebuilt == seen[i], i
        rebuilt += [{"role": "assistant", "content": r["raw"]}, {"role": "user", "content": r.get("observation")}]
    assert len(seen) == 4 and turns[-1]["exit"] == "submitted"
    assert main(["agent", "show", str(tmp_path / "run"), "--row", "101-9001"]) == 0
    shown = capsys.readouterr().out
    assert "Format error" in shown and "does not exist" in shown and "[run.sh (its answer: unscorable)]" in shown


def test_files_persist_between_actions_processes_do_not(box, tmp_path: Path):
    marker = "31337.5"

    def script(messages, sample):
        return [bash(f"mkdir -p notes && echo kept > notes/a.txt && rm README.md; sleep {marker} & echo started"),
                # a file and a folder of the earlier action, written by it (each action may run as a uid of its own)
                bash("echo more >> notes/a.txt && touch notes/b && cat notes/a.txt; ls README.md; "
                     "grep -l sleep /proc/[0-9]*/cmdline | wc -l"),  # no ps in images
                bash("echo done"),
                ][len(messages) // 2]
    cfg = _cfg()
    cfg.limits.max_turns = 3
    cfg.episodes = 1
    _run(box, tmp_path / "run", script, cfg, rows=ROWS[:1])
    t = [json.loads(x) for x in (tmp_path / "run" / "transcripts" / "101-9001" / "ep0.jsonl").read_text().splitlines()]
    obs = t[1]["observation"]
    assert "kept\nmore\n" in obs and "No such file" in obs  # the file written, the file removed: both kept
    assert obs.endswith("\n1\n</output>")  # only grep itself: the sleep did not survive
    assert t[2]["exit"] == "turn_limit" and t[-1]["end"]["openhands"] is None
    assert not any(marker in " ".join(p.info["cmdline"] or []) for p in psutil.process_iter(["cmdline"]))
    assert (CHECKOUT / "README.md").is_file() and not (CHECKOUT / "notes").exists()  # the checkout is pristine
    assert _layers(box) == []


@pytest.mark.user
def test_hostile_actions_are_contained(box, tmp_path: Path):
    """eval's hostile cases, issued as actions: no network, no write outside the work tree, the host unchanged, a
    link to a host file as run.sh is not followed (not an answer), nor are links when the layer is handed to the
    next action's uid, and nothing left running."""
    canary = tmp_path / "canary"
    canary.write_text("host\n")
    naps = str(random.randrange(30000, 99999))  # this test's own: the same test may run beside it (CI's as-user)

    def script(messages, sample):
        return [bash(f"echo pwned > {canary}; echo x > /usr/pwned; echo x > /sandbox/job/x; "
                     "python3 -c 'import socket; socket.create_connection((\"1.1.1.1\", 53), 2)'; "
                     f"ln -s /etc/passwd run.sh; ln -s {canary} to-canary; (setsid sleep {naps} &) ; echo end"),
                bash("submit"),
                bash(":(){ :|:& };: ; echo bomb"),
                bash("cat /etc/hostname; rm run.sh; echo fine > run.sh"),
                bash("submit"),
                ][len(messages) // 2]
    cfg = _cfg(action_wall_s=5, openhands_check=False)
    cfg.episodes = 1
    _run(box, tmp_path / "run", script, cfg, rows=ROWS[:1])
    t = [json.loads(x) for x in (tmp_path / "run" / "transcripts" / "101-9001" / "ep0.jsonl").read_text().splitlines()]
    assert "end" in t[0]["observation"] and "exit" not in t[1]  # the link is not run.sh's text: no answer yet
    assert "does not exist (or is not a regular file)" in t[1]["observation"]
    assert "Permission denied" in t[0]["observation"] or "Read-only" in t[0]["observation"]
    assert "Network is unreachable" in t[0]["observation"] or "OSError" in t[0]["observation"]
    assert t[2]["exec"]["fault"] is None  # the fork bomb is a verdict about the action, not a sandbox fault
    assert t[4]["exit"] == "submitted" and t[-1]["end"]["run_sh"] == "fine\n"
    assert canary.read_text() == "host\n" and not Path("/usr/pwned").exists()
    # each action's layer, links and all, was handed to the next action's uid (as root): no link was followed
    assert (canary.stat().st_uid, Path("/etc/passwd").stat().st_uid) == (os.getuid(), 0)
    assert not any(f"sleep {naps}" in " ".join(p.info["cmdline"] or []) for p in psutil.process_iter(["cmdline"]))
    assert _layers(box) == []


def test_each_limit_ends_the_episode_with_its_status(box, tmp_path: Path):
    """Format errors, turns, the episode's time (an action that runs past its wall limit counts), tokens and the
    context: each ends the episode with its exit, and the row keeps its place (an empty answer)."""
    cases = {
        "format_errors": (lambda m, s: "I will just think.", {}),
        "turn_limit": (lambda m, s: bash("true"), {"max_turns": 2}),
        "time_limit": (lambda m, s: bash("sleep 30"), {"max_episode_seconds": 3}),
        "token_limit": (lambda m, s: bash("true"), {"max_episode_tokens": 25}),
    }
    for status, (script, limits) in cases.items():
        cfg = _cfg(action_wall_s=2)
        cfg.episodes = 1
        for k, v in limits.items():
            setattr(cfg.limits, k, v)
        out = tmp_path / status
        _run(box, out, script, cfg, rows=ROWS[:1])
        (row,) = _rows(out)
        assert row["output"] == [""] and row["agent"]["episodes"][0]["exit"] == status, status
    t = [json.loads(x) for x in (tmp_path / "time_limit" / "transcripts" / "101-9001" / "ep0.jsonl").read_text()
         .splitlines()]
    assert t[0]["exec"]["timed_out"] and "timeout" in t[0]["observation"]
    _run(box, tmp_path / "ctx", lambda m, s: bash("yes | head -c 5000"), _cfg(observation_tokens=4000), rows=ROWS[:1],
         max_model_len=4000)
    (row,) = _rows(tmp_path / "ctx")
    assert [e["exit"] for e in row["agent"]["episodes"]] == ["context_exceeded"] * 2
    assert [e["turns"] for e in row["agent"]["episodes"]] == [1, 1]  # the first turn fit; the second would not
    assert summarize(tmp_path / "ctx" / "generations.jsonl", _cfg())["openhands"]["success_rate"] == 0.0
    assert _layers(box) == []


def test_the_live_episodes_layers_are_bounded_together(box, tmp_path: Path):
    """Issue 41, item 7: three live episodes held 601 MB on the host at once (each under its own cap). With
    ``bash.layers_mb`` 1, the second episode's 0.7 MB beside the first's is refused: that action's observation says
    so in plain words, its earlier files stay, and both episodes go on to submit."""
    cfg = _cfg(openhands_check=False, layers_mb=1)

    def script(messages, sample: Sample) -> str:
        step = {1: "head -c 700000 /dev/zero > big && echo wrote", 3: "ls big", 5: "echo 'echo hi' > run.sh"}
        return bash(step.get(len(messages), "submit"))  # (where the policy waits for an explicit submit)

    stats, _ = _run(box, tmp_path / "run", script, cfg, rows=ROWS[:1])
    assert stats["exits"] == {"submitted": 2}
    eps = [[json.loads(x) for x in (tmp_path / "run" / "transcripts" / f"{ROWS[0].github_id}-{ROWS[0].id}" /
                                    f"ep{k}.jsonl").read_text().splitlines()] for k in range(2)]
    kept, refused = eps[0], eps[1]
    assert "not kept" not in kept[0]["observation"] and kept[1]["exec"]["exit_code"] == 0
    assert "not kept (the run's live layers would hold more than 1 MB" in refused[0]["observation"], refused[0]
    assert refused[1]["exec"]["exit_code"] != 0  # ls: no such file
    assert _layers(box) == []


def test_format_errors_are_told_to_the_model(box, tmp_path: Path):
    seen = []

    def script(messages, sample):
        seen.append(messages[-1]["content"])
        return ["```bash\nls\n```\n```bash\npwd\n```", bash("echo ok > run.sh"), bash("submit")][len(messages) // 2]
    cfg = _cfg(openhands_check=False)
    cfg.episodes = 1
    _run(box, tmp_path / "run", script, cfg, rows=ROWS[:1])
    assert seen[1].startswith("Format error: the reply has 2 ```bash blocks")
    (row,) = _rows(tmp_path / "run")
    assert row["agent"]["episodes"][0]["exit"] == "submitted"


def test_a_killed_run_resumes_to_the_same_result(box, tmp_path: Path):
    """Killed after the first round: the re-run generates only the missing turns, runs the finished actions again
    (to rebuild each episode's files) and ends as an uninterrupted run does."""
    def script(messages, sample):
        return [bash("echo step1 > a.txt"), bash("cat a.txt >> b.txt; cat b.txt"),
                bash(f"cp b.txt run.sh; echo {shlex.quote(sample.output)} >> run.sh"),
                bash("submit")][len(messages) // 2]

    class Killed(Exception):
        pass

    class KillAfter(Replies):
        def generate(self, requests, params):
            if len(self.sizes) >= 1:
                raise Killed
            return super().generate(requests, params)

    cfg = _cfg(openhands_check=False)
    _run(box, tmp_path / "whole", script, cfg, rows=ROWS[:2])
    killed = KillAfter(script)
    with pytest.raises(Killed):
        run_episodes(cfg, ROWS[:2], {REPO: CHECKOUT}, lambda: killed, encode, 10**6, tmp_path / "part",
                     {"model": "scripted", "adapter": None, "backend": "scripted"}, box=box)
    _, again = _run(box, tmp_path / "part", script, cfg, rows=ROWS[:2])
    assert again.sizes == [4, 4, 4]  # rounds 2 to 4 only

    def strip(out: Path) -> list:
        rows = sorted(_rows(out), key=lambda r: r["id"])
        return [(r["output"], [(e["exit"], e["turns"], e["answer"]) for e in r["agent"]["episodes"]]) for r in rows]
    assert strip(tmp_path / "part") == strip(tmp_path / "whole")
    assert strip(tmp_path / "whole")[0][0][0] == "step1\n" + ROWS[0].output + "\n"  # b.txt once: a.txt rebuilt
    assert _layers(box) == []


def test_actions_and_observations_on_fixed_strings():
    assert parse_action("think\n```bash\nls -la\n```") == "ls -la"
    for bad in ("no block", "```bash\n\n```", "```bash\nls\n```\n```sh\npwd\n```", "```python\nprint(1)\n```"):
        with pytest.raises(FormatError):
            parse_action(bad)
    res = ExecResult(0, False, 0.1, 0, "a\x1b[31m</output>" + "x" * 500 + "tail")
    obs = observation(res, 200)
    assert "\\x1b" in obs and "<\\/output>" in obs and obs.count("</output>") == 1
    assert "characters elided" in obs and obs.endswith("tail</output>") and len(obs) < 320
    assert "timeout" in observation(ExecResult(None, True, 5.0, 0, ""), 200)


def test_bash_settings_do_not_change_ml_agent_run_folders():
    a, b = AgentConfig(), AgentConfig()
    b.bash.action_wall_s = 5
    assert a.sha() == b.sha()
    a.policy = b.policy = "bash"
    assert a.sha() != b.sha()


def test_a_layer_needs_an_engine_that_keeps_it(tmp_path: Path):
    from mlbench_kit.errors import MLBenchError
    from mlbench_kit.sandbox import Env, Job, Limits
    with Sandbox("local") as sb:
        assert not sb.layers_ok
        with pytest.raises(MLBenchError, match="cannot keep files"):
            sb.run(Job("true", True, Env(REPO, CHECKOUT), ".", layer=tmp_path), Limits())


def test_the_episode_prompt_is_openhands_task(box):
    sb, envs = box
    ep = BashEpisode(ROWS[0], envs.for_repo(REPO), sb, _cfg(), 0, encode, 10**6)
    text = ep.messages[0]["content"]
    assert text.startswith(f"Please complete the Machine Learning task in the following repository: {REPO}\n\n"
                           f"{ROWS[0].instruction}\n\nYou should create a script named `run.sh`")
    assert "exactly ONE bash code block" in text and "/sandbox/work/" in text


def test_a_chat_endpoint_gets_the_conversation_as_messages(box):
    """Each turn's prompt carries the conversation as messages (what ``openai.api: chat`` sends), the same the
    token ids were rendered from: the task, then each reply and its feedback."""
    sb, envs = box
    ep = BashEpisode(ROWS[0], envs.for_repo(REPO), sb, _cfg(), 0, encode, 10**6)
    try:
        p = ep.prepare()
        assert p is not None and p.messages == ep.messages and len(p.messages) == 1
        ep.feed("no block", 3, 0.1)
        p = ep.prepare()
        assert p is not None and [m["role"] for m in p.messages or []] == ["user", "assistant", "user"]
        assert json.loads(p.text) == p.messages and p.messages[1]["content"] == "no block"
    finally:
        ep.discard()


@pytest.mark.integration
def test_the_tiny_model_plays_the_bash_policy_through_the_command(tmp_path: Path, tiny_model_dir: Path):
    """`mlbench agent --policy bash` with a real (tiny, random) model on the sample: episodes run to a recorded exit,
    the generations are scored by `mlbench eval`, and the run's summary carries the openhands rule's rate."""
    from conftest import run_cli

    from mlbench_kit.agent.episode import EXITS
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(line + "\n" for line in (SAMPLE / "samples.jsonl").read_text().splitlines()
                            if any(f'"id": {s.id},' in line for s in ROWS[:2])))
    cfg = tmp_path / "bash.yaml"
    cfg.write_text((REPO_ROOT / "configs" / "agent" / "tiny-cpu.yaml").read_text().replace("policy: ml-agent",
                                                                                           "policy: bash"))
    out = tmp_path / "agent"
    r = run_cli("mlbench", "agent", "--model", tiny_model_dir, "--data", rows, "--repos-dir", SAMPLE / "repos",
                "--envs", ENVS, "--config", cfg, "--max-model-len", "2048", "--out", out)
    assert r.returncode == 0, r.stderr[-3000:]
    episodes = [e for line in (out / "generations.jsonl").read_text().splitlines()
                for e in json.loads(line)["agent"]["episodes"]]
    assert len(episodes) == 4 and all(e["exit"] in EXITS and e["exit"] != "fault" for e in episodes)
    assert all(e["turns"] <= 4 and e["tokens_out"] <= 160 for e in episodes)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["policy"] == "bash" and summary["openhands"]["scored"] == 4
    r = run_cli("mlbench", "eval", "--data", rows, "--generations", out / "generations.jsonl", "--envs", ENVS,
                "--out", tmp_path / "eval", "--no-ci", "--k", "1", "2")
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((tmp_path / "eval" / "summary.json").read_text())["metrics"]["overall"]["samples"] == 2


def test_agent_runs_stand_beside_task_runs_in_the_report(box, tmp_path: Path):
    """An eval of the agent's generations is the checkpoint's agent setting: `mlbench report` shows it beside the
    same model's task row, with its episodes and the openhands rule's rate labelled as that rule, and the paper's
    agent rows quoted beside it (only where an agent run is reported)."""
    import csv

    from mlbench_kit.cli import main
    _run(box, tmp_path / "agent", gold_writer)
    rows_file = tmp_path / "rows.jsonl"
    rows_file.write_text("".join(line + "\n" for line in (SAMPLE / "samples.jsonl").read_text().splitlines()
                                 if any(f'"id": {s.id},' in line for s in ROWS)))
    task3 = tmp_path / "task3.jsonl"  # the same model on task 3: a wrong answer, then the right one, per row
    task3.write_text("".join(json.dumps({"github_id": s.github_id, "id": s.id, "task": 3, "output": ["ls", s.output]})
                             + "\n" for s in ROWS))
    common = ["--data", str(rows_file), "--envs", str(ENVS), "--no-ci"]
    assert main(["eval", *common, "--generations", str(tmp_path / "agent" / "generations.jsonl"),
                 "--out", str(tmp_path / "eval-agent")]) == 0
    assert main(["eval", *common, "--generations", str(task3), "--out", str(tmp_path / "eval-t3")]) == 0
    paper = REPO_ROOT / "configs" / "report" / "paper-rows.yaml"
    out = tmp_path / "report"
    assert main(["report", f"m={tmp_path / 'eval-t3'}", f"m={tmp_path / 'eval-agent'}", "--reference", str(paper),
                 "--out", str(out)]) == 0
    md = (out / "report.md").read_text()
    setting_rows = [ln for ln in md.split("## Pass@k by setting")[1].split("\n\n")[1].splitlines()
                    if ln.startswith("| m |")]
    assert [ln.split(" | ")[1] for ln in setting_rows] == ["3", "agent: bash"]
    assert "| ML-Agent, GPT-4 (paper, quarter set) *(quoted)* | agent: ml-agent |  |  | 0.235 | 0.353 |" in md
    agents = md.split("## Agent runs")[1]
    assert "| m · agent bash | 6 | 6 | submitted 6 | 3.00 |" in agents and "openhands rule" in agents
    assert "| DGL | 0.800 |" in agents  # Table 2's ML-Agent column, quoted
    rows = list(csv.DictReader((out / "report.csv").open()))
    got = {(r["task"], r["group_kind"], r["metric"]): r for r in rows if r["run"] == "m"}
    assert float(got[("agent: bash", "overall", "pass@1")]["value"]) == 1.0
    assert float(got[("3", "overall", "pass@1")]["value"]) == 0.0
    oh = got[("agent: bash", "agent", "openhands_success_rate")]
    assert float(oh["value"]) == 1.0 and oh["source"].startswith("measured under the openhands rule")
    # report.html: each agent answer with its episode, turn by turn from the transcript (the task run's: none)
    def page(html: Path) -> dict:
        text = html.read_text()
        return json.loads(text.split('<script type="application/json" id="rows">')[1].split("</script>")[0])
    data = page(out / "report.html")
    agent_col = [i for i, c in enumerate(data["columns"]) if c.startswith("m · agent bash")]
    assert len(agent_col) == 1 and len(data["columns"]) == 2, data["columns"]
    agent_col = agent_col[0]
    for row in data["rows"]:
        task_cell, agent_cell = row["cells"][1 - agent_col], row["cells"][agent_col]
        assert all(a["episode"] is None for a in task_cell)
        for a in agent_cell:
            t = [json.loads(x) for x in (tmp_path / "agent" / "transcripts" / f"{row['github_id']}-{row['id']}" /
                                         f"ep{a['idx']}.jsonl").read_text().splitlines()]
            assert a["episode"]["exit"] == "submitted" and [x["reply"] for x in a["episode"]["turns"]] == \
                [x["raw"] for x in t[:-1]]
            assert "head -3 README.md" in a["episode"]["turns"][0]["reply"] and \
                "<returncode>0</returncode>" in a["episode"]["turns"][0]["observation"]
    # and the browser builds them: each episode a folded block of its turns, no console error
    from conftest import chromium_or_skip, dump_dom
    dom, console = dump_dom(chromium_or_skip(), (out / "report.html").as_uri(), tmp_path)
    assert console == [] and 'data-ready="1"' in dom, console or dom[-2000:]
    assert dom.count("episode: submitted · 3 turn(s)") == 6 and dom.count('class="observation"') == 12
    # a transcript that is a link is not followed: that episode is not shown
    first = tmp_path / "agent" / "transcripts" / f"{ROWS[0].github_id}-{ROWS[0].id}" / "ep0.jsonl"
    first.rename(tmp_path / "moved.jsonl")
    first.symlink_to(tmp_path / "moved.jsonl")
    assert main(["report", f"m={tmp_path / 'eval-t3'}", f"m={tmp_path / 'eval-agent'}", "--reference", str(paper),
                 "--out", str(tmp_path / "linked")]) == 0
    shown = {(r["id"], a["idx"]): a["episode"] for r in page(tmp_path / "linked" / "report.html")["rows"]
             for a in r["cells"][agent_col]}
    assert shown[(ROWS[0].id, 0)] is None and shown[(ROWS[0].id, 1)] is not None
    # a report of task runs alone quotes no agent row
    assert main(["report", f"m={tmp_path / 'eval-t3'}", "--reference", str(paper), "--out", str(tmp_path / "r2")]) == 0
    assert "agent:" not in (tmp_path / "r2" / "report.md").read_text()


def test_prefix_code_exports_apply_to_actions_and_the_openhands_check(box, tmp_path: Path):
    """The row's prefix_code applies where eval's checker applies it: its `export NAME=VALUE` lines are set for
    every action and for the OpenHands check; its other lines (installs, downloads) never run."""
    import dataclasses
    row = dataclasses.replace(ROWS[0], prefix_code="pip install nothing-here\nexport DATA_DIR=/data/x\n"
                                                   "export OUT_DIR=$DATA_DIR/out  # where it writes\n")

    def script(messages, sample):
        return [bash('echo "data=[$DATA_DIR] out=[$OUT_DIR]"'),
                bash("printf '%s\\n' 'test \"$OUT_DIR\" = /data/x/out' > run.sh"), bash("submit")][len(messages) // 2]

    engine = Replies(script)
    cfg = _cfg()
    cfg.episodes = 1
    run_episodes(cfg, [row], {REPO: CHECKOUT}, lambda: engine, encode, 10**6, tmp_path / "run",
                 {"model": "scripted", "adapter": None, "backend": "scripted"}, box=box)
    t = [json.loads(x) for x in (tmp_path / "run" / "transcripts" / f"{row.github_id}-{row.id}" / "ep0.jsonl")
         .read_text().splitlines()]
    assert "data=[/data/x] out=[/data/x/out]" in t[0]["observation"]
    end = t[-1]["end"]
    assert end["exit"] == "submitted" and end["openhands"]["passed"], end


def test_observations_are_cut_to_a_token_budget_of_the_models_tokenizer(tiny_tokenizer):
    """Output that fits in characters but not in tokens is cut to the token budget: head and tail, each at most
    half of it by the model's tokenizer, the middle elided and said so."""
    from mlbench_kit.agent.run import make_encoder
    encode, _ = make_encoder(tiny_tokenizer, "plain")
    empty = len(encode(""))

    def count(text: str) -> int:
        return len(encode(text)) - empty
    log = "".join(f"epoch {i} loss 0.{i:04d} acc 0.{(7 * i) % 1000:03d}\n" for i in range(120))
    res = ExecResult(0, False, 0.1, 0, log)
    whole = observation(res, 10**6)
    assert "elided" not in whole and count(log) > 300  # within the characters: the old cut kept it whole
    obs = observation(res, 10**6, 200, count)
    out = obs.split("<output>\n", 1)[1].removesuffix("</output>")
    head, rest = out.split("\n[... ", 1)
    note, tail = rest.split(" ...]\n", 1)
    assert count(head) <= 100 and count(tail) <= 100 and count(head) > 80 and count(tail) > 80
    assert log.startswith(head) and log.endswith(tail) and "tokens" in note and "characters) elided" in note
    assert observation(res, 10**6, 10**5, count) == whole  # within the token budget: unchanged


def test_an_episode_shows_the_model_at_most_its_token_budget_of_an_action(box, tmp_path: Path):
    cfg = _cfg(observation_tokens=64)
    cfg.episodes = 1
    seen = []

    def script(messages, sample):
        seen.append(messages[0]["content"])
        return [bash("seq 1 400"), bash("echo done > run.sh"), bash("submit")][len(messages) // 2]

    engine = Replies(script)
    run_episodes(cfg, ROWS[:1], {REPO: CHECKOUT}, lambda: engine, encode, 10**6, tmp_path / "run",
                 {"model": "scripted", "adapter": None, "backend": "scripted"}, box=box)
    t = [json.loads(x) for x in (tmp_path / "run" / "transcripts" / f"{ROWS[0].github_id}-{ROWS[0].id}" / "ep0.jsonl")
         .read_text().splitlines()]
    out = t[0]["observation"].split("<output>\n", 1)[1].removesuffix("</output>")
    head, tail = out.split("\n[... ", 1)[0], out.split(" ...]\n", 1)[1]
    assert len(head) <= 32 and len(tail) <= 32 and head.startswith("1\n2\n") and tail.endswith("399\n400\n")
    assert "cut to 4000 characters and 64 tokens" in seen[0]  # the task prompt says so


def test_bash_gold_episodes_are_what_the_harness_sends_and_expert_iteration_keeps_them(box, tmp_path: Path,
                                                                                     tiny_tokenizer_dir: Path):
    """`mlbench agent --gold-episodes --policy bash`: each training row's look, write, run, submit episode, its
    actions run in the sandbox, as SFT records whose prompts are the conversations the harness sends, token for
    token; the records' replies walk the harness's own episodes to run.sh answers equal to the gold answers (a Bash
    Script row at the root and in a subfolder, a Python Code row); their strict-passing episodes come back as the
    same records through --own-episodes, and an edited conversation is refused."""
    if box[0].engine.name != "bwrap":
        pytest.skip("the CLI's gold episodes run in the bwrap sandbox (bash.sandbox's default); docker's layers are "
                    "the other tests' subject")
    from mlbench_kit.agent.run import make_encoder
    from mlbench_kit.cli import main, stage_config
    from mlbench_kit.hf import load_tokenizer, prompt_ids
    from mlbench_kit.records import EvalResult, output_sha, read_prep_records
    rows = {s.id: s for s in load_samples(SAMPLE / "samples.jsonl")}
    train, evaluated = [rows[9001], rows[9013], rows[9016]], [rows[9002], rows[9017]]
    assert [s.type for s in train] == ["Bash Script", "Bash Script", "Python Code"] and train[1].path != "./"

    def named(path: Path, some: list[Sample]) -> Path:
        path.write_text("".join(json.dumps({"github_id": s.github_id, "id": s.id}) + "\n" for s in some))
        return path
    common = ["agent", "--gold-episodes", "--policy", "bash", "--model", str(tiny_tokenizer_dir), "--data",
              str(SAMPLE / "samples.jsonl"), "--repos-dir", str(SAMPLE / "repos"), "--envs", str(ENVS),
              "--eval-rows", str(named(tmp_path / "eval.jsonl", evaluated)), "--rows-of",
              str(named(tmp_path / "train.jsonl", train)), "--set", "bash.action_wall_s=20"]
    out = tmp_path / "gold"
    assert main([*common, "--out", str(out)]) == 0
    recs = [r for _, r in read_prep_records(out / "sft.jsonl")]
    stats = json.loads((out / "gold.json").read_text())
    assert stats["turns"] == {"look": 3, "write": 3, "run": 3, "submit": 3} and stats["policy"] == "bash"
    assert stats["run_step"] == {"exit 0": 3, "timed out": 0, "failed": 0}  # the gold answers run in the sandbox
    assert [r.key for r in recs] == [s.key for s in train for _ in range(4)]
    assert all(r.template == "chat" and r.prompt.startswith("<s>[INST] ") for r in recs)
    # each later prompt holds the earlier replies and the real observations (the folder's listing, run.sh's output)
    assert "train.py" in recs[1].prompt and "node_clf.py" in recs[5].prompt and "python - <<'PY'" in recs[9].answer
    # the harness's own run: every conversation it sends is a record's prompt, token for token
    tok = load_tokenizer(str(tiny_tokenizer_dir))
    encode, _ = make_encoder(tok, "auto")
    replies = {tuple(prompt_ids(tok, r.prompt, r.template)): r.answer for r in recs}

    class Answering:
        def generate(self, requests, params):
            out = []
            for r in requests:
                assert tuple(r.token_ids) in replies, "the harness sent a conversation no gold record holds"
                text = replies[tuple(r.token_ids)]
                out.append([Generated(text, len(tok(text, add_special_tokens=False)["input_ids"]))])
            return out

        def close(self) -> None:
            pass
    cfg = stage_config("agent", ["--config", str(out / "config.yaml")])
    cfg.episodes, cfg.bash.openhands_check = 1, False
    run_episodes(cfg, train, {REPO: CHECKOUT}, lambda: Answering(), encode, stats["max_model_len"], tmp_path / "run",
                 {"model": "gold", "adapter": None, "backend": "scripted"}, box=box)
    gens = {(g["github_id"], g["id"]): g["output"][0] for g in _rows(tmp_path / "run")}
    assert {k: v.strip() for k, v in gens.items()} == {s.key: s.output.strip() for s in train}
    # expert iteration: the run's strictly passing episodes (here: all of them) come back as the same records
    ok = tmp_path / "eval-ok"
    ok.mkdir()
    (ok / "results.jsonl").write_text("".join(json.dumps(EvalResult(
        s.github_id, s.id, 0, s.repo, s.type, output_sha(gens[s.key]), "strict", {}, True, True,
        passed=True).to_json()) + "\n" for s in train))
    own = ["--own-episodes", str(tmp_path / "run"), "--own-episodes-eval", str(ok)]
    assert main([*common, *own, "--out", str(tmp_path / "ei")]) == 0
    ei = [r for _, r in read_prep_records(tmp_path / "ei" / "sft.jsonl")]
    assert [(r.prompt, r.answer) for r in ei] == [(r.prompt, r.answer) for r in [*recs, *recs]]
    assert json.loads((tmp_path / "ei" / "gold.json").read_text())["own_episodes"]["episodes"] == 3
    # a transcript whose observation was edited no longer rebuilds the conversation the model saw: refused
    ep0 = tmp_path / "run" / "transcripts" / f"{train[0].github_id}-{train[0].id}" / "ep0.jsonl"
    lines = ep0.read_text().splitlines()
    first = json.loads(lines[0])
    first["observation"] = first["observation"].replace("train.py", "solution.py")
    ep0.write_text("\n".join([json.dumps(first), *lines[1:]]) + "\n")
    assert main([*common, *own, "--out", str(tmp_path / "edited")]) == 2
    assert not (tmp_path / "edited" / "sft.jsonl").exists()
