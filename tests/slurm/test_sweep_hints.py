"""What `mlbench sweep` says when Slurm cannot be reached, and when the sweep names no partition."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml
from conftest import REPO_ROOT, run_cli

from mlbench_kit.cli import main
from mlbench_kit.slurm import sweep as sweep_cli


def test_submit_without_a_reachable_slurm_says_so_and_what_to_check(tmp_path: Path) -> None:
    # before: sbatch's "Unable to contact slurm controller" came back as "fix the sweep's slurm section"
    if shutil.which("squeue") is None or shutil.which("sbatch") is None:
        pytest.skip("needs Slurm's clients (scripts/setup.sh installs slurm-wlm)")
    conf = tmp_path / "slurm.conf"  # a controller on a port nothing listens on: the clients' own error
    conf.write_text("ClusterName=nowhere\nSlurmctldHost=localhost\nSlurmctldPort=9\nAuthType=auth/none\n"
                    "NodeName=localhost CPUs=1 State=UNKNOWN\nPartitionName=debug Nodes=localhost Default=YES\n")
    spec = yaml.safe_load((REPO_ROOT / "configs/sweeps/tiny-cpu.yaml").read_text())
    spec.update(run_dir=str(tmp_path / "sweep"))
    f = tmp_path / "sweep.yaml"
    f.write_text(yaml.safe_dump(spec, sort_keys=False))
    r = run_cli("mlbench", "sweep", "submit", f, env={"SLURM_CONF": str(conf)}, timeout=120)
    assert r.returncode == 2, r.stderr
    assert f"SLURM_CONF={conf}: Slurm is not reachable: `squeue` failed (" in r.stderr
    assert "Unable to contact slurm controller" in r.stderr
    assert "scontrol ping" in r.stderr and "bash slurm/cluster.sh start" in r.stderr
    assert "fix the sweep's slurm section" not in r.stderr
    assert not (tmp_path / "sweep").exists()  # nothing written before Slurm answered


@pytest.mark.parametrize("stderr,reachable", [
    ("sbatch: error: Batch job submission failed: Unable to contact slurm controller (connect failure)", False),
    ("sbatch: error: _establish_config_source: failed to fetch config\n"
     "sbatch: fatal: Could not establish a configuration source", False),
    ("sbatch: error: Batch job submission failed: Invalid partition name specified", True),
    ("sbatch: error: Batch job submission failed: Requested node configuration is not available", True)])
def test_sbatch_s_errors_are_told_apart(stderr: str, reachable: bool) -> None:
    # a refusal is the sweep's (its slurm section); no answer at all is the cluster's
    assert (sweep_cli._UNREACHABLE.search(stderr) is None) == reachable
    if not reachable:
        e = sweep_cli.unreachable("sbatch", stderr, "; jobs submitted so far: ['17']")
        assert e.what.startswith("Slurm is not reachable: `sbatch` failed (") and "['17']" in str(e.fix)


def test_plan_warns_once_when_no_partition_is_set(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    src = REPO_ROOT / "configs/sweeps/paper.yaml"
    text = src.read_text()
    line = next(i for i, ln in enumerate(text.splitlines(), 1) if ln.startswith("  partition: null"))
    assert main(["sweep", "plan", str(src)]) == 0
    err = capsys.readouterr().err
    warnings = [ln for ln in err.splitlines() if "partition" in ln]
    assert len(warnings) == 1, err
    assert f"slurm.partition is not set ({src}:{line})" in warnings[0]
    assert "cluster's default partition" in warnings[0] and "partition: NAME" in warnings[0]
    f = tmp_path / "paper.yaml"
    f.write_text(text.replace("  partition: null", "  partition: gpu"))
    assert main(["sweep", "plan", str(f)]) == 0
    assert "partition" not in capsys.readouterr().err
