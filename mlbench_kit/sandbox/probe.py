"""Whether a backend can run here, asked before anything runs: its tools are installed, and the unisolated one
has the user's consent. Running is :class:`~.sandbox.Sandbox`'s business; this only looks."""

from __future__ import annotations

import os
import shutil

from mlbench_kit.errors import MLBenchError

from .engines import engine

_PACKAGES = {"bwrap": "bubblewrap", "unshare": "util-linux", "setpriv": "util-linux"}  # Debian's, where not the tool's


def check_backend(backend: str, unsafe_local: bool) -> None:
    """Fail early, clearly, when a backend cannot run here or is unsafe without consent."""
    eng = engine(backend)
    if not eng.isolated:
        if not unsafe_local:
            raise MLBenchError(f"the {backend} backend runs untrusted generations without isolation",
                               f"--backend {backend}", "pass --unsafe-local to accept that, or use --backend bwrap")
        return
    for exe in eng.tools(os.geteuid() == 0):
        if shutil.which(exe) is None:
            pkg = _PACKAGES.get(exe, exe)
            raise MLBenchError(f"{exe} is not installed", f"--backend {backend}",
                               f"install it (Debian: apt-get install {pkg}), or choose another --backend")
