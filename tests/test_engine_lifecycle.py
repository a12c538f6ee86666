"""vLLM's engine process has a lifecycle: a worker whose models are replaced (another
``rollout.gpu-memory-utilization`` after a failed first try, say) or that stops leaves no engine
process behind, in process and in the resident Ray worker. Counted, on vLLM's CPU build (CI's
second environment, scripts/install.sh cpu-vllm); skipped where vLLM cannot run.

The engine processes are found by the name vLLM gives them (``VLLM::EngineCore``, set with
setproctitle in vllm/v1/engine/core.py) among this host's processes started during the test."""

from __future__ import annotations

import time

import psutil
import pytest

from fedopd.rollout.vllm_engine import vllm_platform

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.skipif(vllm_platform() is None, reason="vLLM is not importable here (scripts/install.sh cpu-vllm installs its CPU build)"),
]

SHARE = (0.05, 0.06) if vllm_platform() == "cpu" else (0.2, 0.25)  # the CPU build: a share of the host's memory


def engines(since: float) -> set[int]:
    """Pids of the vLLM engine processes on this host started after ``since`` (a time.time())."""
    found = set()
    for proc in psutil.process_iter(["pid", "name", "create_time"]):
        if (proc.info["name"] or "").startswith("VLLM::EngineCore") and proc.info["create_time"] >= since - 1:
            found.add(proc.info["pid"])
    return found


def _gone(pids: set[int], since: float, timeout: float = 30.0) -> set[int]:
    """Those of ``pids`` still running after up to ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while time.monotonic() < end and pids & engines(since):
        time.sleep(0.5)
    return pids & engines(since)


def test_the_in_process_worker_closes_its_engine_when_the_config_changes_and_at_the_end():
    from client_app.worker import close_worker_models, worker_models
    from fedopd.config import LoraSettings, ModelSettings

    since = time.time()
    model = ModelSettings(student="builtin:sandbox-student", teacher="builtin:sandbox-teacher", dtype="float32")
    try:
        worker_models(model, LoraSettings(), "vllm", 512, SHARE[0])
        first = engines(since)
        assert len(first) == 1
        worker_models(model, LoraSettings(), "vllm", 512, SHARE[1])  # the user changed the share
        assert not _gone(first, since), "the engine of the previous configuration is still running"
        assert len(engines(since)) == 1
    finally:
        close_worker_models()
    assert not _gone(engines(since), since)


@pytest.fixture(scope="module")
def ray_instance():
    ray = pytest.importorskip("ray")
    from client_app.resident import NAMESPACE, stop_workers

    if ray.is_initialized():
        pytest.skip("a Ray instance is initialised in this process")
    ray.init(num_cpus=1, namespace=NAMESPACE, include_dashboard=False, log_to_driver=False)
    yield ray
    stop_workers()
    ray.shutdown()


@pytest.mark.usefixtures("task_identity")
def test_the_resident_worker_closes_its_engine_when_it_is_replaced_and_when_it_stops(ray_instance):
    from client_messages import train_message
    from flwr.app import Context, RecordDict

    from client_app.app import handle
    from client_app.resident import list_workers, stop_workers
    from fedopd.config import parse_run_config
    from server_app.app import initial_adapter

    since = time.time()
    node = {"partition-id": 0, "num-partitions": 3, "worker": "resident", "worker-name": "life", "ray-insecure": True}
    seen = []
    for share in SHARE:
        cfg = parse_run_config(
            {"rollout.backend": "vllm", "rollout.gpu-memory-utilization": share, "rollout.per-round": 4, "rollout.max-new-tokens": 8}
        )
        context = Context(run_id=1, node_id=7, node_config=node, state=RecordDict(), run_config=cfg.to_run_config())
        reply = handle("train", train_message(initial_adapter(cfg)[0], 1), context)
        assert "metrics" in reply.content, reply.error if reply.has_error() else reply.content
        running = engines(since)
        assert len(running) == 1, f"{len(running)} engine processes after the worker for share {share} started"
        seen.append(running)
    assert seen[0] != seen[1] and not _gone(seen[0], since)
    assert len(list_workers()) == 1
    stop_workers("life")
    # At once, not eventually: vLLM's engine process notices a killed parent only some seconds
    # later (and may not at all, vLLM's issue about EngineCore surviving its parent); the graceful
    # stop has shut it down before stop_workers returns.
    assert not seen[1] & engines(since), "the stopped worker's engine is still running"
    assert list_workers() == []
