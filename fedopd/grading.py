"""Answer grading: the last ``\\boxed{}`` of a response, checked against the gold answer.

Equivalence is decided by ``math-verify``. Its own timeouts use ``signal.alarm``, which only works
in a process's main thread, while Flower runs ClientApps in worker threads and Ray actors. So the
check runs in a small worker process (main thread there, signals allowed) and the caller waits at
most ``timeout`` seconds; a worker stuck on a pathological expression is killed and replaced, and
the response counts as wrong. Nothing here can hang a run.
"""

from __future__ import annotations

import atexit
import concurrent.futures as cf
import multiprocessing as mp
import threading

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


def _verify(pred: str, gold: str, timeout: int) -> bool:
    """Runs in the worker: math-verify with its own (signal-based) timeouts."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    configs = [LatexExtractionConfig(), ExprExtractionConfig()]
    gold_parsed = parse(f"\\boxed{{{gold}}}", extraction_config=configs, parsing_timeout=timeout)
    pred_parsed = parse(f"\\boxed{{{pred}}}", extraction_config=configs, parsing_timeout=timeout)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=timeout))


class _Worker:
    """One lazily started grading process, replaced when it overruns a deadline."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._pool: cf.ProcessPoolExecutor | None = None

    def _get(self) -> cf.ProcessPoolExecutor:
        if self._pool is None:
            self._pool = cf.ProcessPoolExecutor(max_workers=1, mp_context=mp.get_context("spawn"))
        return self._pool

    def kill(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            for proc in list(getattr(pool, "_processes", {}).values()):
                proc.kill()
            pool.shutdown(wait=False, cancel_futures=True)

    def run(self, pred: str, gold: str, timeout: float) -> bool:
        with self._lock:
            future = self._get().submit(_verify, pred, gold, max(1, int(timeout)))
            try:
                return bool(future.result(timeout=timeout))
            except cf.TimeoutError:
                self.kill()
                return False
            except cf.process.BrokenProcessPool:
                self.kill()
                return False
            except Exception:  # noqa: BLE001 - a grader error means "not verified correct"
                return False


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
