"""jointrl package."""
