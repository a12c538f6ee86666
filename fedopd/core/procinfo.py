"""Measurements of the running process, for round records (soak runs watch memory per round)."""

from __future__ import annotations

import os
import resource
import sys


def rss_mb() -> float:
    """The process's resident set size now, in MiB (Linux: /proc; elsewhere: its peak)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
        return peak / 2**20 if sys.platform == "darwin" else peak / 2**10
