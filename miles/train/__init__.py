"""miles.train."""
