"""Federated on-policy distillation: the Flower-free core (models, rollouts, OPD, scores)."""

from importlib import metadata

try:
    __version__ = metadata.version("fedtops")
except metadata.PackageNotFoundError:  # run from a source tree that was not installed
    __version__ = "source"
