"""The scoring policy: which checks a generation must pass before it runs, how it runs (limits, the benchmark's
timeouts, its prefix_code exports), what its execution must do to pass, why it failed, which Pass@k a run
reports and which samples are left unscored."""

from __future__ import annotations

import dataclasses
import hashlib
import threading
from collections import Counter, defaultdict
from dataclasses import dataclass
from typing import Any

from mlbench_kit.dataset import Sample, prefix_exports
from mlbench_kit.eval_config import EvalConfig
from mlbench_kit.records import EvalResult, output_sha
from mlbench_kit.sandbox import Env, ExecResult, Job, Limits, Sandbox

from .checks import check_output, runs_as_shell, syntax_error, type_ok
from .envs import EnvConfig
from .static_cli import check_command

# 18x the longest gold answer (3,511 characters): a longer output is a failure, neither parsed nor run, so no
# generation can hold the harness (the checks run on the host, outside the sandbox's limits)
MAX_OUTPUT_CHARS = 65536


def reference_timeout(github_id: int, as_shell: bool) -> float:
    """The benchmark's limits: 10 s; 4 s for vid2vid (5); 7 s for pytorch-image-models (11) Python code."""
    if github_id == 5:
        return 4.0
    if github_id == 11 and not as_shell:
        return 7.0
    return 10.0


def _sha(*parts: str) -> str:
    return hashlib.sha256("\x00".join(parts).encode()).hexdigest()[:16]


@dataclass(frozen=True)
class ScoringRules:
    """How one generation is checked and executed: the mode's rules and the sandbox's limits (``limits.wall_s``
    is replaced per sample: ``timeout``, else the benchmark's limit for its repository)."""

    mode: str = "compat"
    timeout: float | None = None  # None: the benchmark's per-repository limits
    timeout_pass: bool = False
    static_gate: bool = False
    limits: Limits = Limits()

    @classmethod
    def from_config(cls, c: EvalConfig, threads: int) -> ScoringRules:
        limits = Limits(clock=c.limit_clock, mem_mb=c.mem_mb, pids=c.pids, cpus=c.cpus, disk_mb=c.disk_mb,
                        threads=threads)
        return cls(c.mode, c.timeout, c.timeout_pass, c.static_gate, limits)

    @property
    def strict(self) -> bool:
        return self.mode == "strict"

    def limits_for(self, s: Sample, as_shell: bool) -> Limits:
        """The limits of one execution of an answer to ``s``."""
        return dataclasses.replace(self.limits, wall_s=self.timeout or reference_timeout(s.github_id, as_shell))

    def gate(self, params_ok: bool, type_ok: bool, cli_ok: bool) -> bool:
        """Whether an output is executed at all: the benchmark's parameter and type checks pass (and, with strict
        mode's static gate, its command names only options its script has)."""
        return params_ok and type_ok and (cli_ok or not (self.strict and self.static_gate))

    def passes(self, res: ExecResult) -> bool:
        """Whether an execution passes: compat, like the benchmark, takes exit 0 or a timeout; strict takes exit 0
        (a timeout only with ``timeout_pass``) and nothing left running."""
        if self.strict:
            ok = (res.exit_code == 0 or (res.timed_out and self.timeout_pass)) and res.survivors == 0
        else:
            ok = res.exit_code == 0 or res.timed_out
        return ok and res.limit != "memory"  # an OOM fails, even one the program outlived


class Scorer:
    """Scores one generation at a time; identical (sample, output) executions run once."""

    def __init__(self, rules: ScoringRules, envs: EnvConfig, sandbox: Sandbox) -> None:
        self.rules, self.envs, self.sandbox = rules, envs, sandbox
        self._cache: dict[str, ExecResult] = {}
        self._locks: dict[str, threading.Lock] = defaultdict(threading.Lock)
        self.executions = self.cached = 0

    def _run(self, s: Sample, output: str) -> tuple[ExecResult, bool]:
        env = self.envs.for_repo(s.repo)
        as_shell = runs_as_shell(output)
        exports = prefix_exports(s.prefix_code)
        key = _sha(s.repo, s.path, output, str(as_shell), repr(exports))
        with self._locks[key]:
            if key in self._cache:
                self.cached += 1
                return self._cache[key], True
            limits = self.rules.limits_for(s, as_shell)
            res = self.sandbox.run(Job(output, as_shell, env, s.path, exports), limits, drain=self.rules.strict)
            if res.fault:
                return res, False  # not cached: a fixed environment runs it again
            self._cache[key] = res
            self.executions += 1
            return res, False

    def _record(self, s: Sample, idx: int, output: str, env: Env, param_hits: dict[str, bool], params_ok: bool,
                type_ok: bool, **more: Any) -> EvalResult:
        return EvalResult(s.github_id, s.id, idx, s.repo, s.type, output_sha(output), self.rules.mode, param_hits,
                          params_ok, type_ok, env=env.recipe, **more)

    def score(self, s: Sample, idx: int, output: str) -> EvalResult:
        """The verdict on one generation (``fault`` set, and no verdict, when the environment failed)."""
        env = self.envs.for_repo(s.repo)
        if len(output) > MAX_OUTPUT_CHARS:
            return self._record(s, idx, output, env, {k: False for k in s.arguments}, False, type_ok(output, s.type),
                                log=f"output of {len(output)} characters, over the cap of {MAX_OUTPUT_CHARS}: "
                                    "not parsed, not executed", passed=False, error_class="OVERSIZE")
        checks = check_output(output, s.arguments, s.type, self.rules.mode)
        cli = cli_report(output, env, s.path)
        cli_ok = cli is None or not (cli["unknown_options"] or cli["invalid_choices"])
        gate = self.rules.gate(checks.params_ok, checks.type_ok, cli_ok)
        rec = self._record(s, idx, output, env, checks.param_hits, checks.params_ok, checks.type_ok, cli=cli)
        exec_ok = False
        if gate:
            res, cached = self._run(s, output)
            if res.fault:
                rec.fault, rec.log = res.fault, clip(res.log)
                return rec
            record_execution(rec, res, cached)
            exec_ok = self.rules.passes(res)
        rec.passed = bool(gate and exec_ok)
        rec.error_class = None if rec.passed else error_class(rec, gate, cli_ok, output)
        return rec


def cli_report(output: str, env: Env, workdir: str) -> dict[str, Any] | None:
    """What the static CLI check finds in a shell output's command (None: not a shell output, or no script it
    can read): its script, the options that script does not have and the values outside their choices."""
    if not runs_as_shell(output):
        return None
    rep = check_command(output, env.checkout / workdir, root=env.checkout)
    if rep is None:
        return None
    return {"script": rep.script, "unknown_options": rep.unknown_options, "invalid_choices": rep.invalid_choices}


def record_execution(rec: EvalResult, res: ExecResult, cached: bool) -> None:
    """What the execution did, into its verdict."""
    rec.executed, rec.exit_code, rec.signal, rec.timed_out = True, res.exit_code, res.signal, res.timed_out
    rec.survivors, rec.limit, rec.duration, rec.cached = res.survivors, res.limit, res.duration, cached
    rec.log, rec.usage = clip(res.log), res.usage or None


def clip(log: str, head: int = 1500, tail: int = 2500) -> str:
    """The log kept in a verdict: its start (where a missing tool or GPU shows) and its end (the traceback)."""
    if len(log) <= head + tail:
        return log
    return log[:head] + f"\n[... {len(log) - head - tail} characters ...]\n" + log[-tail:]


def error_class(rec: EvalResult, gate: bool, cli_ok: bool, output: str) -> str:
    """Why a generation failed, from what happened (checks, the cgroup, the runner, a parse of the output), never
    from text the generation printed."""
    if not rec.type_ok:
        return "E1"
    if not rec.params_ok or not gate:
        return "E2"
    if rec.limit:
        return f"LIMIT_{rec.limit.upper()}"
    if rec.timed_out:
        return "TIMEOUT"
    if rec.survivors and rec.exit_code == 0:
        return "BACKGROUND"
    if syntax_error(output, runs_as_shell(output)):
        return "E4"
    return "E2" if not cli_ok else "E5"


def pass_ks(wanted: list[int], n: int) -> list[int]:
    """The k of the Pass@k a run reports: those asked for that ``n`` outputs per sample allow (else k=1)."""
    return sorted(k for k in wanted if k <= n) or [1]


def set_apart_unscored(results: list[EvalResult], outputs: dict[tuple[int, int], list[str]]
                       ) -> tuple[list[EvalResult], list[dict[str, int]]]:
    """The verdicts Pass@k is over, and the samples set apart: those with an output that has no verdict (a fault,
    a stopped run). Scored over the outputs left, a failing output that faulted would leave the score, and a
    sample's Pass@1 would be another output's."""
    have = Counter(r.key for r in results)
    apart = {k for k, v in outputs.items() if have[k] < len(v)}
    unscored = [{"github_id": k[0], "id": k[1], "scored_outputs": have[k], "outputs": len(outputs[k])}
                for k in sorted(apart)]
    return [r for r in results if r.key not in apart], unscored
