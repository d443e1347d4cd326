"""Files are written for a shared cluster: every output gets the mode the umask allows, as a plain ``open()``
would give it, including the writers that make 0600 files whatever the umask (``mkstemp``, safetensors)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from mlbench_kit.io import atomic_dir, honour_umask, write_atomic, write_json_atomic


def mode(p: Path) -> int:
    return stat.S_IMODE(os.lstat(p).st_mode)


@pytest.mark.parametrize("umask, file_mode, dir_mode", [(0o022, 0o644, 0o755), (0o027, 0o640, 0o750),
                                                        (0o077, 0o600, 0o700)])
def test_atomic_writes_honour_the_umask(tmp_path: Path, umask: int, file_mode: int, dir_mode: int) -> None:
    old = os.umask(umask)
    try:
        write_atomic(tmp_path / "report.md", "# report\n")
        write_json_atomic(tmp_path / "summary.json", {"a": 1})
        with atomic_dir(tmp_path / "adapter") as tmp:
            save_file({"w": torch.zeros(2)}, tmp / "adapter_model.safetensors")  # safetensors: 0600 by itself
            (tmp / "sub").mkdir()
            (tmp / "sub" / "run.sh").write_text("#!/bin/sh\n")
            (tmp / "sub" / "run.sh").chmod(0o700)
            (tmp / "link").symlink_to("sub")
    finally:
        os.umask(old)
    assert mode(tmp_path / "report.md") == file_mode and mode(tmp_path / "summary.json") == file_mode
    assert mode(tmp_path / "adapter" / "adapter_model.safetensors") == file_mode
    assert mode(tmp_path / "adapter") == mode(tmp_path / "adapter" / "sub") == dir_mode
    assert mode(tmp_path / "adapter" / "sub" / "run.sh") == dir_mode  # an executable stays executable
    assert (tmp_path / "adapter" / "link").is_symlink()


def test_honour_umask_on_one_file_and_a_failed_block_publishes_nothing(tmp_path: Path) -> None:
    f = tmp_path / "weights.safetensors"
    old = os.umask(0o022)
    try:
        save_file({"w": torch.zeros(1)}, f)
        assert mode(f) == 0o600  # why this exists: the library ignores the umask
        honour_umask(f)
        with pytest.raises(RuntimeError), atomic_dir(tmp_path / "out") as tmp:
            (tmp / "half").write_text("x")
            raise RuntimeError("interrupted")
    finally:
        os.umask(old)
    assert mode(f) == 0o644
    assert not (tmp_path / "out").exists() and not (tmp_path / "out.tmp").exists()
