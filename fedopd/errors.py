"""Errors shared by the loading code (kept apart so that no loader imports another for them)."""

from __future__ import annotations


class ModelLoadError(ValueError):
    """A model name that cannot be resolved or loaded, or an incompatible student/teacher pair."""
