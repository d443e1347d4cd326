"""Per-repository execution environments from an environments file: the reader lives in the core
(:class:`mlbench_kit.envspec.EnvConfig`), since the agent stage acts in the same environments eval scores in."""

from mlbench_kit.envspec import EnvConfig, envs_file_missing

__all__ = ["EnvConfig", "envs_file_missing"]
