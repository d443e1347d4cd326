"""Progress bars only on a terminal; plain progress lines elsewhere (mlbench_kit/progress.py)."""

from __future__ import annotations

import fcntl
import io
import os
import pty
import struct
import subprocess
import sys
import termios

from conftest import REPO_ROOT

# a library's bar as vLLM, transformers or datasets draw one: tqdm with no `disable` given, on stderr
_LIBRARY_BAR = ("import sys, time; from mlbench_kit.progress import bars_only_on_tty; bars_only_on_tty(); "
                "from tqdm import tqdm; [time.sleep(0.01) for _ in tqdm(range(3), desc='lib', file=sys.stderr)]; "
                "print('done', file=sys.stderr)")


def _run(stderr: int) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TQDM_", "HF_HUB_DISABLE", "HF_DATASETS_DIS"))}
    subprocess.run([sys.executable, "-c", _LIBRARY_BAR], cwd=REPO_ROOT, env=env, stderr=stderr, check=True,
                   timeout=60)


def test_library_bars_off_in_a_pipe_and_on_on_a_terminal() -> None:
    r = subprocess.run([sys.executable, "-c", _LIBRARY_BAR], cwd=REPO_ROOT, capture_output=True, text=True,
                       timeout=60, env={k: v for k, v in os.environ.items() if not k.startswith("TQDM_")})
    assert r.stderr == "done\n", r.stderr
    main, sub = pty.openpty()
    fcntl.ioctl(sub, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # a pty's width is 0 until set
    try:
        _run(sub)
        os.close(sub)
        got = b""
        while True:
            try:
                chunk = os.read(main, 4096)
            except OSError:
                break
            if not chunk:
                break
            got += chunk
    finally:
        os.close(main)
    assert b"lib: 100%" in got and b"\r" in got  # a real bar on a terminal


def test_our_progress_is_plain_lines_off_a_terminal(monkeypatch) -> None:
    from mlbench_kit import progress
    clock = iter([0.0, 10.0, 40.0, 50.0, 100.0, 130.0])
    monkeypatch.setattr(progress.time, "monotonic", lambda: next(clock))
    out = io.StringIO()
    bar = progress.Progress(100, "pretrain", "step", stream=out, every=30)
    for extra in ("loss 4.1", "loss 3.2", "loss 2.5", "loss 2.0"):
        bar.update(20, extra)
    bar.close()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue()
    assert lines == ["pretrain: 40/100 steps (40%), loss 3.2, elapsed 0:40, ETA 1:00",
                     "pretrain: 80/100 steps (80%), loss 2.0, elapsed 1:40, ETA 0:25"], lines
