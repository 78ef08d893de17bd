"""miles.tasks."""
