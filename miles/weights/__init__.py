"""miles.weights: moving trainer weights to the rollout engines (see :mod:`miles.weights.sync`)."""
