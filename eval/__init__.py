"""mlbench_kit.eval: the execution checker (``mlbench eval``: checks, metrics, run report, here at the top), the
repositories' environments (``envs/``; the ``mlbench env`` command is ``envcli.py``) and ``mlbench report``
(``report/``). Generations run in the core's sandbox (``mlbench_kit.sandbox``). Wings import one way: envs <- the
top; report reads records only (``tests/core/test_layout.py``)."""
