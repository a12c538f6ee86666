"""Answer grading: the last ``\\boxed{}`` of a response, checked against the gold answer.

Equivalence is decided by ``math-verify``. Its own timeouts use ``signal.alarm``, which only works
in a process's main thread, while Flower runs ClientApps in worker threads and Ray actors. So the
check runs in a small worker process (main thread there, signals allowed) and the caller waits at
most ``timeout`` seconds; a worker stuck on a pathological expression is killed and replaced, and
the response counts as wrong. Nothing here can hang a run.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import subprocess
import sys
import threading
import time

_BOX_COMMANDS = ("\\boxed", "\\fbox")


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}`` (or ``\\fbox{...}``, or ``\\boxed x``) in ``text``."""
    start = max(text.rfind(cmd) for cmd in _BOX_COMMANDS)
    if start < 0:
        return None
    cmd = next(c for c in _BOX_COMMANDS if text.startswith(c, start))
    i = start + len(cmd)
    if text.startswith(" ", i) and not text.startswith("{", i):  # "\boxed 5"
        rest = text[i + 1 :].split("$")[0].strip()
        return rest.split()[0].rstrip(".,;") if rest else None
    if not text.startswith("{", i):
        return None
    depth = 0
    for j in range(i, len(text)):
        if text[j] == "{":
            depth += 1
        elif text[j] == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j].strip()
    return None  # unbalanced: no complete boxed answer


def verify_boxed(pred: str, gold: str, timeout: int) -> bool:
    """math-verify on two boxed answers, with its own (signal-based) timeouts: main thread only."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    configs = [LatexExtractionConfig(), ExprExtractionConfig()]
    gold_parsed = parse(f"\\boxed{{{gold}}}", extraction_config=configs, parsing_timeout=timeout)
    pred_parsed = parse(f"\\boxed{{{pred}}}", extraction_config=configs, parsing_timeout=timeout)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=timeout))


class GradingError(RuntimeError):
    """The grading worker cannot be started or keeps dying: grades would be wrong, so stop."""


class _Worker:
    """One grading subprocess (``python -m fedopd.data._grade_worker``), JSON lines over pipes.

    Started on first use; a request that overruns its deadline kills it, and the next request
    starts a fresh one. Start-up (importing math-verify) does not count against a request.
    """

    START_TIMEOUT = 300.0

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._buffer = b""

    def _readline(self, timeout: float) -> bytes | None:
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buffer:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([self._proc.stdout], [], [], left)
            if ready:
                chunk = os.read(self._proc.stdout.fileno(), 65536)
                if not chunk:
                    raise EOFError("grading worker exited")
                self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line

    def _start(self) -> None:
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "fedopd.data._grade_worker"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        self._buffer = b""
        try:
            ready = self._readline(self.START_TIMEOUT)
        except EOFError:
            ready = None
        if ready != b"ready":
            self.kill()
            raise GradingError("the math-verify grading worker did not start (is math-verify installed?)")

    def kill(self) -> None:
        proc, self._proc = self._proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait()

    def _request(self, pred: str, gold: str, timeout: float) -> bool | None:
        """True/False, or None when the deadline passed (the worker is then killed)."""
        if self._proc is None or self._proc.poll() is not None:
            self._start()
        self._proc.stdin.write(json.dumps({"pred": pred, "gold": gold, "timeout": max(1, int(timeout))}).encode() + b"\n")
        self._proc.stdin.flush()
        line = self._readline(timeout)
        if line is None:
            self.kill()
            return None
        return bool(json.loads(line)["correct"])

    def run(self, pred: str, gold: str, timeout: float) -> bool:
        with self._lock:
            for _ in range(2):
                try:
                    return bool(self._request(pred, gold, timeout))
                except (EOFError, BrokenPipeError, OSError):
                    self.kill()  # the worker died on this request: one fresh try, then give up
            raise GradingError("the math-verify grading worker died twice on the same request")


_WORKER = _Worker()
atexit.register(_WORKER.kill)


def is_correct(response: str, gold: str, timeout: float = 10.0) -> bool:
    """Whether the last boxed answer of ``response`` equals ``gold`` (math-verify).

    No boxed answer is wrong. Returns within about ``timeout`` seconds (plus the worker's start,
    once per process), from any thread.
    """
    pred = last_boxed(response)
    if pred is None or not str(gold).strip():
        return False
    if pred.replace(" ", "") == str(gold).replace(" ", ""):
        return True
    return _WORKER.run(pred, str(gold), timeout)
