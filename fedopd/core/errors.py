"""The project's errors, below every layer: a loader or a validator raises them without importing another."""

from __future__ import annotations


class ModelLoadError(ValueError):
    """A model name that cannot be resolved or loaded, or an incompatible student/teacher pair."""


class ConfigError(ValueError):
    """A run-config value that is missing, of the wrong type, or out of range."""


class LocalError(ValueError):
    """A problem with what only this host holds (its files, its node config, its saved state).

    Its text, which may quote the host's paths, columns or rows, stays in the host's own log; what
    leaves the host (:func:`public_reason`) names only ``key`` (the setting) and ``kind`` (the
    problem, in words that hold no value of the host's)."""

    def __init__(self, message: str, key: str = "", kind: str = "") -> None:  # defaults: an exception must unpickle (Ray)
        super().__init__(message)
        self.key, self.kind = key, kind


class RequestError(ValueError):
    """A message the client refuses. Its text quotes only what the message itself holds, so it may
    go back to the server whole."""


REASON_CHARS = 300  # the longest request error text a reply carries


def public_reason(err: BaseException, phase: str) -> str:
    """What a client's reply says of an error in ``phase``: a :class:`RequestError`'s text, a
    :class:`LocalError`'s key and kind, and of anything else its type only (its text may hold the
    host's data); the full error stays in the host's log."""
    name = type(err).__name__
    if isinstance(err, RequestError):
        text = str(err)
        return f"{name}: {text[:REASON_CHARS]}{'…' if len(text) > REASON_CHARS else ''}"
    if isinstance(err, LocalError) and err.key:
        return f"{name}: {err.key}: {err.kind or 'invalid'} (details in this node's log)"
    return f"{name} in the client's {phase} (details in this node's log)"
