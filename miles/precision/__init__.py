"""miles.precision."""
