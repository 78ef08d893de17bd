"""miles.rollout."""
