"""The report wing: ``mlbench report``, eval runs side by side.

- :mod:`.cli`: the command; :mod:`.data`: eval folders read into settings, and quoted reference rows;
- :mod:`.render`: report.md, report.csv and the plots.

It only reads records (eval's ``summary.json``, reference YAML): nothing from scoring, the sandbox or environments.
"""

from .cli import add_arguments, run

__all__ = ["add_arguments", "run"]
