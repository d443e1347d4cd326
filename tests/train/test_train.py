"""train/: the LoRA recipe on a tiny Llama and real ML-Bench rows, through accelerate, killed and resumed."""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import torch
import yaml
from conftest import REPO_ROOT, assert_shared_modes, run_cli
from safetensors.torch import load_file

from mlbench_kit.cli import stage_config
from mlbench_kit.train.data import (
    IGNORE,
    collate,
    epoch_batches,
    load_examples,
    pack,
)
from mlbench_kit.train.loss import token_losses


def _launch(model: Path, prep: Path, out: Path, *extra: str, config: str = "configs/accelerate/single.yaml",
            nproc: int = 1) -> list[str]:
    acc = ["--config_file", config] if nproc > 1 else ["--num_processes", "1", "--cpu", "--mixed_precision", "no"]
    return [str(Path(sys.executable).with_name("accelerate")), "launch", *acc, "--main_process_port", "0",
            "train/lora.py", "--config", "configs/train/tiny-cpu.yaml", "--model", str(model), "--prep-dir", str(prep),
            "--out", str(out), "--max-context-tokens", "1024", *extra]


def _steps(out: Path) -> list[dict]:
    p = out / "metrics.jsonl"
    if not p.exists():
        return []
    return [json.loads(x) for x in p.read_text().splitlines() if x.strip().endswith("}") and '"loss"' in x]


def _interrupt(cmd: list[str], out: Path, at_step: int, sig: int, workers_only: bool = False) -> tuple[int, str]:
    """Start training, send ``sig`` once ``at_step`` steps are logged, return the exit status and (with
    ``workers_only``) stderr.

    The signal goes to every process of the launch, like Slurm's to every process of the step (torchrun's
    workers run in sessions of their own, so the launcher's process group alone would miss them, and after a
    SIGKILL they would train on as orphans beside the resumed run), or with ``workers_only`` to the launcher's
    children alone: the launcher then reports the workers' own exit codes (torchrun's agent exits 1 on a signal
    of its own, whatever its workers returned)."""
    proc = subprocess.Popen(cmd, cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            start_new_session=True, text=True)
    deadline = time.time() + 300
    tree: list[psutil.Process] = []
    while time.time() < deadline and proc.poll() is None:
        if len(_steps(out)) >= at_step:
            if workers_only:
                for child in psutil.Process(proc.pid).children():
                    child.send_signal(sig)
            else:
                tree = psutil.Process(proc.pid).children(recursive=True)  # before their parent can go
                os.killpg(proc.pid, sig)
                for p in tree:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        p.send_signal(sig)
            break
        time.sleep(0.05)
    if not workers_only:
        proc.wait(timeout=300)
        _, alive = psutil.wait_procs(tree, timeout=120)  # every process of the launch has ended: no orphan
        assert not alive, [p.cmdline() for p in alive]
        return proc.returncode, ""
    _, err = proc.communicate(timeout=300)  # the workers exited after their save: the pipe closes
    return proc.returncode, err


def _adapter(out: Path) -> dict[str, torch.Tensor]:
    return load_file(out / "adapter" / "adapter_model.safetensors")


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys() and a
    for k in a:
        torch.testing.assert_close(a[k], b[k], atol=1e-6, rtol=1e-5, msg=k)


@pytest.fixture(scope="module")
def examples(real_prep: Path, tiny_tokenizer):
    ex, _ = load_examples(real_prep / "id_train" / "task3.jsonl", tiny_tokenizer, "llama-inst", 1024)
    return ex


def test_labels_mask_the_prompt_and_train_answer_and_eos(examples, tiny_tokenizer, real_prep):
    rec = json.loads((real_prep / "id_train" / "task3.jsonl").read_text().splitlines()[0])
    ex = examples[0]
    n_prompt = len(tiny_tokenizer(rec["prompt"])["input_ids"])
    assert ex.input_ids[0] == tiny_tokenizer.bos_token_id and ex.input_ids[-1] == tiny_tokenizer.eos_token_id
    assert ex.labels[:n_prompt] == [IGNORE] * n_prompt
    assert ex.labels[n_prompt:] == ex.input_ids[n_prompt:]
    assert tiny_tokenizer.decode(ex.labels[n_prompt:-1]).strip() == rec["answer"].strip()


def test_packed_batch_gives_each_sample_its_own_loss(examples, tiny_model_dir, tiny_tokenizer):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa").eval()
    idx = [0, 1, 2]
    batch = collate(examples, [idx, [3]], tiny_tokenizer.pad_token_id)  # two packed rows: laid end to end
    packed = {k: v for k, v in batch.items() if k != "real_tokens"}
    assert "attention_mask" not in packed and packed["input_ids"].shape[0] == 1  # a batch of one (see collate)
    assert int(batch["real_tokens"]) == sum(len(examples[i]) for i in idx + [3])
    with torch.no_grad():
        per_tok = token_losses(model(**packed, use_cache=False).logits, packed["labels"])
        offset = 0
        for i in idx:
            alone = {k: v for k, v in collate(examples, [[i]], tiny_tokenizer.pad_token_id).items()
                     if k != "real_tokens"}
            ref = token_losses(model(**alone, use_cache=False).logits, alone["labels"])
            n = len(examples[i])
            got = per_tok[0, offset: offset + n - 1]
            torch.testing.assert_close(got, ref[0], atol=1e-4, rtol=1e-4)
            offset += n
        # naive concatenation with one causal mask (what packing must not be) changes the later samples' loss
        naive = {k: v for k, v in packed.items() if k != "position_ids"}
        leak = token_losses(model(**naive, use_cache=False).logits, naive["labels"])
        assert not torch.allclose(leak[0, len(examples[0]):offset - 1], per_tok[0, len(examples[0]):offset - 1])


def test_packing_fills_sequences_and_epochs_are_reproducible(examples):
    lengths = [len(e) for e in examples]
    bins = pack(lengths, 1024)
    assert sorted(i for b in bins for i in b) == list(range(len(examples)))
    assert all(sum(lengths[i] for i in b) <= 1024 for b in bins)
    assert sum(lengths) / (len(bins) * 1024) > 0.9
    a = epoch_batches(examples, "packing", 1, 1024, seed=3, epoch=1)
    assert a == epoch_batches(examples, "packing", 1, 1024, seed=3, epoch=1)
    assert a != epoch_batches(examples, "packing", 1, 1024, seed=3, epoch=2)


@pytest.mark.integration
def test_overfitting_a_handful_of_prompts_drives_the_loss_down(tmp_path, tiny_model_dir, real_prep):
    few = tmp_path / "few.jsonl"
    few.write_text("".join((real_prep / "id_train" / "task3.jsonl").read_text().splitlines(True)[:4]))
    out = tmp_path / "run"
    r = subprocess.run(_launch(tiny_model_dir, real_prep, out, "--set", f"data.path={few}", "--set",
                               "data.eval_fraction=0", "--epochs", "30", "--lr", "1e-2"),
                       cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    losses = [s["loss"] for s in _steps(out)]
    assert len(losses) >= 30, losses
    first, last = sum(losses[:5]) / 5, sum(losses[-5:]) / 5
    assert last < 0.8 * first, (first, last)  # LoRA on a random-init base: a clear fall, not a collapse to 0
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["optim"]["lr"] == 1e-2 and saved["data"]["path"] == str(few)


@pytest.mark.integration
def test_sigkill_between_checkpoints_then_resume_equals_uninterrupted(tmp_path, tiny_model_dir, real_prep,
                                                                    umask_022):
    args = ("--max-steps", "16", "--set", "checkpoint.every_steps=4", "--set", "lora.dropout=0.1")
    ref = tmp_path / "ref"
    assert subprocess.run(_launch(tiny_model_dir, real_prep, ref, *args), cwd=REPO_ROOT,
                          capture_output=True, timeout=600).returncode == 0
    # a labmate can load the adapter and resume from the checkpoint (safetensors alone writes them 0600)
    last = sorted((ref / "checkpoints").glob("step-*"))[-1]
    assert_shared_modes(ref / "adapter" / "adapter_model.safetensors", ref / "config.yaml", ref / "run.json",
                        last / "trainable.safetensors", last / "optimizer.pt", last / "trainer_state.json",
                        last / "adapter" / "adapter_model.safetensors")
    run = tmp_path / "run"
    assert _interrupt(_launch(tiny_model_dir, real_prep, run, *args), run, 10, signal.SIGKILL)[0] == -signal.SIGKILL
    assert not (run / "adapter").exists()
    # a half-written checkpoint (no COMPLETE, or still .tmp) must be ignored
    (run / "checkpoints" / "step-0000015.tmp").mkdir()
    (run / "checkpoints" / "step-0000014").mkdir(exist_ok=True)
    r = subprocess.run(_launch(tiny_model_dir, real_prep, run, *args), cwd=REPO_ROOT, capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resumed from" in r.stderr and "step-0000008" in r.stderr
    _assert_same(_adapter(ref), _adapter(run))


@pytest.mark.integration
def test_qlora_nf4_with_gradient_checkpointing_takes_real_steps_on_cpu(tmp_path, tiny_model_dir, real_prep):
    out = tmp_path / "q"
    r = subprocess.run(_launch(tiny_model_dir, real_prep, out, "--max-steps", "3", "--set", "quantization=nf4",
                               "--set", "gradient_checkpointing=true", "--set", "attn_implementation=auto",
                               "--set", "merge=true"),
                       cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    start = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert start["linear_4bit_modules"] == 2 * 7  # 2 layers x 7 projections quantized to NF4
    # the kernel the loaded model resolved, not the request; packed rows get sdpa's dense block-diagonal mask
    assert (start["attention_requested"], start["attention"], start["attention_packed"]) == \
        ("auto", "sdpa", "dense_mask")
    assert start["device"] == "cpu" and start["gpu"] is None and start["peak_tflops"] is None
    assert "use_reentrant" not in r.stderr  # torch warns when checkpoint() is called without the setting
    # non-reentrant checkpointing, asked for explicitly: read back from the model the recipe builds with this run's
    # resolved config (the warning says nothing of an explicit use_reentrant=True, nor of a default the recipe
    # left to transformers, which is non-reentrant in 5.19 whatever the recipe asks)
    from mlbench_kit.train.model import add_lora, load_base
    run_cfg = stage_config("train", ["--config", str(out / "config.yaml")])
    assert run_cfg.quantization == "nf4" and run_cfg.gradient_checkpointing
    peft_model = add_lora(load_base(run_cfg, "fp32", "sdpa", device_map={"": "cpu"}), run_cfg)
    layers = [m for m in peft_model.modules() if getattr(m, "gradient_checkpointing", False)]
    assert len(layers) >= 2 and all(m._gradient_checkpointing_func.keywords == {"use_reentrant": False}
                                    for m in layers), [m._gradient_checkpointing_func for m in layers]
    steps = _steps(out)
    assert len(steps) == 3 and all(math.isfinite(s["loss"]) and s["grad_norm"] > 0 for s in steps)
    # model FLOPs are counted on CPU too; the hardware count adds the checkpointing recompute; no peak, no MFU
    assert all(0 < s["model_tflops_per_s"] < s["hardware_tflops_per_s"] and s["mfu"] is None for s in steps)
    # merge: true folds the adapter into the NF4-dequantized base, the weights training saw: the merged model
    # computes what the trained QLoRA model computes, which the adapter on the full-precision base does not
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from mlbench_kit.train.model import nf4_config
    merged_event = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
    assert merged_event["event"] == "merged" and merged_event["how"] == "NF4-dequantized base, merged on cpu"
    x = torch.tensor([[1, 50, 60, 70, 80, 90, 100]])
    nf4 = AutoModelForCausalLM.from_pretrained(tiny_model_dir, quantization_config=nf4_config(torch.float32),
                                               device_map={"": "cpu"})
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(out / "merged").eval()(x).logits
        trained = PeftModel.from_pretrained(nf4, out / "adapter").eval()(x).logits
        on_full = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                                            out / "adapter").eval()(x).logits
        dequantized = PeftModel.from_pretrained(
            AutoModelForCausalLM.from_pretrained(tiny_model_dir, quantization_config=nf4_config(torch.float32),
                                                 device_map={"": "cpu"}).dequantize(dtype=torch.float32),
            out / "adapter").eval()(x).logits
    torch.testing.assert_close(merged, dequantized, atol=1e-5, rtol=1e-5)
    # bitsandbytes' CPU 4-bit matmul rounds on its own (~4e-3 here); the full-precision base is 30x further off
    assert (merged - trained).abs().max() * 10 < (on_full - trained).abs().max()


@pytest.mark.integration
def test_adapter_loads_in_transformers_and_changes_logits(trained_adapter, tiny_model_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    x = torch.tensor([[1, 50, 60, 70, 80]])
    with torch.no_grad():
        before = base(x).logits
        tuned = PeftModel.from_pretrained(base, trained_adapter).eval()
        after = tuned(x).logits
    assert not torch.allclose(before, after, atol=1e-4)
    meta = json.loads((trained_adapter / "mlbench_train.json").read_text())
    assert meta["base_fingerprint"]["hidden_size"] == 128 and meta["task"] == 3


@pytest.mark.parametrize("path", sorted((REPO_ROOT / "configs" / "train").glob("*.yaml")), ids=lambda p: p.stem)
def test_shipped_train_configs_resolve(path, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM
    needs_model = yaml.safe_load(path.read_text())["model"] is None  # the CPU configs take --model
    cfg = stage_config("train", ["--config", str(path), *(["--model", "dummy"] if needs_model else []), "--split",
                                 "ood"])
    assert cfg.family and cfg.template in ("paper", "llama-inst", "chat")
    assert str(cfg.out).endswith(f"task3-ood-s{cfg.seed}")
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                             num_attention_heads=2, vocab_size=100))
    present = {n.rsplit(".", 1)[-1] for n, _ in model.named_modules()}
    assert set(cfg.lora.target_modules) <= present


@pytest.mark.parametrize("path", sorted((REPO_ROOT / "configs" / "accelerate").glob("*.yaml")), ids=lambda p: p.stem)
def test_shipped_accelerate_configs_parse(path):
    from accelerate.commands.config.config_args import ClusterConfig
    parsed = ClusterConfig.from_yaml_file(str(path))  # accelerate's own loader: refuses unknown keys and types
    cfg = yaml.safe_load(path.read_text())
    assert parsed.distributed_type.value in ("NO", "MULTI_GPU", "FSDP", "DEEPSPEED") and parsed.num_processes >= 1
    if cfg.get("use_cpu") or path.stem.endswith("-cpu"):
        assert cfg.get("use_cpu") is True and path.stem.endswith("-cpu")  # a -cpu config that is not CPU-only
    if cfg["distributed_type"] == "FSDP":
        assert cfg["fsdp_config"]["fsdp_version"] == 2


@pytest.mark.integration
def test_the_card_command_verbatim_offline_then_with_a_local_model(tmp_path, tiny_model_dir, real_prep):
    """`accelerate launch train/lora.py --task 3` from the repository root, as the model card prints it."""
    card = [str(Path(sys.executable).with_name("accelerate")), "launch", "train/lora.py", "--task", "3"]
    # offline: a closed port on loopback stands for the unreachable hub, an empty HF_HOME for an empty cache
    offline = {**os.environ, "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HOME": str(tmp_path / "hf")}
    offline.pop("HF_HUB_OFFLINE", None)
    r = subprocess.run(card, cwd=REPO_ROOT, env=offline, capture_output=True, text=True, timeout=300)
    ours = [ln for ln in r.stderr.splitlines() if ln.startswith(("train:", "error:", "  fix:"))]
    import torch
    if not torch.cuda.is_available():  # the default's 7B model on a CPU: the error names the CPU config
        assert r.returncode != 0 and ours[0].startswith("error: --config: no --config: train's default ") and \
            "--config configs/train/tiny-cpu.yaml" in ours[1] and len(ours) == 2, r.stderr[-3000:]
    else:
        assert r.returncode != 0 and ours[0].startswith(
            "train: config configs/train/codellama-7b-instruct.yaml (the default; --config to choose), model "
            "codellama/CodeLlama-7b-Instruct-hf, data prep/id_train/task3.jsonl"), r.stderr[-3000:]
        assert ours[1].startswith("error: codellama/CodeLlama-7b-Instruct-hf: ") and "cannot be reached" in ours[1]
        assert "--model DIR" in ours[2] and len(ours) == 3, ours
    assert not (REPO_ROOT / "runs/train/codellama-task3-id-s42").exists()  # nothing half-written
    # a local model but no prep folder: the next clear error, naming the file and how to make it
    r = subprocess.run(card + ["--model", str(tiny_model_dir), "--prep-dir", str(tmp_path / "none")], cwd=REPO_ROOT,
                       env=offline, capture_output=True, text=True, timeout=300)
    assert r.returncode != 0 and f"error: {tmp_path / 'none'}/id_train/task3.jsonl: no prep records" in r.stderr
    # with --model and a prep folder, the same command trains (the default CodeLlama config: llama-inst prompts)
    out = tmp_path / "run"
    r = subprocess.run(card + ["--model", str(tiny_model_dir), "--prep-dir", str(real_prep), "--out", str(out),
                               "--max-steps", "1", "--grad-accum", "1", "--max-context-tokens", "512"],
                       cwd=REPO_ROOT, env=offline, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (out / "adapter" / "adapter_config.json").is_file() and len(_steps(out)) == 1


@pytest.mark.integration
def test_a_checkpoint_from_another_config_is_never_resumed(tmp_path, tiny_model_dir, real_prep):
    # seen in a real run: a SIGTERM'd training finished its agreed save after its folder had been emptied and
    # claimed by a run of another config, which then resumed that checkpoint as its own
    out = tmp_path / "run"
    r = subprocess.run(_launch(tiny_model_dir, real_prep, out, "--max-steps", "2", "--set", "checkpoint.every_steps=1"),
                       cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    shutil.rmtree(out / "adapter")
    (out / "run.json").unlink()  # the folder claimed afresh, the old run's checkpoint still there
    r = subprocess.run(_launch(tiny_model_dir, real_prep, out, "--max-steps", "3", "--lr", "1e-3"), cwd=REPO_ROOT,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode != 0 and "this checkpoint was made under another config" in r.stderr, r.stderr[-3000:]
    assert "step-0000002" in r.stderr and not (out / "adapter").exists()


@pytest.mark.integration
def test_bad_config_and_mismatched_template_fail_clearly(tmp_path, tiny_model_dir, real_prep):
    r = run_cli("mlbench", "train", "--config", "configs/train/tiny-cpu.yaml", "--model", tiny_model_dir,
                "--set", "optim.lr_typo=1")
    assert r.returncode == 2 and "--set optim.lr_typo=1: unknown key 'optim.lr_typo'" in r.stderr
    r = run_cli("mlbench", "train", "--config", "configs/train/tiny-cpu.yaml", "--model", tiny_model_dir,
                "--set", "data.batching=zip")
    assert r.returncode == 2 and "data.batching must be one of 'packing', 'grouped', 'padding'" in r.stderr
    r = run_cli("mlbench", "train", "--config", "configs/train/tiny-cpu.yaml", "--model", tiny_model_dir,
                "--prep-dir", real_prep, "--set", "template=chat", "--out", tmp_path / "x")
    assert r.returncode == 2 and "task3.jsonl:1" in r.stderr and "template" in r.stderr


FA2, FA3 = "flash_attention_2", "flash_attention_3"


@pytest.mark.parametrize("capability, installed, expected", [
    (None, {FA2, FA3}, "sdpa"),  # no GPU
    ((7, 5), {FA2}, "sdpa"),  # Turing: FA2 would fail at the first forward, flex is not measured there
    ((8, 0), {FA2}, FA2),  # A100
    ((8, 9), {FA2, FA3}, FA2),  # L40S: FA3 is Hopper-only
    ((9, 0), {FA2}, FA2),  # H100 without FA3
    ((9, 0), {FA2, FA3}, FA3),
    ((9, 0), {FA3}, FA3),
    ((9, 0), set(), "flex_attention"),  # no flash kernels: flex's BlockMask (1.31x SDPA's dense mask, H100)
    ((8, 0), set(), "flex_attention"),
    ((7, 5), set(), "sdpa"),
    ((10, 0), {FA2, FA3}, FA2),  # Blackwell: FA3's Hopper kernels do not run there
])
def test_auto_attention_follows_the_gpu_generation(capability, installed, expected):
    from mlbench_kit.train.model import choose_attention
    assert choose_attention("auto", capability, frozenset(installed)) == expected


def test_a_flash_request_this_gpu_cannot_run_is_refused():
    from mlbench_kit.errors import MLBenchError
    from mlbench_kit.train.model import choose_attention
    with pytest.raises(MLBenchError, match="8.0\\+.*compute capability 7.5"):
        choose_attention(FA2, (7, 5), frozenset({FA2}))
    with pytest.raises(MLBenchError, match="flash-attn is not installed"):
        choose_attention(FA2, (9, 0), frozenset())
    with pytest.raises(MLBenchError, match="Hopper.*compute capability 8.0"):
        choose_attention(FA3, (8, 0), frozenset({FA2, FA3}))
    assert choose_attention("sdpa", None, frozenset()) == "sdpa"
    assert choose_attention(FA2, (8, 6), frozenset({FA2})) == FA2


def test_resume_on_another_world_size_keeps_the_step_or_says_what_to_do():
    from mlbench_kit.errors import MLBenchError
    from mlbench_kit.train.checkpoint import rank_position, regroup
    assert regroup(1, 4, 2, False, "ck") == 2 and regroup(2, 2, 4, False, "ck") == 1
    assert regroup(4, 1, 2, False, "ck") == 2
    assert regroup(2, 3, 2, True, "ck") == 3  # same world: nothing changes, DeepSpeed included
    with pytest.raises(MLBenchError) as e:
        regroup(1, 1, 2, False, "ck")
    assert "1 processes x grad_accum 1 = 1 micro-batches per optimizer step" in e.value.what
    assert "this launch has 2 processes" in e.value.what and "divides 1" in e.value.fix
    with pytest.raises(MLBenchError, match="ZeRO checkpoint holds one optimizer partition per rank"):
        regroup(2, 2, 4, True, "ck")
    # 1 process did 8 micro-batches of an epoch of 21: on 2 processes each rank has done 4 (global 0..7 done)
    assert rank_position(8, 1, 2, 21) == 4 and rank_position(4, 2, 1, 21) == 8
    assert rank_position(21, 1, 2, 21) == 10  # a finished epoch stays finished (2 ranks use 20 of the 21)


def test_varlen_boundaries_computed_once_equal_transformers_own(examples, tiny_tokenizer):
    from transformers.modeling_flash_attention_utils import (
        prepare_fa_kwargs_from_position_ids,
    )

    from mlbench_kit.train.data import varlen_kwargs
    batch = collate(examples, [[0, 1, 2, 3]], tiny_tokenizer.pad_token_id)
    (cu_q, cu_k), (max_q, max_k) = prepare_fa_kwargs_from_position_ids(batch["position_ids"])
    got = varlen_kwargs(batch["position_ids"])
    assert torch.equal(got["cu_seq_lens_q"], cu_q) and torch.equal(got["cu_seq_lens_k"], cu_k)
    assert got["max_length_q"] == int(max_q) == got["max_length_k"] == max(len(examples[i]) for i in range(4))


def test_the_gpu_lock_satisfies_the_gpu_extras_and_pins_the_stack():
    import tomllib
    from packaging.requirements import Requirement
    pins = {}
    for line in (REPO_ROOT / "constraints" / "gpu.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, line  # every line an exact pin
            pins[name.lower().replace("_", "-")] = version
    extras = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    for spec in extras["gpu"] + extras["flash"]:
        req = Requirement(spec)
        assert req.name.lower() in pins and req.specifier.contains(pins[req.name.lower()]), spec
    for name in ("torch", "vllm", "transformers", "peft", "bitsandbytes", "accelerate", "deepspeed", "flash-attn"):
        assert name in pins, name
    cpu = dict(x.split("==") for x in (REPO_ROOT / "constraints" / "cpu.txt").read_text().splitlines()
               if "==" in x and not x.startswith("#"))
    for name in ("transformers", "peft", "bitsandbytes", "accelerate", "deepspeed"):  # what the CPU tests ran
        assert pins[name] == cpu[name], name
    assert cpu["torch"].split("+")[0] == pins["torch"]


@pytest.mark.integration
def test_mlbench_train_launches_its_processes_through_accelerate(tmp_path, tiny_model_dir, real_prep):
    """`mlbench train --nproc 2 --accelerate-config ...`: the card's multi-process run without the checkout's
    train/lora.py path; 2 CPU processes (DDP over gloo) train the config the command resolved."""
    out = tmp_path / "run"
    r = run_cli("mlbench", "train", "--nproc", "2", "--accelerate-config", "configs/accelerate/ddp-cpu.yaml",
                "--config", "configs/train/tiny-cpu.yaml", "--model", tiny_model_dir, "--prep-dir", real_prep,
                "--out", out, "--max-context-tokens", "1024", "--max-steps", "2", "--set", "optim.grad_accum=1",
                timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "train: launching through accelerate: " in r.stderr and " -m mlbench_kit.train.lora " in r.stderr
    start = json.loads((out / "metrics.jsonl").read_text().splitlines()[0])
    assert start["world_size"] == 2
    assert [s["step"] for s in _steps(out)] == [1, 2] and (out / "adapter" / "adapter_model.safetensors").is_file()
    want = stage_config("train", ["--config", "configs/train/tiny-cpu.yaml", "--model", str(tiny_model_dir),
                                  "--prep-dir", str(real_prep), "--out", str(out), "--max-context-tokens", "1024",
                                  "--max-steps", "2", "--set", "optim.grad_accum=1"])
    # what the processes trained: what was asked
    assert stage_config("train", ["--config", str(out / "config.yaml")]) == want
    # a bad launch is refused before any process starts, with the flag to fix
    r = run_cli("mlbench", "train", "--nproc", "2", "--accelerate-config", tmp_path / "none.yaml", "--config",
                "configs/train/tiny-cpu.yaml", "--model", tiny_model_dir, "--prep-dir", real_prep, "--out",
                tmp_path / "bad")
    assert r.returncode == 2 and "accelerate config not found" in r.stderr and not (tmp_path / "bad").exists()


LIBRARY_NOISE = ("pip install kernels", "Setting accelerator to CPU")  # bitsandbytes' and DeepSpeed's, on a CPU


@pytest.mark.integration
def test_library_warnings_go_to_the_run_s_log_not_the_terminal(tmp_path, tiny_model_dir, real_prep):
    """Issue 43: bitsandbytes' "pip install kernels" (logged while train/lora.py imports it) and DeepSpeed's
    accelerator warning reached train's terminal; infer sends such noise to its log. The recipe's own lines stay
    on the terminal."""
    out = tmp_path / "run"
    r = subprocess.run(_launch(tiny_model_dir, real_prep, out, "--max-steps", "1", "--set", "data.eval_fraction=0"),
                       cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    log = (out / "logs" / "train.log").read_text()
    said = [n for n in LIBRARY_NOISE if n in log]
    if not said:
        pytest.skip("neither library warned on this machine (bitsandbytes warns on CPUs with AVX512-BF16)")
    assert [n for n in LIBRARY_NOISE if n in r.stderr + r.stdout] == [], r.stderr[-3000:]
    assert f"train: library logs in {out / 'logs' / 'train.log'}" in r.stderr
    assert "train: 1/1 steps (100%)" in r.stderr and "train: done, 1 steps" in r.stderr, r.stderr[-3000:]


def test_a_launched_cpu_process_gets_the_cores_not_accelerates_one_thread(tmp_path, monkeypatch):
    # accelerate launch sets OMP_NUM_THREADS=1 unless told (or --cpu): `mlbench train --nproc 1` and real.sh's LoRA
    # trained on one of two cores (45 tok/s instead of ~100 for SmolLM2)
    import argparse

    from mlbench_kit.train.cli import launch_command
    args = argparse.Namespace(accelerate_config=None, nproc=1, resume="auto")
    probe = tmp_path / "probe.py"
    probe.write_text("import torch; print(torch.get_num_threads())\n")
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cmd = launch_command(tmp_path / "c.yaml", args)
    r = subprocess.run([*cmd[:cmd.index("-m", 3)], str(probe)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split()[-1] == str(len(os.sched_getaffinity(0))), (r.stdout, r.stderr[-1000:])
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # a value the user set is theirs: accelerate passes it on
    assert "--num_cpu_threads_per_process" not in launch_command(tmp_path / "c.yaml", args)
