"""Tests of the entry-point scripts in scripts/."""
