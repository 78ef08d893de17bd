"""miles.core."""
