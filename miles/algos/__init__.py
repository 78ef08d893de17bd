"""miles.algos."""
