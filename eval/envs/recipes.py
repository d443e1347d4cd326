"""Environment recipes (``configs/eval/envs/*.yaml``): the format and its loader live in the core,
:mod:`mlbench_kit.envspec`, beside every other stage's config."""

from mlbench_kit.envspec import ASSET_KINDS, GENERATORS, Asset, Recipe, load_recipe, load_recipes

__all__ = ["ASSET_KINDS", "GENERATORS", "Asset", "Recipe", "load_recipe", "load_recipes"]
