"""Container base images without a registry: a Debian root filesystem (``mmdebstrap``) imported into the engine.

No registry may be reachable (clusters behind firewalls, our CI), but Debian's package mirror usually is. The
image holds Debian's Python (``python`` and ``python3``) and what the runner needs; environment images are
built on top of it from recipes (``mlbench env build --image``).
"""

from __future__ import annotations

import shutil
import subprocess

from mlbench_kit.errors import MLBenchError

BASE_TAG = "localhost/mlbench-base:bookworm"
BASE_PACKAGES = ("python3", "python-is-python3", "python3-venv", "python3-pip", "ca-certificates", "git", "bash",
                 "coreutils")


def image_exists(tag: str, engine: str = "podman") -> bool:
    """Whether ``engine`` has ``tag`` locally."""
    r = subprocess.run([engine, "image", "inspect", tag], capture_output=True)
    return r.returncode == 0


def build_base_image(tag: str = BASE_TAG, suite: str = "bookworm", mirror: str = "http://deb.debian.org/debian",
                     engine: str = "podman", packages: tuple[str, ...] = BASE_PACKAGES, force: bool = False) -> str:
    """Build ``tag`` from a Debian root filesystem unless it exists; returns the tag."""
    if not force and image_exists(tag, engine):
        return tag
    for exe, pkg in (("mmdebstrap", "mmdebstrap"), (engine, engine)):
        if shutil.which(exe) is None:
            raise MLBenchError(f"{exe} is not installed", "base image", f"apt-get install {pkg}")
    mm = subprocess.Popen(["mmdebstrap", "--quiet", "--variant=apt", f"--include={','.join(packages)}", suite, "-",
                           mirror], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert mm.stdout is not None and mm.stderr is not None  # both piped
    imp = subprocess.run([engine, "import", "--change", "CMD=/bin/bash", "-", tag], stdin=mm.stdout,
                         capture_output=True, text=True)
    mm.stdout.close()
    err = mm.stderr.read().decode(errors="replace")
    if mm.wait() != 0 or imp.returncode != 0:
        raise MLBenchError(f"building the base image {tag} failed: {(err or imp.stderr).strip()[-600:]}",
                           f"mmdebstrap {suite} {mirror}", "check that the Debian mirror is reachable (--mirror)")
    return tag
