"""A checkpoint is data, never code (issue 30, item 2): every .pt file of a checkpoint loads with
``torch.load(weights_only=True)``; a file that would run code is refused before it can; a checkpoint without a
config hash is not resumed."""

from __future__ import annotations

import random
import types
from pathlib import Path

import numpy as np
import pytest
import torch

from mlbench_kit.errors import MLBenchError
from mlbench_kit.train.checkpoint import (
    TrainState,
    check_resumable,
    load_checkpoint,
    rng_state,
    save_checkpoint,
)


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 3)

    def save_pretrained(self, path, state_dict=None, safe_serialization=True) -> None:
        Path(path, "adapter_model.marker").write_text("ok")


class _Tok:
    def save_pretrained(self, path) -> None:
        Path(path, "tokenizer.marker").write_text("ok")


def _accelerator():
    from accelerate.utils import DistributedType
    return types.SimpleNamespace(distributed_type=DistributedType.NO, process_index=0, num_processes=1,
                                 is_main_process=True, wait_for_everyone=lambda: None, unwrap_model=lambda m: m)


def _trained(seed: int = 0):
    torch.manual_seed(seed)
    model = _Model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    for _ in range(3):
        model.lin(torch.randn(2, 4)).sum().backward()
        opt.step()
        sched.step()
        opt.zero_grad()
    return model, opt, sched


def _save(tmp_path: Path) -> Path:
    model, opt, sched = _trained()
    random.seed(7)
    np.random.seed(7)
    torch.manual_seed(7)
    np.random.normal()  # numpy's cached gaussian is part of its state
    return save_checkpoint(_accelerator(), model, opt, sched, tmp_path / "checkpoints",
                           TrainState(step=3, config_sha="abc"), rng_state(), _Tok(), {}, keep=2)


class _Evil:
    """Pickles as a call that writes ``marker``: what a hostile run folder's .pt file holds."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (exec, (f"open({str(self.marker)!r}, 'w').write('ran')",))


def test_a_checkpoint_round_trips_through_the_safe_loader(tmp_path):
    ck = _save(tmp_path)
    want = (random.random(), float(np.random.rand()), float(np.random.normal()), torch.rand(1).item())
    for f in ("optimizer.pt", "scheduler.pt", "rng-0.pt"):  # each loads as plain tensors and types
        torch.load(ck / f, weights_only=True)
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    model, opt, sched = _trained(seed=5)
    state = load_checkpoint(_accelerator(), model, opt, sched, ck)
    assert state.step == 3 and state.config_sha == "abc"
    assert (random.random(), float(np.random.rand()), float(np.random.normal()), torch.rand(1).item()) == want
    ref_model, ref_opt, ref_sched = _trained()
    assert torch.equal(model.lin.weight, ref_model.lin.weight)
    for k, v in ref_opt.state_dict()["state"][0].items():
        assert torch.equal(opt.state_dict()["state"][0][k], v), k
    assert sched.state_dict()["last_epoch"] == ref_sched.state_dict()["last_epoch"] == 3


@pytest.mark.parametrize("name", ["optimizer.pt", "scheduler.pt", "rng-0.pt"])
def test_a_pickle_that_would_run_code_is_refused_and_never_runs(tmp_path, name):
    ck = _save(tmp_path)
    marker = tmp_path / "marker"
    torch.save({"state": _Evil(marker)}, ck / name)
    model, opt, sched = _trained()
    with pytest.raises(MLBenchError) as ei:
        load_checkpoint(_accelerator(), model, opt, sched, ck)
    assert str(ck / name) in ei.value.render() and "weights_only=True" in ei.value.what
    assert "builtins.exec" in ei.value.what  # names what the file would have run
    assert not marker.exists()


def test_an_older_random_state_file_still_loads_without_unpickling(tmp_path):
    """Before format 2 the RNG file held numpy's state as an ndarray: loaded with numpy's array reconstruction
    allowed, nothing else."""
    ck = _save(tmp_path)
    random.seed(3)
    np.random.seed(3)
    torch.manual_seed(3)
    torch.save({"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()},
               ck / "rng-0.pt")
    want = (random.random(), float(np.random.rand()), torch.rand(1).item())
    np.random.seed(9)
    model, opt, sched = _trained()
    load_checkpoint(_accelerator(), model, opt, sched, ck)
    assert (random.random(), float(np.random.rand()), torch.rand(1).item()) == want


def test_a_checkpoint_without_a_config_hash_is_not_resumed():
    with pytest.raises(MLBenchError, match="records no config hash"):
        check_resumable(TrainState(step=4), ("abc", "def"), "ck")
    with pytest.raises(MLBenchError, match="under another config"):
        check_resumable(TrainState(step=4, config_sha="xyz"), ("abc", "def"), "ck")
    check_resumable(TrainState(step=4, config_sha="def"), ("abc", "def"), "ck")


def test_deepspeeds_own_loads_are_forced_to_weights_only(tmp_path):
    """DeepSpeed loads its ZeRO files with torch.load(weights_only=False): inside load_checkpoint every torch.load
    is forced to weights_only=True, DeepSpeed's three state classes allowed, nothing else."""
    from mlbench_kit.train.checkpoint import _deepspeed_globals, weights_only_loads
    marker = tmp_path / "marker"
    evil = tmp_path / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    torch.save({"optimizer_state_dict": _Evil(marker)}, evil)
    fine = tmp_path / "fine.pt"
    from deepspeed.runtime.zero.config import ZeroStageEnum
    torch.save({"zero_stage": ZeroStageEnum.gradients, "w": torch.ones(2)}, fine)
    with weights_only_loads(_deepspeed_globals(), tmp_path):
        with pytest.raises(MLBenchError) as ei:
            torch.load(evil, map_location="cpu", weights_only=False)  # as DeepSpeed calls it
        got = torch.load(fine, map_location="cpu", weights_only=False)
    assert str(evil) in ei.value.render() and not marker.exists()
    assert got["zero_stage"] == ZeroStageEnum.gradients and torch.equal(got["w"], torch.ones(2))
    assert torch.load(fine, weights_only=False)["zero_stage"] == ZeroStageEnum.gradients  # restored after the block


class _ByGetattr:
    """Pickles as ``getattr(owner, name)``, as Debian's Python 3.11.2 pickles an Enum member (3.11.7: by value)."""

    def __init__(self, owner: object, name: str) -> None:
        self.owner, self.name = owner, name

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return getattr, (self.owner, self.name)


def test_deepspeeds_enums_pickled_by_getattr_load_and_nothing_else_does(tmp_path):
    """A ZeRO checkpoint written by a Python that pickles Enum members as getattr(cls, name) resumes (it failed as
    an unprivileged user on Debian's python3); getattr for anything but an allowed Enum's member is refused."""
    from deepspeed.runtime.zero.config import ZeroStageEnum

    from mlbench_kit.train.checkpoint import _deepspeed_globals, weights_only_loads
    member, other = tmp_path / "member.pt", tmp_path / "other.pt"
    torch.save({"zero_stage": _ByGetattr(ZeroStageEnum, "gradients")}, member)
    torch.save({"x": _ByGetattr(ZeroStageEnum, "__class__")}, other)
    with weights_only_loads(_deepspeed_globals(), tmp_path):
        assert torch.load(member, weights_only=False)["zero_stage"] is ZeroStageEnum.gradients
        with pytest.raises(MLBenchError, match="other.pt"):
            torch.load(other, weights_only=False)
