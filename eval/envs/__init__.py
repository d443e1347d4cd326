"""The environments wing (``mlbench env``'s parts): how each repository's code gets an environment to run in.

- recipes (``configs/eval/envs/*.yaml``) and ``envs.yaml`` are typed configs in the core,
  :mod:`mlbench_kit.envspec`;
- :mod:`.build`: builds from recipes (venvs, images, Containerfile / Apptainer ``.def``) and ``envs.yaml``;
- :mod:`.images`: the podman base image, without a registry;
- :mod:`.envs_yaml`: ``envs.yaml`` read into the sandbox's :class:`~mlbench_kit.sandbox.Env` per repository;
- :mod:`.validate`: gold validation's causes, per row, from eval result records.

May use the sandbox wing; never scoring or reports. The command itself is ``eval/envcli.py``: ``env validate``
runs scoring.
"""

from .envs_yaml import EnvConfig

__all__ = ["EnvConfig"]
