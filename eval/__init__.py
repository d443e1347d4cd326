"""mlbench_kit.eval: the execution checker (``mlbench eval``: checks, metrics, run report, here at the top), the
sandbox it runs generations in (``sandbox/``), the repositories' environments (``envs/``; the ``mlbench env``
command is ``envcli.py``) and ``mlbench report`` (``report/``). Wings import one way: sandbox <- envs <- the top;
report reads records only (``tests/core/test_layout.py``)."""
