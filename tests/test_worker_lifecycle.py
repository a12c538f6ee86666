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
    worker.close_worker_models()  # whatever an earlier test in this process left
    closed, loads = [], []
    monkeypatch.setattr(HFRolloutEngine, "close", lambda self: closed.append(self), raising=False)
    original = worker.load_client_models

    def loading(*args, **kwargs):
        loads.append(list(closed))  # what was closed when this load began
        return original(*args, **kwargs)

    monkeypatch.setattr(worker, "load_client_models", loading)
    model = ModelSettings(student="builtin:tiny-student", teacher="builtin:tiny-teacher", dtype="float32")
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
    assert p.status() == psutil.STATUS_ZOMBIE  # ended when the call returns, not later
    assert proc.wait(timeout=10) == -9 and time.monotonic() - start < 10  # its exit status is still its owner's


def test_a_tree_that_lists_the_caller_leaves_the_caller_alone():
    """The trees before and after the graceful stop overlap, and a tree snapshot could name the
    process that stops the workers: it ends the others and goes on."""
    import os

    proc = _sleeper()
    _end_processes([[proc.pid, proc.create_time()], [proc.pid, proc.create_time()], [os.getpid(), psutil.Process().create_time()]], wait_s=5.0)
    assert not proc.is_running() or proc.status() == psutil.STATUS_ZOMBIE


def test_tf32_inside_the_fp32_head_keeps_both_torch_apis_readable_and_is_restored():
    import torch

    from fedopd.models.head import _tf32_matmuls

    saved = torch.get_float32_matmul_precision()
    with _tf32_matmuls(True):
        assert torch.get_float32_matmul_precision() == "high" and torch.backends.cuda.matmul.allow_tf32 is True
    assert torch.get_float32_matmul_precision() == saved
    assert torch.backends.cuda.matmul.allow_tf32 == (saved != "highest")


def test_the_engine_start_copy_sees_what_a_child_process_prints_and_passes_it_on(capfd):
    """vLLM's engine process inherits file descriptors 1 and 2: what it prints while the engine
    starts is copied (to find vLLM's cause) and still reaches this process's own output."""
    from fedopd.rollout.vllm_engine import _Tee, start_failure_cause

    tee = _Tee()
    with tee:
        subprocess.run(
            [sys.executable, "-c", "import sys; print('(EngineCore pid=7) INFO up'); sys.stderr.write('(EngineCore pid=7) ValueError: no room\\n')"],
            check=True,
        )
    text = tee.text()
    assert "INFO up" in text and start_failure_cause(text) == "ValueError: no room"
    out, err = capfd.readouterr()
    assert "INFO up" in out and "ValueError: no room" in err
