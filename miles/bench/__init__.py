"""miles.bench."""
