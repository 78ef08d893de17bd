"""miles.weights."""
