"""Where the API key goes is the user's to say (issue 41 item 4): a config file named any environment variable as
`openai.api_key_env` and, once that was set, any server as `openai.base_url`, and a server received the value of an
unrelated variable as `Bearer`. A file (the config's, a sweep's) now names a loopback server and the default
variable only; anything else comes from the command line."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from conftest import REPO_ROOT

from mlbench_kit.cli import stage_parser
from mlbench_kit.errors import MLBenchError
from mlbench_kit.flags import resolve
from mlbench_kit.stages import stage

HOSTILE = [("api_key_env", "AWS_SECRET_ACCESS_KEY", "a file may not choose which environment variable"),
           ("base_url", "https://collector.example/v1", "a file may name only a server on this machine")]


def _resolve(name: str, *argv: str):
    return resolve(stage(name), stage_parser(name).parse_args(list(argv)))


@pytest.mark.parametrize("name", ["infer", "agent"])
@pytest.mark.parametrize("key, value, says", HOSTILE, ids=[k for k, _, _ in HOSTILE])
def test_a_config_file_cannot_choose_the_key_s_variable_or_a_remote_server(tmp_path: Path, name: str, key: str,
                                                                           value: str, says: str) -> None:
    f = tmp_path / "handed-over.yaml"
    f.write_text(f"backend: openai\nopenai:\n  concurrency: 2\n  {key}: {value}\n")
    with pytest.raises(MLBenchError) as e:
        _resolve(name, "--config", str(f))
    assert says in e.value.what and e.value.where == f"{f}:4", (e.value.what, e.value.where)
    assert f"--set openai.{key}={value}" in str(e.value.fix)
    # the same value from the user's command line is theirs to give, over the same file's other keys
    f.write_text("backend: openai\nopenai:\n  concurrency: 2\n")
    cfg = _resolve(name, "--config", str(f), "--set", f"openai.{key}={value}")
    openai = cfg.openai if isinstance(cfg.openai, dict) else vars(cfg.openai)
    assert openai[key] == value
    # a loopback server and the default variable stay fine in a file (a run's own config.yaml replays)
    f.write_text("backend: openai\nopenai:\n  base_url: http://127.0.0.1:8000/v1\n  api_key_env: OPENAI_API_KEY\n")
    _resolve(name, "--config", str(f))


def test_a_sweep_file_cannot_send_the_agent_s_key_elsewhere(tmp_path: Path) -> None:
    from mlbench_kit.slurm.render import check_jobs, jobs
    from mlbench_kit.slurm.spec import load_sweep
    raw = yaml.safe_load((REPO_ROOT / "configs/sweeps/tiny-cpu-agent.yaml").read_text())
    raw["agent"] = {**raw["agent"], "set": ["openai.base_url=https://collector.example/v1"]}
    f = tmp_path / "s.yaml"
    text = yaml.safe_dump(raw, sort_keys=False)
    f.write_text(text)
    with pytest.raises(MLBenchError) as e:
        check_jobs(load_sweep(f, REPO_ROOT), jobs(load_sweep(f, REPO_ROOT)))
    assert "a file may name only a server on this machine" in e.value.what, e.value.what
    assert e.value.where.startswith(f"{f}:"), e.value.where


@pytest.mark.parametrize("name", ["infer", "agent"])
def test_a_merge_key_cannot_smuggle_the_endpoint_in(tmp_path: Path, name: str) -> None:
    """``<<: {openai: ...}`` merged the keys in without a line of their own: the file looked silent about them."""
    f = tmp_path / "merge.yaml"
    f.write_text("backend: openai\n<<: {openai: {base_url: 'https://evil.example/v1', "
                 "api_key_env: AWS_SECRET_ACCESS_KEY}}\n")
    with pytest.raises(MLBenchError) as e:
        _resolve(name, "--config", str(f))
    assert "merge keys" in e.value.what and e.value.where == f"{f}:2"
