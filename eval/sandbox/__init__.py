"""The sandbox wing: run untrusted generations in isolation and return verdicts they cannot forge.

- :mod:`.sandbox`: :class:`Sandbox`, one per eval run (workspaces, one execution, the environment probe, warm-up);
- :mod:`.cmdline`: the engines' command lines and the stage script (builds argv, runs nothing);
- :mod:`.runner`: the trusted runner, PID 1 of every execution (copied into it; standard library only);
- :mod:`.cgroups`: a cgroup per execution (v1 or v2); :mod:`.seccomp`: the one seccomp policy.

This wing imports nothing from scoring, environments or reports. Its public names are importable from here.
"""

from .sandbox import (
    BACKENDS,
    CONTAINER_PREFIX,
    DEFAULT_UID,
    THREAD_VARS,
    WARM_MODULES,
    Env,
    ExecResult,
    Job,
    Limits,
    Sandbox,
    Warmed,
    check_backend,
    thread_vars,
    warm_code,
    warm_summary,
)

__all__ = ["BACKENDS", "CONTAINER_PREFIX", "DEFAULT_UID", "THREAD_VARS", "WARM_MODULES", "Env", "ExecResult", "Job",
           "Limits", "Sandbox", "Warmed", "check_backend", "thread_vars", "warm_code", "warm_summary"]
