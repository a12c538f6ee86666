"""Federated on-policy distillation: the engine every client runs, one folder per job.

Lowest first (each imports only those above it in this list; docs/architecture.md draws it):
``core`` (the settings' types, errors), ``sandbox`` (the built-in task and models), ``data``
(prompt sets, partitions, grading) and ``models`` (loading, vocabularies, LoRA), ``rollout`` (HF and
vLLM engines) and ``distill`` (teacher, loss, OPD, scoring cache), ``engine`` (one client round,
held-out evaluation), ``config`` (parse_run_config, presets). ``preflight`` is a command on top.
"""

from importlib import metadata

try:
    __version__ = metadata.version("fedtops")
except metadata.PackageNotFoundError:  # run from a source tree that was not installed
    __version__ = "source"
