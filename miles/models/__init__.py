"""miles.models."""
