"""Passes: each a function Graph -> Graph (or a plan for it), runnable alone, listed in `pipeline`."""
