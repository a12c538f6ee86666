"""Measurements of the running process, for round records (soak runs watch memory per round), and
ending processes this project started."""

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


def terminate_then_kill(procs: list, wait_s: float) -> list:
    """SIGTERM each psutil.Process in ``procs``, wait up to ``wait_s`` seconds, SIGKILL what is
    left; the processes that were sent SIGKILL (the caller waits for them as suits it: psutil's
    wait reaps a child of this process). A process that is gone or not ours to signal is skipped."""
    import psutil

    for proc in procs:
        try:
            proc.terminate()
        except psutil.Error:
            pass
    _, left = psutil.wait_procs(procs, timeout=wait_s)
    for proc in left:
        try:
            proc.kill()
        except psutil.Error:
            pass
    return left
