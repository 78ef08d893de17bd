"""miles.tracking."""
