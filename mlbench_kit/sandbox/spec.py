"""What the sandbox is given and what it returns: an environment, a job, the limits of one execution, its result."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

# The clocks a time limit can be measured on (``Limits.clock``):
# - "cpu": the CPU seconds of every process of the execution, counted by the runner (PID 1 of its namespace), so
#   that another program's load on the machine cannot move the moment the limit is reached; a wall-clock backstop
#   of BACKSTOP times the limit ends an execution that waits (sleeps, blocks) without using CPU;
# - "wall": the benchmark's literal wall clock (a busy machine runs an execution slower, so more reach the limit).
CLOCKS = ("cpu", "wall")
BACKSTOP = 5.0


@dataclass(frozen=True)
class Limits:
    """Per-execution limits. Memory, processes and CPU hold for the whole process tree (a cgroup), the tmpfs
    sizes for everything written; ``cpu_s`` and ``fsize_mb`` are per process (rlimits). ``wall_s`` is the time
    limit, measured on ``clock`` (see :data:`CLOCKS`)."""

    wall_s: float = 10.0
    clock: Literal["cpu", "wall"] = "wall"
    mem_mb: int = 8192
    pids: int = 512
    cpus: float | None = None  # CPU quota in cores; None: no quota
    disk_mb: int = 2048  # the repository's writable layer plus home
    tmp_mb: int = 1024  # /tmp and /dev/shm, each
    cpu_s: int = 300
    fsize_mb: int = 1024
    nofile: int = 1024
    log_bytes: int = 65536
    threads: int | None = None  # OMP/MKL/BLAS threads of one execution; None: the libraries' defaults

    @property
    def cpu_limit_s(self) -> float | None:
        """The CPU seconds of the whole execution at which it has reached its time limit (the cpu clock), else None."""
        return self.wall_s if self.clock == "cpu" else None

    @property
    def wall_limit_s(self) -> float:
        """When the host stops an execution by the wall clock: the limit itself, or the cpu clock's backstop."""
        return self.wall_s * BACKSTOP if self.clock == "cpu" else self.wall_s


THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS", "NUMEXPR_NUM_THREADS",
               "VECLIB_MAXIMUM_THREADS")


def thread_vars(limits: Limits) -> dict[str, str]:
    """The thread-count variables of one execution. Without them torch starts one thread per core of the host,
    so the same answer's run time (and, at the benchmark's timeouts, its verdict) depends on the machine and on
    how many executions share it."""
    return {v: str(limits.threads) for v in THREAD_VARS} if limits.threads else {}


@dataclass(frozen=True)
class Env:
    """Where a repository's code runs: its pristine checkout and its environment."""

    name: str
    checkout: Path
    prefix: str | None = None  # a venv / conda env / interpreter prefix: its bin/ leads PATH
    image: str | None = None  # container backends
    ro_paths: tuple[str, ...] = ()  # more host folders the environment needs, read-only at their own path
    recipe: str | None = None  # the recipe hash the environment was built from (mlbench env build)
    where: str = ""  # where it was configured (file:line), for errors
    vars: tuple[tuple[str, str], ...] = ()  # environment variables the repository's commands rely on
    warm: tuple[str, ...] | None = None  # modules Sandbox.warm imports before a run; None: WARM_MODULES


@dataclass(frozen=True)
class Warmed:
    """One library :meth:`Sandbox.warm` imported: how long it took, whether it had bytecode, or why it failed."""

    module: str
    seconds: float | None = None  # None when the import failed
    compiled: bool = True  # False: no bytecode, and the read-only sandbox cannot cache it, so every run compiles it
    error: str | None = None  # the exception's type name, or why the warm-up itself failed


@dataclass(frozen=True)
class Job:
    """One execution: ``code`` as a shell command (``bash cmd.sh``) or as ``python temp.py``, in ``workdir``."""

    code: str
    as_shell: bool
    env: Env
    workdir: str  # path inside the repository, e.g. "./examples/gnn"
    vars: tuple[tuple[str, str], ...] = ()  # variables of this sample (the exports of its prefix_code)
    # a host folder holding the repository's changes from earlier executions (an overlay upper layer: the agent's
    # per-episode state). It is copied into this execution's size-capped tmpfs before it starts and back when it
    # ends, so files persist between executions while each stays disk-capped; processes never persist. An
    # execution killed at its wall limit leaves the layer as it was. Staged engines only (Sandbox.layer_ok).
    layer: Path | None = None


@dataclass(frozen=True)
class LayerOut:
    """The bounds on a layer the runner sends back (engines that keep :attr:`Job.layer` through the runner: docker):
    the tar's bytes and members at most; past either, no layer is sent and the host keeps the earlier one."""

    max_bytes: int
    max_members: int


@dataclass(frozen=True)
class RunnerSpec:
    """The runner's contract for one execution: everything the trusted runner (``runner.py``, PID 1) is told, as
    plain data. Built once per execution (:meth:`~.sandbox.Sandbox.runner_spec`, from the job, its limits and the
    engine's declaration), serialised once (:meth:`to_json`, the job folder's read-only ``spec.json``) and read by
    the runner by these field names (it imports nothing of the project: standard library only). Paths are the
    sandbox's own (``/sandbox/...``), never the host's."""

    argv: tuple[str, ...]  # the command: ``bash /sandbox/job/cmd.sh`` or ``python temp.py``
    workdir: str  # where it starts, inside /sandbox/work (a path escaping it is sent as /sandbox/work/..: missing)
    env: dict[str, str]  # its whole environment (no host variable reaches it)
    rlimits: dict[str, int]  # resource module names (RLIMIT_CPU, ...) -> soft limit, set in the child
    writable: tuple[str, ...]  # the writable mounts: a full one is the disk limit's evidence
    interpreter: str = "python"  # exit 127 with this not on the PATH is an environment fault, not a verdict
    temp_py: str | None = None  # a Python answer's file, copied to ``temp.py`` in the workdir
    cpu_limit_s: float | None = None  # the cpu clock: the runner ends the execution at this many CPU seconds
    copy_from: str | None = None  # engines that cannot mount the overlay for us: the checkout, copied by the runner
    copy_to: str | None = None  # into this size-capped tmpfs
    layer_in: str | None = None  # an earlier execution's layer, applied over the copy (copy_layer engines)
    layer_out: LayerOut | None = None  # send the copy's changes back as a tar ahead of the report
    undrained_stdout: bool = False  # reproduce the benchmark's undrained stdout inside (relaying engines)
    cgroup_evidence: bool = False  # the container's /sys/fs/cgroup is its own: read the kernel's refused forks, OOMs
    report_alone: bool = False  # the report's stream is the runner's alone; the answer's output is drained here
    log_bytes: int = 65536  # with report_alone: the head and tail of the output relayed, in bytes

    def to_json(self) -> str:
        """The ``spec.json`` the runner reads: every field by its name (tuples as lists)."""
        return json.dumps(asdict(self))


@dataclass(frozen=True)
class LayerCaps:
    """Bounds on the persistent layers (:attr:`Job.layer`) of one :class:`~.sandbox.Sandbox`. ``entries``: one
    layer's files, folders, links and deletions (each is copied in before every action and back after it, so
    their number is time taken from the action's wall limit); ``total_mb`` and ``total_entries``: every live layer
    of the run together, on the host's disk. An execution whose layer would pass a bound keeps the earlier one."""

    entries: int = 20_000
    total_mb: int = 4096
    total_entries: int = 200_000


@dataclass
class ExecResult:
    """What happened, as the runner and the cgroup saw it."""

    exit_code: int | None
    timed_out: bool
    duration: float
    survivors: int
    log: str  # captured stdout + stderr (strict) or stderr (compat), capped: head and tail kept
    signal: int | None = None
    limit: str | None = None  # memory | pids | disk | fsize | cpu: a limit the execution ran into
    fault: str | None = None  # an environment or sandbox fault: no verdict may be drawn from this execution
    usage: dict[str, float] = field(default_factory=dict)
