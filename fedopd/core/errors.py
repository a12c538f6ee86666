"""The project's errors, below every layer: a loader or a validator raises them without importing another."""

from __future__ import annotations


class ModelLoadError(ValueError):
    """A model name that cannot be resolved or loaded, or an incompatible student/teacher pair."""


class ConfigError(ValueError):
    """A run-config value that is missing, of the wrong type, or out of range."""
