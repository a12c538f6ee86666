"""vLLM's engine process has a lifecycle: a worker whose models are replaced (another
``rollout.gpu-memory-utilization`` after a failed first try, say) or that stops leaves no engine
process behind, in process and in the resident Ray worker. Counted, on vLLM's CPU build (CI's
second environment, scripts/install.sh cpu-vllm); skipped where vLLM cannot run.

In process, the engine is found by the title vLLM gives it (``VLLM::EngineCore``, set with
setproctitle in vllm/v1/engine/core.py) among this test process's descendants, not among the
host's processes: CI runs other vLLM tests on a second pytest worker beside these (a second engine
was counted there in a CI run). The resident worker's processes are found through the actor's pid
(:func:`worker_processes`). A process once found is then followed by its handle, so one that
outlives its parent (and is re-parented away from this process) still counts as running."""

from __future__ import annotations

import time

import psutil
import pytest

from client_app.resident import _alive
from fedopd.rollout.vllm_engine import vllm_platform

pytestmark = [
    pytest.mark.slow,
    pytest.mark.vllm,
    pytest.mark.skipif(vllm_platform() is None, reason="vLLM is not importable here (scripts/install.sh cpu-vllm installs its CPU build)"),
]

SHARE = (0.05, 0.06) if vllm_platform() == "cpu" else (0.2, 0.25)  # the CPU build: a share of the host's memory


# The title as the kernel keeps it (a process's comm: 15 characters); psutil gives the whole title
# where it can read the command line, this prefix where it cannot.
TITLE = "VLLM::EngineCor"


def engines() -> dict[int, psutil.Process]:
    """This test process's running vLLM engine processes, by pid."""
    found = {}
    for proc in psutil.Process().children(recursive=True):
        try:
            if proc.name().startswith(TITLE) and _alive(proc):
                found[proc.pid] = proc
        except psutil.Error:  # ended while we looked
            pass
    return found


def _running(procs: dict[int, psutil.Process]) -> set[int]:
    """The pids of those of ``procs`` still running (psutil's is_running: the same process, not a
    reused pid; an ended child not yet reaped does not count)."""
    return {pid for pid, proc in procs.items() if _alive(proc)}


def _gone(procs: dict[int, psutil.Process], timeout: float = 30.0) -> set[int]:
    """The pids of those of ``procs`` still running after up to ``timeout`` seconds."""
    end = time.monotonic() + timeout
    while time.monotonic() < end and _running(procs):
        time.sleep(0.5)
    return _running(procs)


def _with_workers(procs: dict[int, psutil.Process]) -> dict[int, psutil.Process]:
    """The engines and their vLLM children, taken while they run: on the CPU build the model and
    its KV cache live in a ``VLLM::Worker`` child of the engine (vLLM's "mp" executor)."""
    out = dict(procs)
    for proc in procs.values():
        try:
            out.update({child.pid: child for child in proc.children(recursive=True) if child.name().startswith("VLLM::")})
        except psutil.Error:
            pass
    return out


def worker_processes() -> dict[int, psutil.Process]:
    """The running processes the resident worker started, by pid: its vLLM engine and the engine's
    workers, whatever their titles. In a Ray actor vLLM spawns them (vllm/utils/system_utils.py,
    _maybe_force_spawn), and a CI run showed them titled 'python', not ``VLLM::EngineCore``; so they
    are found through the actor's own pid, not by title."""
    import ray

    from client_app.resident import NAMESPACE, list_workers

    (name,) = list_workers()
    pid = ray.get(ray.get_actor(name, namespace=NAMESPACE).info.remote())["pid"]
    return {proc.pid: proc for proc in psutil.Process(pid).children(recursive=True) if _alive(proc)}


def _tree() -> str:
    """This process's descendants, for a failure message."""
    out = []
    for proc in psutil.Process().children(recursive=True):
        try:
            out.append(f"{proc.pid} {proc.name()!r} ({proc.status()}, parent {proc.ppid()})")
        except psutil.Error:
            pass
    return "; ".join(out) or "none"


def test_the_in_process_worker_closes_its_engine_when_the_config_changes_and_at_the_end():
    from client_app.worker import close_worker_models, worker_models
    from fedopd.config import LoraSettings, ModelSettings

    model = ModelSettings(student="builtin:sandbox-student", teacher="builtin:sandbox-teacher", dtype="float32")
    try:
        worker_models(model, LoraSettings(), "vllm", 512, SHARE[0])
        first = engines()
        assert len(first) == 1, _tree()
        first = _with_workers(first)
        worker_models(model, LoraSettings(), "vllm", 512, SHARE[1])  # the user changed the share
        assert not _gone(first), "the engine of the previous configuration is still running"
        last = engines()
        assert len(last) == 1, _tree()
        last = _with_workers(last)
    finally:
        close_worker_models()
    assert not _gone(last)


@pytest.fixture(scope="module")
def ray_instance():
    ray = pytest.importorskip("ray")
    from client_app.resident import NAMESPACE, stop_workers

    if ray.is_initialized():
        pytest.skip("a Ray instance is initialised in this process")
    # address="local": an instance of this process's own, never one that RAY_ADDRESS or
    # /tmp/ray/ray_current_cluster names (ray/_private/worker.py): its raylet, its workers and their
    # engines are this process's descendants. Ray gives its raylet a fixed 30 s to start
    # (ray/_private/node.py), which the vLLM tests on the other pytest worker can load past: once more.
    kwargs = dict(address="local", num_cpus=1, namespace=NAMESPACE, include_dashboard=False, log_to_driver=False)
    try:
        ray.init(**kwargs)
    except Exception as err:
        if "timed out during startup" not in str(err):
            raise
        ray.shutdown()
        ray.init(**kwargs)
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

    node = {"partition-id": 0, "num-partitions": 3, "worker": "resident", "worker-name": "life", "ray-insecure": True}
    seen = []
    for share in SHARE:
        cfg = parse_run_config(
            {"rollout.backend": "vllm", "rollout.gpu-memory-utilization": share, "rollout.per-round": 4, "rollout.max-new-tokens": 8}
        )
        context = Context(run_id=1, node_id=7, node_config=node, state=RecordDict(), run_config=cfg.to_run_config())
        reply = handle("train", train_message(initial_adapter(cfg)[0], 1), context)
        assert "metrics" in reply.content, reply.error if reply.has_error() else reply.content
        assert len(list_workers()) == 1
        running = worker_processes()
        assert running, f"the worker for share {share} started no process; this process's descendants: {_tree()}"
        seen.append(running)
    assert not seen[0].keys() & seen[1].keys() and not _gone(seen[0]), "a process of the replaced worker is still running"
    stop_workers("life")
    # At once, not eventually: stop_workers returns after the worker's graceful stop and, for
    # whatever that left, its end of the worker's process tree (vLLM's engine process notices a
    # killed parent only some seconds later, and may not at all: vLLM's issue about EngineCore
    # surviving its parent). Which of the two ended it is not told apart here.
    assert not _running(seen[1]), "a process of the stopped worker is still running"
    assert list_workers() == []
