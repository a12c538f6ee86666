"""The worker's models have a lifecycle (client_app/worker.py, client_app/resident.py): replaced
models are closed before new ones load, and a stopped resident worker's leftover processes end.
The count of real vLLM engine processes is tests/test_engine_lifecycle.py (vLLM's CPU build)."""

from __future__ import annotations

import subprocess
import sys
import time

import psutil
import pytest

from client_app import worker
from client_app.resident import _end_processes
from fedopd.config import LoraSettings, ModelSettings
from fedopd.rollout import HFRolloutEngine


@pytest.mark.slow
def test_new_worker_models_close_the_old_ones_first(monkeypatch):
    closed, loads = [], []
    monkeypatch.setattr(HFRolloutEngine, "close", lambda self: closed.append(self), raising=False)
    original = worker.load_client_models

    def loading(*args, **kwargs):
        loads.append(list(closed))  # what was closed when this load began
        return original(*args, **kwargs)

    monkeypatch.setattr(worker, "load_client_models", loading)
    model = ModelSettings(student="builtin:tiny-student", teacher="builtin:tiny-teacher", dtype="float32")
    worker.close_worker_models()
    try:
        first = worker.worker_models(model, LoraSettings(), "hf", 256, 0.3)
        assert worker.worker_models(model, LoraSettings(), "hf", 256, 0.3) is first and loads == [[]]  # the same config: kept
        worker.worker_models(model, LoraSettings(), "hf", 256, 0.4)
        assert loads == [[], [first.rollout]]  # closed before the new models loaded
    finally:
        worker.close_worker_models()
    assert len(closed) == 2 and worker._MODELS == {}


def _sleeper() -> psutil.Process:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    return psutil.Process(proc.pid)


def test_leftover_processes_of_a_stopped_worker_are_ended_but_not_a_reused_pid():
    kept, ended = _sleeper(), _sleeper()
    try:
        # kept: the same pid with another start time, as after pid reuse
        _end_processes([[ended.pid, ended.create_time()], [kept.pid, kept.create_time() - 5.0]], wait_s=5.0)
        time.sleep(0.2)
        assert not ended.is_running() or ended.status() == psutil.STATUS_ZOMBIE
        assert kept.is_running() and kept.status() != psutil.STATUS_ZOMBIE
    finally:
        for proc in (kept, ended):
            if proc.is_running():
                proc.kill()


def test_a_process_that_ignores_sigterm_is_killed():
    proc = subprocess.Popen(
        [sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE,
    )
    assert proc.stdout.readline().strip() == b"ready"
    p = psutil.Process(proc.pid)
    start = time.monotonic()
    _end_processes([[p.pid, p.create_time()]], wait_s=1.0)
    assert proc.wait(timeout=10) == -9 and time.monotonic() - start < 10
