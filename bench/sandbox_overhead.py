"""Per-execution overhead of the sandbox: ``true`` end to end (cgroup, stage script, engine, runner, report).

    python bench/sandbox_overhead.py --backend bwrap --n 20
    python bench/sandbox_overhead.py --backend podman --n 10      # as root, with the base image built

Prints the median and the 10th/90th percentiles in milliseconds: executions as uids of their own (the default;
bwrap and podman as root bind the checkout idmapped), and, interleaved with them in the same run, the baseline of
every execution as the run's uid (``sandbox_uid`` 65534 named, so nothing is drawn or idmapped), with their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from mlbench_kit.sandbox import Env, Job, Limits, Sandbox

REPO = Path(__file__).resolve().parents[1] / "examples" / "sample" / "repos" / "toybench"


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--backend", default="bwrap")
    p.add_argument("--n", type=int, default=20)
    a = p.parse_args()
    image = None
    if a.backend in ("podman", "docker"):
        from mlbench_kit.eval.envs.images import build_base_image
        image = build_base_image()
    env = Env("toybench", REPO, image=image)
    own_uid, run_uid = "own uid", "run's uid"
    times: dict[str, list[float]] = {own_uid: [], run_uid: []}
    with Sandbox(a.backend) as own, Sandbox(a.backend, uid=65534) as fixed:
        boxes = {own_uid: own, run_uid: fixed}
        for sb in boxes.values():
            sb.run(Job("true", True, env, "./"), Limits())  # stage the checkout once (and try the idmap)
        for _ in range(a.n):
            for name, sb in boxes.items():
                t0 = time.monotonic()
                r = sb.run(Job("true", True, env, "./"), Limits())
                times[name].append((time.monotonic() - t0) * 1000)
                assert r.exit_code == 0 and r.fault is None, (r.exit_code, r.fault, r.log[-500:])
    for name, ts in times.items():
        q = statistics.quantiles(ts, n=10)
        print(f"{a.backend}, {name}: `true` end to end, n={a.n}: median {statistics.median(ts):.0f} ms "
              f"(p10 {q[0]:.0f}, p90 {q[-1]:.0f})")
    print(f"ratio {own_uid} / {run_uid} (medians): "
          f"{statistics.median(times[own_uid]) / statistics.median(times[run_uid]):.2f}")


if __name__ == "__main__":
    main()
