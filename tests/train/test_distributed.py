"""Every distributed mode of the recipe trains alike: DDP, FSDP2 and DeepSpeed ZeRO-2/3, each with 2 real CPU
processes (gloo) through the shipped accelerate configs; FSDP2 and DeepSpeed runs save on an agreed SIGTERM and
resume exactly (DeepSpeed after SIGKILL too)."""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
import torch
from conftest import REPO_ROOT
from safetensors.torch import load_file
from test_train import _adapter, _assert_same, _interrupt, _launch, _steps

from mlbench_kit.train.checkpoint import PREEMPTED_EXIT

pytestmark = pytest.mark.integration
MODES = {"ddp": "configs/accelerate/ddp-cpu.yaml", "fsdp2": "configs/accelerate/fsdp2-cpu.yaml",
         "zero2": "configs/accelerate/deepspeed-zero2-cpu.yaml", "zero3": "configs/accelerate/deepspeed-zero3-cpu.yaml"}
STEPS = 8
ARGS = ("--max-steps", str(STEPS), "--set", "optim.grad_accum=2", "--set", "checkpoint.every_steps=4",
        "--set", "optim.scheduler=linear", "--set", "lora.dropout=0.1")


def _args(mode: str) -> tuple[str, ...]:
    """ARGS, except that FSDP2's run makes no periodic checkpoint: it is also the SIGTERM test's uninterrupted
    run, where the agreed save must be the only checkpoint."""
    return tuple("checkpoint.every_steps=100" if mode == "fsdp2" and a == "checkpoint.every_steps=4" else a
                 for a in ARGS)


def _train(model: Path, prep: Path, out: Path, mode: str) -> subprocess.CompletedProcess:
    return subprocess.run(_launch(model, prep, out, *_args(mode), config=MODES[mode], nproc=2), cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir, real_prep) -> dict[str, Path]:
    """One uninterrupted run per mode: the reference of the modes' comparison and of every resume here."""
    out = {}
    for mode in MODES:
        d = tmp_path_factory.mktemp(mode) / "run"
        r = _train(tiny_model_dir, real_prep, d, mode)
        assert r.returncode == 0, (mode, r.stderr[-3000:])
        out[mode] = d
    return out


def test_every_mode_takes_the_same_steps(runs):
    ref = _steps(runs["ddp"])
    assert len(ref) == STEPS
    lr0 = 3e-3  # configs/train/tiny-cpu.yaml; one scheduler step per optimizer step, whatever the world size
    assert [s["lr"] for s in ref] == pytest.approx([lr0 * (1 - (k + 1) / STEPS) for k in range(STEPS)])
    for mode in ("fsdp2", "zero2", "zero3"):
        start = json.loads((runs[mode] / "metrics.jsonl").read_text().splitlines()[0])
        assert start["world_size"] == 2 and start["distributed"] == {"fsdp2": "FSDP2"}.get(mode, "DEEPSPEED")
        got = _steps(runs[mode])
        # the optimizer steps once per 2 micro-batches (not per micro-batch), the loss is the same token mean
        assert [s["loss"] for s in got] == pytest.approx([s["loss"] for s in ref], rel=1e-5), mode
        assert [s["lr"] for s in got] == pytest.approx([s["lr"] for s in ref]), mode
        a, b = _adapter(runs["ddp"]), _adapter(runs[mode])
        for k in a:
            torch.testing.assert_close(a[k], b[k], atol=1e-5, rtol=1e-4, msg=f"{mode}: {k}")


@pytest.mark.parametrize("mode", ["fsdp2", "zero3"])
def test_the_fused_loss_and_selective_checkpointing_take_the_same_steps_when_sharded(tmp_path, tiny_model_dir,
                                                                                    real_prep, runs, mode):
    # lm_head's weight is sharded (FSDP2) or partitioned (ZeRO-3): the fused loss reads it inside the head's own
    # forward, where the wrappers' hooks have gathered it, and again in the backward's recompute
    out = tmp_path / "run"
    levers = ("--set", "fused_linear_loss=true", "--set", "loss_chunk_tokens=100", "--set",
              "gradient_checkpointing=true", "--set", "gradient_checkpointing_every_n_layers=2")
    r = subprocess.run(_launch(tiny_model_dir, real_prep, out, *ARGS, *levers, config=MODES[mode], nproc=2),
                       cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    start = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert (start["loss_impl"], start["checkpointed_layers"]) == ("fused_linear", 1)
    ref, got = _steps(runs["ddp"]), _steps(out)
    assert len(got) == STEPS
    assert [s["loss"] for s in got] == pytest.approx([s["loss"] for s in ref], rel=1e-4)
    a, b = _adapter(runs["ddp"]), _adapter(out)
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-4, rtol=1e-3, msg=f"{mode}: {k}")


def test_compiled_layers_train_alike_under_fsdp2_and_zero3(tmp_path, tiny_model_dir, real_prep):
    """Per-layer compile (on in the paper configs since the H100 measurements) under both sharding wrappers: FSDP2
    wraps the compiled layers, as torchtune does, and ZeRO-3's hooks gather around them. The two runs compute the
    same thing and must agree. Not compared with the eager runs: inductor draws the LoRA dropout's masks from its
    own generator (with dropout 0.1 the adapters then differ by 20% of their size after 8 steps, as any two seeds
    would)."""
    outs = {}
    for mode in ("fsdp2", "zero3"):
        outs[mode] = tmp_path / mode
        r = subprocess.run(_launch(tiny_model_dir, real_prep, outs[mode], *ARGS, "--set", "compile=true",
                                   config=MODES[mode], nproc=2),
                           cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, (mode, r.stderr[-3000:])
        start = json.loads((outs[mode] / "metrics.jsonl").read_text().splitlines()[0])
        assert start["compiled_layers"] == 2 == start["decoder_layers"], mode
    a, b = _steps(outs["fsdp2"]), _steps(outs["zero3"])
    assert len(a) == STEPS and a[0]["loss"] - a[-1]["loss"] > 0.1  # it trained
    assert [s["loss"] for s in b] == pytest.approx([s["loss"] for s in a], rel=1e-5)
    x, y = _adapter(outs["fsdp2"]), _adapter(outs["zero3"])
    for k in x:  # measured: 5.8e-7 at most
        torch.testing.assert_close(y[k], x[k], atol=1e-5, rtol=1e-4, msg=k)


def test_fsdp_two_processes_sigterm_saves_every_shard_and_resumes_exactly(tmp_path, tiny_model_dir, real_prep, runs):
    """FSDP2 over gloo through the shipped accelerate config; SIGTERM -> agreed save -> exit 75 -> resume, to the
    uninterrupted FSDP2 run's adapter.

    The workers alone get the signal, so that the launcher names their exit codes; the whole process group's
    SIGTERM (Slurm's way) is the ZeRO-3 case below."""
    ref = runs["fsdp2"]
    start = json.loads((ref / "metrics.jsonl").read_text().splitlines()[0])
    assert start["world_size"] == 2 and start["distributed"] == "FSDP2"
    run = tmp_path / "run"
    code, err = _interrupt(_launch(tiny_model_dir, real_prep, run, *_args("fsdp2"), config=MODES["fsdp2"], nproc=2),
                           run, 4, signal.SIGTERM, workers_only=True)
    # the first rank to end exited 75 (EX_TEMPFAIL, the documented code); the agent then SIGTERMs the ranks still
    # running (-15 in its report), and exits 1 itself
    assert code == 1 and "Root Cause (first observed failure):" in err, err[-3000:]
    root = err.rsplit("Root Cause (first observed failure):", 1)[1]
    assert re.search(r"exitcode\s*:\s*(-?\d+)", root)[1] == str(PREEMPTED_EXIT) == "75", err[-3000:]
    assert set(re.findall(r"exitcode\s*:\s*(-?\d+)", err)) <= {"75", str(-signal.SIGTERM)}, err[-3000:]
    assert (run / "PREEMPTED").is_file() and not (run / "adapter").exists()
    assert any('"event": "preempted"' in x for x in (run / "metrics.jsonl").read_text().splitlines())
    ckpts = sorted((run / "checkpoints").iterdir())
    assert len(ckpts) == 1 and (ckpts[0] / "COMPLETE").is_file()
    saved = load_file(ckpts[0] / "adapter" / "adapter_model.safetensors")
    base = load_file(tiny_model_dir / "model.safetensors")
    for name, t in saved.items():  # full shapes, and every row of every LoRA B trained away from its zero init
        out_f, in_f = base[name.replace("base_model.model.", "").rsplit(".lora_", 1)[0] + ".weight"].shape
        assert tuple(t.shape) == ((8, in_f) if "lora_A" in name else (out_f, 8)), (name, t.shape)
        if "lora_B" in name:
            assert (t.abs().sum(dim=1) > 0).all(), name
    r = _train(tiny_model_dir, real_prep, run, "fsdp2")
    assert r.returncode == 0, r.stderr[-3000:]
    assert not (run / "PREEMPTED").exists()
    _assert_same(_adapter(ref), _adapter(run))


@pytest.mark.parametrize("mode, sig, at_step", [("zero2", signal.SIGKILL, 6), ("zero3", signal.SIGTERM, 3)])
def test_deepspeed_resumes_exactly(tmp_path, tiny_model_dir, real_prep, runs, mode, sig, at_step):
    run = tmp_path / "run"
    code, _ = _interrupt(_launch(tiny_model_dir, real_prep, run, *_args(mode), config=MODES[mode], nproc=2),
                         run, at_step, sig)
    assert not (run / "adapter").exists()
    resumed_from = "step-0000004"  # SIGKILL: the last complete periodic checkpoint
    if sig == signal.SIGTERM:  # every rank agreed after the same micro-batch, saved its ZeRO partition, stopped
        assert (run / "PREEMPTED").is_file() and code != 0
        ckpt = Path((run / "PREEMPTED").read_text().strip())
        assert (ckpt / "COMPLETE").is_file() and any((ckpt / "deepspeed").rglob("*optim_states*"))
        resumed_from = ckpt.name
    r = _train(tiny_model_dir, real_prep, run, mode)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stderr and resumed_from in r.stderr
    _assert_same(_adapter(runs[mode]), _adapter(run))


def test_a_one_process_checkpoint_resumes_on_two_at_the_same_global_position(tmp_path, tiny_model_dir, real_prep):
    """The data position is per rank: 2 processes resuming 1 process's step must start at its global position
    (not skip to each rank's own 4th micro-batch) and keep 4 micro-batches per step (2 x grad_accum 2)."""
    args = ("--max-steps", "4", "--set", "optim.grad_accum=4", "--set", "checkpoint.every_steps=2",
            "--set", "optim.scheduler=linear", "--set", "data.eval_fraction=0")
    ref = tmp_path / "ref"
    r = subprocess.run(_launch(tiny_model_dir, real_prep, ref, *args), cwd=REPO_ROOT, capture_output=True,
                       text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    run = tmp_path / "run"  # the 1-process run's checkpoint of step 2, resumed by 2 processes
    shutil.copytree(ref / "checkpoints" / "step-0000002", run / "checkpoints" / "step-0000002")
    r = subprocess.run(_launch(tiny_model_dir, real_prep, run, *args, config=MODES["ddp"], nproc=2),
                       cwd=REPO_ROOT, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed 1 processes' checkpoint on 2: grad_accum 2 keeps 4 micro-batches per optimizer step" in r.stderr
    got, want = _steps(run), _steps(ref)[2:]
    assert [s["step"] for s in got] == [3, 4]
    assert [s["loss"] for s in got] == pytest.approx([s["loss"] for s in want], rel=1e-5)
    assert [s["lr"] for s in got] == pytest.approx([s["lr"] for s in want])
    a, b = _adapter(ref), _adapter(run)
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-5, rtol=1e-4, msg=k)
