"""The sandbox wing: run untrusted generations in isolation and return verdicts they cannot forge.

- :mod:`.sandbox`: :class:`Sandbox`, one per eval run: workspaces, one execution, the environment probe, warm-up;
- :mod:`.spec`: what it is given and returns (:class:`Env`, :class:`Job`, :class:`Limits`, :class:`ExecResult`);
- :mod:`.engines`: one :class:`~.engines.Engine` per ``--backend``, chosen once from a registry;
  :mod:`.probe`: whether a backend can run here; :mod:`.cmdline`: the engines' command lines and the stage script;
- :mod:`.runner`: the trusted runner, PID 1 of every execution (copied into it; standard library only);
  :mod:`.verdict`: its report turned into a result; :mod:`.capture`: bounded output;
- :mod:`.cgroups`: a cgroup per execution (v1 or v2); :mod:`.seccomp`: the one seccomp policy;
- :mod:`.local`: ``--backend local``, without isolation.

This wing imports nothing from scoring, environments or reports. Its public names are importable from here.
"""

from .engines import BACKENDS, ENGINES, Engine
from .probe import check_backend
from .sandbox import (
           CONTAINER_PREFIX,
           DEFAULT_UID,
           WARM_MODULES,
           Sandbox,
           warm_code,
           warm_summary,
)
from .spec import CLOCKS, THREAD_VARS, Env, ExecResult, Job, LayerCaps, Limits, Warmed, thread_vars

__all__ = ["BACKENDS", "CLOCKS", "CONTAINER_PREFIX", "DEFAULT_UID", "ENGINES", "THREAD_VARS", "WARM_MODULES",
           "Engine", "Env", "ExecResult", "Job", "LayerCaps", "Limits", "Sandbox", "Warmed", "check_backend",
           "thread_vars", "warm_code", "warm_summary"]
