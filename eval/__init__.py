"""mlbench_kit.eval: the execution checker (``mlbench eval``: checks, sandbox, metrics, run report), the
repositories' environments (``mlbench env``: recipes, builds, gold validation) and ``mlbench report``."""
