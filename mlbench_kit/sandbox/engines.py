"""The isolation engines behind one interface, one class per ``--backend``, chosen once from :data:`ENGINES`.

- ``bwrap``: bubblewrap, started by the stage script in a private mount namespace, in the execution's cgroup;
- ``podman``: a container with the same layout (staged and in our cgroup as root; else it copies the checkout);
- ``docker``: podman's command line; the daemon cannot see our mounts, so the runner copies the checkout;
- ``apptainer``: HPC clusters, a generated command line;
- ``local``: no isolation, run in place (:mod:`.local`), only with ``--unsafe-local``.

An engine only says how its executions start and stop; :class:`~.sandbox.Sandbox` runs them, and whether an
engine can run on this host at all is :mod:`.probe`'s question.
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from mlbench_kit.errors import MLBenchError

from . import cgroups, seccomp
from .cmdline import (
    Identity,
    Mounts,
    apptainer_argv,
    bwrap_argv,
    container_argv,
    stage_script,
    unshare_argv,
)
from .spec import Env, Job, Limits


@dataclass(frozen=True)
class Launch:
    """One execution as the engine starts it: its job, limits and mounts, who runs it, and where its report goes."""

    job: Job
    limits: Limits
    mounts: Mounts
    name: str  # the execution's name (containers are named after it)
    who: Identity
    cgroup: cgroups.ExecCgroup | None  # the execution's own cgroup, when the host gives one
    seccomp: Path | None  # the policy file :meth:`Engine.seccomp` wrote
    runner_python: str  # the host interpreter that runs the runner in engines without an image
    report_fd: int  # the write end of the runner's report pipe
    staged: bool  # :meth:`Engine.staged`: started by the stage script


class Engine(Protocol):
    """How one backend starts and stops an execution. ``tools`` (what must be installed) serves the probe;
    ``seccomp`` writes the policy in the form the engine reads, once per run; ``staged``: started by the stage
    script, on an overlay of the pristine checkout, reporting over a pipe (else the runner copies the checkout and
    reports on stderr); ``command`` builds the command line (writing the stage script where staged), ``stop``
    removes what outlives it."""

    name: str
    isolated: bool  # False: runs on the host itself (``local``)
    container: bool  # runs an image (its environment in /opt/venv) that holds limits of its own
    cgroup: bool  # runs in the execution's own cgroup where the host gives one
    binds_env: bool  # the host's environment folders are bound in, read-only
    relays: bool  # its CLI relays the container's output (docker): the benchmark's undrained stdout is reproduced
    #               inside, by the runner, so that nothing the answer prints can block the runner's report; the
    #               container's stderr is the runner's alone (the report, then a layer's files: copy_layer)
    copy_layer: bool  # keeps Job.layer without a stage script: the runner applies it and sends the changes back
    cgroup_evidence: bool  # its container's /sys/fs/cgroup is the container's own (docker): the runner reads the
    #                        kernel's count of refused forks there (pids.events), the process limit's evidence,
    #                        and of OOMs while the answer ran (memory.events, v1 memory.oom_control)
    uid_per_execution: str  # when each execution runs as a uid of its own, so per-user kernel quotas are its own:
    #                         "always" (docker: it copies every file it writes, so no file's owner ties it to the
    #                         run's uid), "idmap" (staged as root: the stage script binds the lower layer idmapped
    #                         where the kernel and its filesystem allow, see Sandbox.idmaps), "" never

    def tools(self, root: bool) -> tuple[str, ...]: ...

    def seccomp(self, folder: Path) -> Path | None: ...

    def staged(self, who: Identity) -> bool: ...

    def command(self, x: Launch) -> list[str]: ...

    def stop(self, name: str, proc: subprocess.Popen, cg: cgroups.ExecCgroup | None) -> bool:
        """Remove what outlives the execution; True when the engine itself recorded an OOM kill in it."""
        ...


def need_image(env: Env, backend: str) -> str:
    if not env.image:
        raise MLBenchError(f"backend {backend} needs an image for repository {env.name!r}", env.where or "envs config",
                           "set `image:` for the repository, or build one: mlbench env build --image")
    return env.image


def _staged(x: Launch, engine_argv: list[str], join_cgroup: bool, drop: bool, seccomp_bpf: Path | None,
            shm_mb: int | None = None) -> list[str]:
    """Write the stage script that prepares the mounts and then execs ``engine_argv``; the command that starts it."""
    script = x.mounts.job / "stage.sh"
    procs = x.cgroup.procs_files if x.cgroup and join_cgroup else []
    script.write_text(stage_script(x.mounts, x.who, procs, x.report_fd, engine_argv, drop=drop,
                                   seccomp_bpf=seccomp_bpf, shm_mb=shm_mb))
    return unshare_argv(x.who, script)


class Bwrap:
    """bubblewrap: the whole tree joins the execution's cgroup, the stage script drops to the sandbox uid before
    bwrap starts, and the seccomp policy is compiled to BPF."""

    name, isolated, container, cgroup, binds_env = "bwrap", True, False, True, True
    relays = copy_layer = False
    cgroup_evidence = False
    uid_per_execution = "idmap"

    def tools(self, root: bool) -> tuple[str, ...]:
        return ("bwrap", "unshare", "setpriv") if root else ("bwrap", "unshare")

    def seccomp(self, folder: Path) -> Path | None:
        path = folder / "seccomp.bpf"
        seccomp.write_bpf(path)
        return path

    def staged(self, who: Identity) -> bool:
        return True

    def command(self, x: Launch) -> list[str]:
        # without a cgroup to count it, SysV shm is bounded by the execution's IPC namespace (--mem-mb in all)
        return _staged(x, bwrap_argv(x.mounts, x.limits.tmp_mb, x.runner_python), join_cgroup=True, drop=True,
                       seccomp_bpf=x.seccomp, shm_mb=x.limits.mem_mb if x.cgroup is None else None)

    def stop(self, name: str, proc: subprocess.Popen, cg: cgroups.ExecCgroup | None) -> bool:
        return False  # its PID 1 died with the process group, and the namespace with it


class Docker:
    """docker: no pipe reaches the container, so the runner copies the checkout and reports on stderr under a
    nonce; the daemon's own limits hold (``--memory``, ``--pids-limit``)."""

    name, isolated, container, cgroup, binds_env = "docker", True, True, False, False
    relays = copy_layer = True
    cgroup_evidence = True
    uid_per_execution = "always"

    def tools(self, root: bool) -> tuple[str, ...]:
        return ("docker",)

    def seccomp(self, folder: Path) -> Path | None:
        path = folder / "seccomp.json"
        path.write_text(json.dumps(seccomp.podman_profile()))
        return path

    def staged(self, who: Identity) -> bool:
        return False

    def command(self, x: Launch) -> list[str]:
        lim, layer = x.limits, x.job.layer
        return container_argv(self.name, need_image(x.job.env, self.name), x.name, x.mounts, lim.mem_mb, lim.pids,
                              lim.cpus, lim.tmp_mb, x.who.uid, x.cgroup.parent_for_podman() if x.cgroup else None,
                              x.seccomp, src=None if x.staged else str(x.job.env.checkout.resolve()),
                              layer=str(layer) if self.copy_layer and layer and (layer / "upper").is_dir() else None,
                              gid=x.who.gid)

    def stop(self, name: str, proc: subprocess.Popen, cg: cgroups.ExecCgroup | None) -> bool:
        # started without --rm: the container's own OOM record is read before it is removed (the runner may be
        # the one killed, and then no report tells it); the container outlives a killed CLI, so it is always removed
        oom = self.oom_killed(name, patient=proc.poll() == 128 + signal.SIGKILL)
        subprocess.run([self.name, "rm", "-f", name], capture_output=True)  # (docker rm has no -t)
        return oom

    def oom_killed(self, name: str, patient: bool, wait_s: float = 3.0) -> bool:
        """The daemon's ``State.OOMKilled`` for container ``name``. dockerd sets it when it handles the OOM event,
        which may come after the exit it reported; ``patient`` (the runner, PID 1, died of SIGKILL: nothing inside
        may signal it, so the kernel's OOM killer did) waits up to ``wait_s`` for a record still false."""
        deadline = time.monotonic() + (wait_s if patient else 0.0)
        while True:
            r = subprocess.run([self.name, "inspect", "--format", "{{.State.OOMKilled}}", name],
                               capture_output=True, text=True)
            if r.returncode == 0 and r.stdout.strip() == "true":
                return True
            if r.returncode != 0 or time.monotonic() >= deadline:
                return False
            time.sleep(0.2)


class Podman(Docker):
    """podman: as root, staged like bwrap (the overlay, the report pipe) and in the execution's cgroup through
    ``--cgroup-parent`` (its CLI stays out of it, so the engine's own memory is not charged to the generation);
    without root, docker's way."""

    name, isolated, container, cgroup, binds_env = "podman", True, True, True, False
    relays = copy_layer = False  # passthrough: the container's stdout is our pipe itself
    cgroup_evidence = False
    uid_per_execution = "idmap"  # rootless (not staged), only its subuid range is mapped: the run's uid

    def tools(self, root: bool) -> tuple[str, ...]:
        return ("podman", "unshare", "setpriv") if root else ("podman", "unshare")

    def staged(self, who: Identity) -> bool:
        return who.root

    def command(self, x: Launch) -> list[str]:
        argv = super().command(x)
        return _staged(x, argv, join_cgroup=False, drop=False, seccomp_bpf=None) if x.staged else argv

    def stop(self, name: str, proc: subprocess.Popen, cg: cgroups.ExecCgroup | None) -> bool:
        # a CLI that ended by itself removed its container (--rm); one we killed (a time limit) did not, and conmon
        # removes it only later: remove it now, so no container is left running or listed; without our cgroup to
        # kill, the engine must remove it always
        if proc.wait() < 0 or cg is None:
            subprocess.run([self.name, "rm", "-f", "-t", "0", name], capture_output=True)
        return False  # an OOM is read from the execution's cgroup (rootful) or the runner's report


class Apptainer:
    """Apptainer: a generated command line, the checkout copied by the runner, the report on stderr."""

    name, isolated, container, cgroup, binds_env = "apptainer", True, True, False, False
    relays = copy_layer = False
    cgroup_evidence = False
    uid_per_execution = ""

    def tools(self, root: bool) -> tuple[str, ...]:
        return ("apptainer",)

    def seccomp(self, folder: Path) -> Path | None:
        return None

    def staged(self, who: Identity) -> bool:
        return False

    def command(self, x: Launch) -> list[str]:
        return apptainer_argv(need_image(x.job.env, self.name), x.mounts.job, str(x.job.env.checkout.resolve()))

    def stop(self, name: str, proc: subprocess.Popen, cg: cgroups.ExecCgroup | None) -> bool:
        return False


class Local:
    """No isolation: :func:`.local.run_local` runs the job in place; there is no command to start."""

    name, isolated, container, cgroup, binds_env = "local", False, False, False, False
    relays = copy_layer = False
    cgroup_evidence = False
    uid_per_execution = ""

    def tools(self, root: bool) -> tuple[str, ...]:
        return ()

    def seccomp(self, folder: Path) -> Path | None:
        return None

    def staged(self, who: Identity) -> bool:
        return False

    def command(self, x: Launch) -> list[str]:
        raise NotImplementedError("the local engine runs in place (run_local)")

    def stop(self, name: str, proc: subprocess.Popen, cg: cgroups.ExecCgroup | None) -> bool:
        return False


ENGINES: dict[str, Engine] = {e.name: e for e in (Bwrap(), Podman(), Docker(), Apptainer(), Local())}
BACKENDS = tuple(ENGINES)  # bwrap, podman, docker, apptainer, local


def engine(backend: str) -> Engine:
    """The engine of ``--backend``."""
    if backend not in ENGINES:
        raise MLBenchError(f"unknown backend {backend!r}", "--backend", f"use one of {BACKENDS}")
    return ENGINES[backend]
