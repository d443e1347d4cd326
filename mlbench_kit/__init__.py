"""mlbench-kit: fine-tune and evaluate open code LLMs on ML-Bench.

Stages live in the repository's top-level folders and are installed into this one namespace:
``data_prep/`` -> ``mlbench_kit.data_prep``, ``eval/`` -> ``mlbench_kit.eval``, and so on.
"""

__version__ = "0.1.0"
