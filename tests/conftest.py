"""Shared fixtures: the real ML-Bench data in ../shared/mlbench and a tokenizer trained offline on it."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from mlbench_kit.engine import cpu_defaults

REPO_ROOT = Path(__file__).resolve().parents[1]
SHARED = Path(os.environ.get("MLBENCH_SHARED", REPO_ROOT.parent / "shared" / "mlbench"))
EXAMPLES = REPO_ROOT / "examples"
SAMPLE = EXAMPLES / "sample"
sys.path.insert(0, str(EXAMPLES))  # examples/tiny.py: the demo's tiny models, used by the tests too


def required(variable: str) -> bool:
    """Whether CI asked for something that would otherwise be skipped: MLBENCH_REQUIRE_SHARED, _PODMAN (1 = yes)."""
    return os.environ.get(variable, "") not in ("", "0")


def require_shared() -> Path:
    """The real ML-Bench data, ../shared/mlbench (or MLBENCH_SHARED). Every test that needs it gets it through
    here (the ``shared`` fixture): without it the test skips, or fails where MLBENCH_REQUIRE_SHARED=1 (CI)."""
    if not (SHARED / "full.jsonl").is_file():
        why = f"real ML-Bench data not found at {SHARED} (no full.jsonl; set MLBENCH_SHARED)"
        if required("MLBENCH_REQUIRE_SHARED"):
            pytest.fail(f"MLBENCH_REQUIRE_SHARED is set but the {why}", pytrace=False)
        pytest.skip(why)
    return SHARED


@pytest.fixture(scope="session")
def shared() -> Path:
    path = require_shared()
    os.environ["NLTK_DATA"] = str(path / "nltk_data")
    return path


@pytest.fixture(scope="session")
def full_rows(shared: Path) -> list[dict]:
    return [json.loads(line) for line in (shared / "full.jsonl").open()]


@pytest.fixture(scope="session")
def tiny_tokenizer_dir(tmp_path_factory: pytest.TempPathFactory, full_rows: list[dict]) -> Path:
    from tiny import build_tokenizer
    texts = [r["instruction"] + "\n" + r["oracle"] + "\n" + r["output"] for r in full_rows]
    return build_tokenizer(texts, tmp_path_factory.mktemp("tok"), vocab_size=1500)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_tokenizer_dir: Path):
    from mlbench_kit.hf import load_tokenizer
    return load_tokenizer(str(tiny_tokenizer_dir))


@pytest.fixture
def umask_022() -> Iterator[None]:
    """The umask of a shared cluster's users for this test (and every process it starts)."""
    old = os.umask(0o022)
    try:
        yield
    finally:
        os.umask(old)


# vLLM's CPU worker reserves gpu_memory_utilization (0.9) of the machine's memory at start unless a KV cache size
# is given: with other processes holding 5 GiB of 24, an in-process engine (the agent's lockstep test) failed its
# start. Every engine a test starts, in this process or a child, gets a 1 GiB KV cache instead.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
# and the engine's CPU defaults (every core to the worker) before any engine or `vllm serve` starts: the tests that
# compare an in-process engine with a served one need both to run the same threads
cpu_defaults()

def assert_shared_modes(*paths: Path) -> None:
    """Each path is readable by the group and others (written under umask 022): a labmate can read it."""
    import stat
    bad = {str(p): oct(stat.S_IMODE(p.stat().st_mode)) for p in paths
           if stat.S_IMODE(p.stat().st_mode) & 0o044 != 0o044}
    assert not bad, f"written without the umask's read bits: {bad}"


def chromium_or_skip() -> str:
    """Debian's chromium for the tests that load a page in a real browser; without it they skip, unless
    MLBENCH_REQUIRE_CHROMIUM=1 (CI), where they fail."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is None:
        if required("MLBENCH_REQUIRE_CHROMIUM"):
            pytest.fail("MLBENCH_REQUIRE_CHROMIUM is set but chromium is not installed (apt-get install chromium)",
                        pytrace=False)
        pytest.skip("no chromium (apt-get install chromium; MLBENCH_REQUIRE_CHROMIUM=1 makes this fail)")
    return found


def dump_dom(chromium: str, url: str, tmp: Path, *extra: str) -> tuple[str, list[str]]:
    """The DOM of ``url`` after its scripts ran in headless chromium, and the console messages it logged. The
    browser's profile and HOME are the test's own (nothing is written outside ``tmp``); on a timeout its whole
    process group is stopped."""
    import signal
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp)}
    proc = subprocess.Popen([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run",
                             f"--user-data-dir={tmp / 'chromium-profile'}", "--enable-logging=stderr", "--v=0",
                             "--virtual-time-budget=5000", *extra, "--dump-dom", url],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    return out, [x for x in err.splitlines() if ":CONSOLE" in x]


def run_cli(*argv: str, env: dict | None = None, timeout: int = 600):
    """Run a command from the repository root; returns the CompletedProcess (text)."""
    full_env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", **(env or {})}
    cmd = [str(a) for a in argv]
    if cmd[0] in ("mlbench", "accelerate"):
        cmd[0] = str(Path(sys.executable).with_name(cmd[0]))
    return subprocess.run(cmd, cwd=REPO_ROOT, env=full_env, capture_output=True, text=True, timeout=timeout)


def run_session(cmd: list[str], timeout: int, **kw) -> subprocess.CompletedProcess:
    """Run ``cmd`` in a session of its own; on timeout kill the whole session (a script's vLLM engine and
    training processes too, which a plain ``subprocess.run`` timeout would leave running), then fail."""
    import signal
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            **kw)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"{' '.join(map(str, cmd))} ran past {timeout} s; its session was killed\n"
                    f"{out[-2000:]}{err[-2000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory, tiny_tokenizer_dir: Path) -> Path:
    """A random-init Llama (head_dim 64, as vLLM's CPU attention needs) with the tokenizer trained on real rows."""
    from tiny import build_llama
    return build_llama(tiny_tokenizer_dir, tmp_path_factory.mktemp("model"), hidden=128, layers=2, heads=2)


# The server offers tools (the agent's actions: tools): a chat template that renders them (the tiny model's own has
# none) and a parser that supports a named tool_choice without a structural tag (pythonic), so vLLM decodes a forced
# call to the function's parameters as a JSON schema, compact as the offline engine's constrained decoding
# (hermes' structural tag lets JSON whitespace through: the random model spent every token of 18 replies on it);
# completions requests (infer's and the agent's other tests) are unchanged.
TOOL_FLAGS = ("--enable-auto-tool-choice", "--tool-call-parser", "pythonic", "--chat-template",
              str(REPO_ROOT / "tests" / "data" / "tiny-tools.jinja"),
              "--structured-outputs-config", '{"backend": "xgrammar", "disable_any_whitespace": true}')


@pytest.fixture(scope="session")
def tiny_vllm_server(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[str]:
    """`vllm serve` of the tiny model on a free loopback port (served name "tiny", 4,096 positions, tools offered:
    :data:`TOOL_FLAGS`), up when this yields its base URL; one server for the session (infer's and the agent's
    OpenAI tests share its start), stopped with its whole process session at the end. Its console script looks up
    a distribution named "vllm", which vllm-cpu is not, so the API server module runs itself."""
    import signal
    import socket
    import time
    import urllib.request
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    with log.open("w") as out:
        server = subprocess.Popen([sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model",
                                   str(tiny_model_dir), "--host", "127.0.0.1", "--port", str(port),
                                   "--served-model-name", "tiny", "--max-model-len", "4096", "--enable-prefix-caching",
                                   "--no-enable-chunked-prefill", "--enforce-eager", *TOOL_FLAGS],
                                  stdout=out, stderr=subprocess.STDOUT,
                                  env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"}, start_new_session=True)
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
                break
            except OSError:
                pass
            assert server.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, f"vllm serve not up in 300 s\n{log.read_text()[-3000:]}"
            time.sleep(1)
        yield f"http://127.0.0.1:{port}/v1"
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(server.pid, signal.SIGKILL)
                server.wait()


@pytest.fixture(scope="session")
def real_prep(tmp_path_factory: pytest.TempPathFactory, shared: Path, tiny_tokenizer_dir: Path) -> Path:
    """Task 3 records of the real rows, split ID/OOD, rendered with llama-inst and cut to 512 tokens."""
    out = tmp_path_factory.mktemp("prep")
    r = run_cli("mlbench", "prep", "--data", shared / "full.jsonl", "--splits", "full", "--tasks", "3",
                "--template", "llama-inst", "--tokenizer", tiny_tokenizer_dir, "--max-context-tokens", "512", "--no-hf",
                "--build-splits", "--ood-repos", "vid2vid", "--seed", "0", "--out", out)
    assert r.returncode == 0, r.stderr
    return out


@pytest.fixture(scope="session")
def trained_adapter(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path, real_prep: Path) -> Path:
    """A LoRA adapter trained by train/lora.py for a few steps on the real ID rows."""
    out = tmp_path_factory.mktemp("train") / "run"
    r = run_cli("accelerate", "launch", "--num_processes", "1", "--cpu", "--main_process_port", "0",
                "train/lora.py", "--config", "configs/train/tiny-cpu.yaml", "--model", tiny_model_dir,
                "--prep-dir", real_prep, "--out", out, "--max-steps", "6", "--max-context-tokens", "1024")
    assert r.returncode == 0, r.stderr[-3000:]
    return out / "adapter"


REAL_REPO = "External-Attention-pytorch"  # the real test repository whose environment CI builds


@pytest.fixture(scope="session")
def real_env_cache(tmp_path_factory: pytest.TempPathFactory, shared: Path) -> Path:
    """An environment cache holding the real repository's environment, built once per session from the shared
    tarball by `mlbench env build`: tests/eval/test_envs.py checks, gold-validates and scores it, and
    tests/test_real.py's `scripts/real.sh --quick` runs with it as MLBENCH_CACHE (its envs stage finds it up to date
    instead of building it a second time, 2-3 minutes on 2 cores)."""
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap not installed (scripts/setup.sh installs it)")
    from mlbench_kit.cli import main
    cache = tmp_path_factory.mktemp("envcache")
    assert main(["env", "build", REAL_REPO, "--cache", str(cache), "--tarballs", str(shared / "repos")]) == 0
    return cache


@pytest.fixture(scope="session")
def base_image() -> str | None:
    """The podman base image (Debian + Python, built without a registry), or None where podman cannot run.

    CI sets MLBENCH_REQUIRE_PODMAN=1: there a missing podman fails instead of skipping."""
    usable = os.geteuid() == 0 and shutil.which("podman") and shutil.which("mmdebstrap")
    if not usable:
        if required("MLBENCH_REQUIRE_PODMAN"):
            pytest.fail("MLBENCH_REQUIRE_PODMAN is set but podman/mmdebstrap are missing or not root")
        return None
    from mlbench_kit.eval.envs.images import build_base_image
    return build_base_image()


# dockerd on this kind of host (a container, cgroup v1 hybrid, no systemd): cgroupfs, and no bridge or iptables
# (executions run with --network none); overlay2 on the host's ext4
DOCKERD = ["dockerd", "--exec-opt", "native.cgroupdriver=cgroupfs", "--iptables=false", "--ip-masq=false",
           "--bridge=none", "--storage-driver", "overlay2"]


def _answers() -> bool:
    return subprocess.run(["docker", "info"], capture_output=True).returncode == 0


@pytest.fixture(scope="session")
def docker_daemon(tmp_path_factory):
    """A Docker daemon: the one running, else one this fixture starts as root (and stops after the tests)."""
    if shutil.which("docker") and _answers():
        yield
        return
    proc = None
    if os.geteuid() == 0 and shutil.which("dockerd") and shutil.which("docker"):
        log = (tmp_path_factory.mktemp("dockerd") / "dockerd.log").open("w")
        proc = subprocess.Popen(DOCKERD, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None and not _answers():
            time.sleep(0.5)
    if proc is None or proc.poll() is not None or not _answers():
        if proc is not None and proc.poll() is None:
            proc.terminate()
            proc.wait(30)
        if os.environ.get("MLBENCH_REQUIRE_DOCKER"):
            pytest.fail("MLBENCH_REQUIRE_DOCKER is set but no Docker daemon answers and none could be started "
                        "(apt-get install docker.io; as root)")
        pytest.skip("no Docker daemon, and none could be started here (needs root and docker.io)")
    try:
        yield
    finally:
        proc.terminate()  # dockerd stops its containerd with it
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="session")
def docker_base(docker_daemon, base_image, tmp_path_factory):
    """The podman base image, loaded into Docker (as a cluster user would: a docker-archive)."""
    if base_image is None:
        pytest.skip("building the base image needs podman (root, podman, mmdebstrap)")
    archive = tmp_path_factory.mktemp("base") / "base.docker.tar"
    subprocess.run(["podman", "save", "--format", "docker-archive", "-o", str(archive), base_image], check=True,
                   capture_output=True)
    r = subprocess.run(["docker", "load", "-i", str(archive)], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    archive.unlink()
    yield base_image
    subprocess.run(["docker", "rmi", base_image], capture_output=True)
