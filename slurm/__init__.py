"""Slurm sweeps: models × training splits × tasks × seeds as chained job arrays (``mlbench sweep``)."""
