"""Runnable examples (importable so the integration tests can run their building blocks)."""
