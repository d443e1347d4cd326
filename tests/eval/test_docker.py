"""Docker for real (issue 24): the embedded sample's gold answers scored through `mlbench eval --backend docker`.

Docker's daemon cannot see the stage script's mount namespace, so this backend takes the other path of
``container_argv``: the checkout bound read-only at /sandbox/src and copied by the runner into a tmpfs, the
report on stderr under a per-execution nonce. Uses the Docker daemon that runs, else starts one as root
(Debian's docker.io) and stops it afterwards; skipped where neither works, and ``MLBENCH_REQUIRE_DOCKER=1``
(CI) makes that a failure.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from conftest import REPO_ROOT, SAMPLE

from mlbench_kit.cli import main

FIXTURES = REPO_ROOT / "configs" / "eval" / "envs-sample"

pytestmark = pytest.mark.integration


def test_sample_gold_passes_through_the_docker_backend(tmp_path: Path, docker_daemon, base_image):
    if base_image is None:
        pytest.skip("building the images needs podman (root, podman, mmdebstrap)")
    recipes, cache = tmp_path / "recipes", tmp_path / "cache"
    recipes.mkdir()
    for name in ("toybench", "toyvision"):
        doc = yaml.safe_load((FIXTURES / f"{name}.yaml").read_text())
        doc["checkout"]["path"] = str((FIXTURES / doc["checkout"]["path"]).resolve())
        (recipes / f"{name}.yaml").write_text(yaml.safe_dump(doc))
    assert main(["env", "build", "--recipes", str(recipes), "--cache", str(cache), "--image"]) == 0
    # podman built them; docker gets them the way a cluster user would, as docker-archives
    out = tmp_path / "export"
    assert main(["env", "export", "--recipes", str(recipes), "--cache", str(cache), "--format", "docker-archive",
                 "--out", str(out)]) == 0
    tags = [e["image"] for e in yaml.safe_load((cache / "envs.yaml").read_text())["repos"].values()]
    for archive in sorted(out.glob("*.docker.tar")):
        r = subprocess.run(["docker", "load", "-i", str(archive)], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
        archive.unlink()
    try:
        run = tmp_path / "eval"
        assert main(["eval", "--data", str(SAMPLE / "samples.jsonl"), "--gold", "--envs", str(cache / "envs.yaml"),
                     "--out", str(run), "--backend", "docker", "--no-ci"]) == 0
        summary = json.loads((run / "summary.json").read_text())
        recs = [json.loads(x) for x in (run / "results.jsonl").open()]
        assert summary["metrics"]["overall"]["pass@1"] == 1.0
        assert len(recs) == 53 and all(r["passed"] and r["executed"] for r in recs)
        assert not (run / "faults.jsonl").exists() or not (run / "faults.jsonl").read_text().strip()
        # no container is left behind
        left = subprocess.run(["docker", "ps", "-aq", "--filter", "name=mlbench-"], capture_output=True, text=True)
        assert left.stdout.strip() == ""
    finally:
        subprocess.run(["docker", "rmi", *tags], capture_output=True)


NONBLOCK = ("python -c \"import fcntl, os\nfcntl.fcntl(1, fcntl.F_SETFL, os.O_NONBLOCK)\nfor _ in range(64):\n"
            "    try:\n        os.write(1, b'x' * 65536)\n    except BlockingIOError:\n        pass\"; exit 1")


MAPPED_OOM = "python -c 'x = bytearray(400 << 20)'; exit 1"  # the allocator is killed and its memory freed


def test_docker_verdicts_match_bwrap(docker_base, monkeypatch):
    """Issue 30 item 4: on Docker the runner's report came back through the CLI's stdout/stderr stream, so an answer
    whose stdout filled the undrained pipe blocked the CLI and the report with it (a failing O_NONBLOCK writer then
    passed in compat at the time limit), and an OOM that took the runner was a fault that left Pass@k. Each case
    is scored on bwrap and on Docker in compat's undrained mode; the verdicts must agree.

    An OOM the runner outlives is its memory controller's count, not the daemon's word: dockerd's OOMKilled comes
    from an event it handles asynchronously, and under CI's load it read false for an answer the kernel had killed
    (the runner reported exit 137, and no limit); and an answer whose worker was OOM-killed, still running at the
    cpu clock's limit, passed compat on docker alone. Here the daemon's word is hidden, and the verdicts stand."""
    from test_sandbox import CROSS, cross_verdicts, verdict_of

    from mlbench_kit.sandbox.engines import Docker
    if shutil.which("bwrap") is None:
        pytest.skip("needs bwrap")
    told = Docker.stop
    monkeypatch.setattr(Docker, "stop", lambda self, name, proc, cg: told(self, name, proc, cg) and False)
    hidden = cross_verdicts(("docker",), docker_base, {"oom-mapped": (MAPPED_OOM, {"mem_mb": 160}),
                                                       "oom-then-spin": CROSS["oom-then-spin"],
                                                       "honest": CROSS["honest"]})
    assert hidden[("docker", "oom-mapped")][:4] == (None, 1, False, "memory"), hidden  # the shell's own exit 1
    assert hidden[("docker", "oom-then-spin")][:4] == (None, None, True, "memory"), hidden  # passed compat before
    assert hidden[("docker", "honest")][:4] == (None, 0, False, None), hidden
    monkeypatch.undo()
    cases = {"nonblock-stdout": (NONBLOCK, {})} | CROSS
    verdicts = cross_verdicts(("bwrap", "docker"), docker_base, cases)
    # the verdict (``verdict_of``; docker's count of survivors is not compared)
    differ = {n: (verdicts[("bwrap", n)], verdicts[("docker", n)]) for n in cases
              if verdict_of(verdicts[("bwrap", n)]) != verdict_of(verdicts[("docker", n)])}
    print("differ:", json.dumps(differ, default=str))
    assert verdicts[("bwrap", "nonblock-stdout")][:3] == (None, 1, False)
    assert verdicts[("docker", "oom-unmapped")][3] == "memory"
    assert not differ
    left = subprocess.run(["docker", "ps", "-aq", "--filter", "name=mlbench-"], capture_output=True, text=True)
    assert left.stdout.strip() == ""  # no container is left behind, running or stopped
