"""The resident per-host worker: base models that outlive Flower messages.

Flower's deployment runtime starts a fresh ClientApp process for every message; loading the
teacher, the student and the rollout engine there would cost more than the round. Instead each
host runs a Ray instance (``ray start --head``), and the ClientApp (node config
``worker = "resident"``) forwards each message to a detached, named Ray actor,
:class:`ResidentWorker`, which loads the models on its first message and keeps them:

- the actor's name is ``fedopd-worker-<worker-name>-<digest>``, where the digest covers what the
  models depend on (model names, dtype, LoRA settings, rollout backend and engine limits, the
  package version): a run with other models gets a new worker, and the old one of the same
  ``worker-name`` is stopped first, so stale models are never used and never pile up;
- the actor runs the same handlers as the in-process mode (:mod:`client_app.handlers`), one
  message at a time; per-client state (θ_t, scoring cache, optimizer state) travels with the
  message as the client's ``context.state`` and comes back with the reply, so nothing of a run
  is kept in the worker;
- ``python -m client_app.resident status|stop [--ray-insecure]`` lists or stops the workers.

Node config keys (``flower-supernode --node-config``): ``worker`` (``"resident"``),
``worker-name`` (default ``"default"``; one per SuperNode when several share a host),
``ray-address`` (default ``"auto"``), ``ray-insecure`` (default ``false``; see below),
``worker-gpus`` (GPUs the actor holds; default 1 where the Ray instance has a GPU, else 0) and
``worker-threads`` (torch CPU threads; default: Ray's).

Ray authentication: whoever can reach a Ray instance's ports can run any code on its host, and
Ray listens on all interfaces whatever ``--node-ip-address`` says. So the host's Ray must run with
token authentication (Ray >= 2.52): ``RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=<file> ray start
--head``, the file holding a random token, mode 0600 (``python scripts/deployment_tools.py
ray-token <file>`` makes one), and the SuperNode gets the same two environment variables, which
its ClientApp processes inherit. Before joining, :func:`connect` asks the instance's GCS for its
cluster id without a token: an instance that answers runs without authentication and is refused,
unless the node config sets ``ray-insecure = true`` (a trusted network only; logged as a warning).
An instance that wants a token this process does not have, or another one, is reported at once
(``ray.init`` would retry for 20 s and then say only that it could not connect).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import sys
import time
from collections.abc import Mapping
from typing import Any

NAMESPACE = "fedopd"
PREFIX = "fedopd-worker"


def worker_identity(run_config: Mapping[str, Any]) -> dict[str, Any]:
    """What the worker's loaded models depend on, from a run config (validated)."""
    from fedopd import __version__
    from fedopd.config import parse_run_config
    from fedopd.rollout.vllm_engine import run_max_num_seqs

    cfg = parse_run_config(dict(run_config))
    r = cfg.rollout
    return {
        "student": cfg.model.student,
        "teacher": cfg.model.teacher,
        "dtype": cfg.model.dtype,
        "lora": [cfg.lora.rank, cfg.lora.alpha, cfg.lora.dropout, list(cfg.lora.target_modules)],
        "backend": r.backend,
        "max-model-len": cfg.data.max_prompt_tokens + max(r.max_new_tokens, cfg.eval.max_new_tokens),
        "gpu-memory-utilization": r.gpu_memory_utilization,
        "stop-tokens": r.stop_tokens,
        "max-num-seqs": run_max_num_seqs(cfg),
        "version": __version__,
    }


def actor_name(worker_name: str, identity: Mapping[str, Any]) -> str:
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:12]
    return f"{PREFIX}-{worker_name}-{digest}"


class ResidentWorker:
    """A Ray actor holding one host's models; it runs :data:`client_app.handlers.HANDLERS`."""

    def __init__(self, identity: dict[str, Any], threads: int | None = None) -> None:
        if threads:
            import torch

            torch.set_num_threads(threads)
        self.identity = identity

    def handle(
        self,
        kind: str,
        content,
        state,
        pid: int,
        num: int,
        run_config: dict[str, Any],
        node_config: dict[str, Any],
        run_id: int = 0,
        node_id: int = 0,
    ):
        """(reply content, the client's new state) for one message."""
        from client_app.handlers import HANDLERS
        from fedopd.config import parse_run_config

        got = worker_identity(run_config)
        if got != self.identity:
            raise RuntimeError(f"this worker holds {self.identity}, the message needs {got}")
        reply = HANDLERS[kind](content, state, pid, num, parse_run_config(run_config), node_config, run_id, node_id)
        return reply, state

    def info(self) -> dict[str, Any]:
        from client_app.worker import model_loads

        return {"pid": os.getpid(), "model-loads": model_loads(), "identity": self.identity}

    def processes(self) -> dict[str, Any]:
        """This actor's node and its process tree (vLLM's engine and workers among them), as
        (pid, start time) pairs: what :func:`stop_workers` ends if a graceful stop leaves any."""
        import psutil
        import ray

        me = psutil.Process()
        tree = [me, *me.children(recursive=True)]
        pids = []
        for proc in tree:
            try:
                pids.append([proc.pid, proc.create_time()])
            except psutil.Error:
                pass
        return {"node": ray.get_runtime_context().get_node_id(), "pids": pids}

    processes.__ray_concurrency_group__ = "control"  # what ray.method(concurrency_group=) sets: it answers while a message runs

    def shutdown(self) -> None:
        """Close the models (vLLM's engine process first): the graceful stop before ``ray.kill``."""
        from client_app.worker import close_worker_models

        close_worker_models()


def connect(address: str = "auto", insecure: bool = False) -> None:
    """Join the host's Ray instance (``ray start --head``) in the workers' namespace.

    Refuses an instance that runs without authentication unless ``insecure`` (node config
    ``ray-insecure``); see the module docstring.
    """
    import ray

    if ray.is_initialized():
        check_authentication(ray.get_runtime_context().gcs_address, insecure)
        return
    hint = f"node config worker = 'resident' needs a Ray instance on this host at ray-address = {address!r} (start one with `ray start --head`)"
    if address == "auto":
        from ray._private.services import canonicalize_bootstrap_address_or_die

        try:
            gcs_address = canonicalize_bootstrap_address_or_die(address)  # as ray.init resolves it
        except ConnectionError as err:
            raise RuntimeError(f"{hint}: {err}") from None
    else:
        gcs_address = address
    if not _reachable(gcs_address):
        raise RuntimeError(f"{hint}: nothing answers at {gcs_address}")  # ray.init would wait for minutes
    check_authentication(gcs_address, insecure)
    try:
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, logging_level="ERROR")
    except ConnectionError as err:
        raise RuntimeError(hint) from err


# The GCS call used to learn whether a Ray instance checks tokens: it takes an empty request and
# is the first call every Ray client makes (GcsClient::Connect).
_PROBE = "/ray.rpc.NodeInfoGcsService/GetClusterId"
_FIX = (
    "start Ray with token authentication, RAY_AUTH_MODE=token RAY_AUTH_TOKEN_PATH=<file> ray start --head ..., "
    "the file holding a random token with mode 0600 (`python scripts/deployment_tools.py ray-token <file>` makes one; "
    "scripts/local-deployment.sh does all this), and give the SuperNode the same RAY_AUTH_MODE and RAY_AUTH_TOKEN_PATH"
)
_CHECKED: dict[tuple[str, bool], str] = {}  # (GCS address, insecure) -> its auth mode, once accepted in this process


def gcs_accepts(gcs_address: str, token: str | None = None, timeout: float = 10.0) -> bool:
    """Whether the GCS at ``gcs_address`` answers a call that presents ``token`` (None: no token);
    False if it refuses it as unauthenticated. A GCS that answers without a token runs without
    authentication."""
    import grpc

    metadata = [("authorization", f"Bearer {token}")] if token else None
    with grpc.insecure_channel(gcs_address) as channel:
        try:
            channel.unary_unary(_PROBE)(b"", timeout=timeout, metadata=metadata)
        except grpc.RpcError as err:
            if err.code() == grpc.StatusCode.UNAUTHENTICATED:
                return False
            raise RuntimeError(
                f"could not tell whether the Ray instance at {gcs_address} checks tokens: its GCS answered {err.code().name}: {err.details()}"
            ) from None
    return True


def local_token() -> tuple[str | None, str]:
    """(this process's Ray token, where it comes from), as Ray looks for it: ``RAY_AUTH_TOKEN``,
    the file ``RAY_AUTH_TOKEN_PATH``, then ``~/.ray/auth_token`` (first line, stripped)."""
    if os.environ.get("RAY_AUTH_TOKEN", "").strip():
        return os.environ["RAY_AUTH_TOKEN"].strip(), "RAY_AUTH_TOKEN"
    path = os.environ.get("RAY_AUTH_TOKEN_PATH") or os.path.join(os.path.expanduser("~"), ".ray", "auth_token")
    try:
        with open(path) as f:
            return f.readline().strip() or None, path
    except OSError:
        return None, path


def check_authentication(gcs_address: str, insecure: bool = False) -> str:
    """Refuse (RuntimeError) a Ray instance that runs without authentication, unless ``insecure``
    (then warn); for one that checks tokens, make sure this process presents the right one.
    Returns the instance's auth mode (``"token"`` or ``"disabled"``)."""
    if (gcs_address, insecure) in _CHECKED:
        return _CHECKED[gcs_address, insecure]
    mode = "disabled" if gcs_accepts(gcs_address) else "token"
    if mode == "disabled":
        if not insecure:
            raise RuntimeError(
                f"refusing the Ray instance at {gcs_address}: it runs without authentication, so anyone who can reach "
                f"its ports can run code on this host. Fix: {_FIX}. On a trusted network only: node config "
                "ray-insecure = true"
            )
        from logging import WARNING

        from flwr.common.logger import log

        log(
            WARNING,
            "node config ray-insecure = true: joining the Ray instance at %s, which runs WITHOUT authentication "
            "(anyone who can reach its ports can run code on this host)",
            gcs_address,
        )
    else:
        token, source = local_token()
        problem = None
        if not token:
            problem = f"no token ({source} is missing or empty)"
        elif os.environ.get("RAY_AUTH_MODE", "").strip().lower() != "token":
            problem = f"RAY_AUTH_MODE = {os.environ.get('RAY_AUTH_MODE', '')!r}, so Ray would not send its token"
        if problem:
            raise RuntimeError(
                f"the Ray instance at {gcs_address} requires token authentication and this process has {problem}: "
                "give this process (for the ClientApp: the SuperNode) RAY_AUTH_MODE=token and "
                "RAY_AUTH_TOKEN_PATH=<the token file Ray was started with>"
            )
        if not gcs_accepts(gcs_address, token):
            raise RuntimeError(
                f"the Ray instance at {gcs_address} refuses this process's token (from {source}): "
                "set RAY_AUTH_TOKEN_PATH to the token file Ray was started with"
            )
    _CHECKED[gcs_address, insecure] = mode
    return mode


def _reachable(address: str, timeout: float = 2.0) -> bool:
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]") or "127.0.0.1", int(port)), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


def _node_float(node_config: Mapping[str, Any], key: str) -> float | None:
    if key not in node_config:
        return None
    try:
        return float(node_config[key])
    except (TypeError, ValueError) as err:
        raise ValueError(f"node config {key!r} = {node_config[key]!r} is not a number") from err


def _node_bool(node_config: Mapping[str, Any], key: str) -> bool:
    value = node_config.get(key, False)
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "false"):
        return value.strip().lower() == "true"
    raise ValueError(f"node config {key!r} = {value!r}: expected true or false")


def get_worker(run_config: Mapping[str, Any], node_config: Mapping[str, Any]):
    """The handle of this host's worker for these models, started if needed."""
    import ray

    connect(str(node_config.get("ray-address", "auto")), _node_bool(node_config, "ray-insecure"))
    group = str(node_config.get("worker-name", "default"))
    identity = worker_identity(run_config)
    name = actor_name(group, identity)
    stop_workers(group, keep=name)
    gpus = _node_float(node_config, "worker-gpus")
    if gpus is None:
        gpus = 1.0 if ray.cluster_resources().get("GPU", 0) >= 1 else 0.0
    threads = _node_float(node_config, "worker-threads")
    actor = ray.remote(concurrency_groups={"control": 1})(ResidentWorker).options(
        name=name,
        namespace=NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        max_concurrency=1,
        num_cpus=0,
        num_gpus=gpus,
    )
    return actor.remote(identity, int(threads) if threads else None)


def call_resident(
    kind: str, content, state, pid: int, num: int, run_config: Mapping[str, Any], node_config: Mapping[str, Any], run_id: int = 0, node_id: int = 0
):
    """Run one message's work in the resident worker: (reply content, new state)."""
    import ray

    worker = get_worker(run_config, node_config)
    try:
        return ray.get(worker.handle.remote(kind, content, state, pid, num, dict(run_config), dict(node_config), run_id, node_id))
    except ray.exceptions.RayTaskError as err:  # the handler's own exception, as the shell's reply reason reads it
        raise (err.cause if isinstance(err.cause, Exception) else RuntimeError(f"resident worker: {err}")) from None


def worker_group(name: str) -> str | None:
    """The ``worker-name`` part of an actor name (``fedopd-worker-<worker-name>-<12 hex>``), or None."""
    head, _, digest = name.rpartition("-")
    if not name.startswith(PREFIX + "-") or len(digest) != 12 or len(head) <= len(PREFIX) + 1:
        return None
    return head[len(PREFIX) + 1 :]


def list_workers() -> list[str]:
    import ray

    return sorted(n for n in ray.util.list_named_actors() if n.startswith(PREFIX + "-"))


GRACE_S = 120.0  # how long a worker gets to finish its message and close its engine before ray.kill


def stop_workers(worker_name: str | None = None, keep: str | None = None, grace_s: float = GRACE_S) -> list[str]:
    """Stop the workers (of ``worker_name``, or all), except ``keep``; their names.

    Each is first asked to close its models (:meth:`ResidentWorker.shutdown`: vLLM's engine process
    stops and frees its memory), then killed with ``ray.kill``, which runs none of the worker's own
    cleanup (Ray kills its direct children, unless ``RAY_kill_child_processes_on_worker_exit=0``);
    any process of its tree still alive after that (on this node; the tree as it was before and
    after the graceful stop) is terminated, then killed: an engine process can outlive its parent
    (vLLM's ``EngineCore`` can) and would keep its GPU memory.
    """
    import ray

    stopped = []
    for name in list_workers():
        if (worker_name is None or worker_group(name) == worker_name) and name != keep:
            actor = ray.get_actor(name, namespace=NAMESPACE)
            before = _call(actor.processes, 10.0)
            _call(actor.shutdown, grace_s)
            after = _call(actor.processes, 10.0)  # an engine started while the worker was still loading
            ray.kill(actor, no_restart=True)
            here = ray.get_runtime_context().get_node_id()
            trees = [t for t in (before, after) if t and t["node"] == here]
            _end_processes([pid for t in trees for pid in t["pids"]])
            stopped.append(name)
    return stopped


def _call(method, timeout: float):
    """``ray.get(method.remote())`` or None if the actor does not answer in ``timeout`` seconds
    (busy with a long message, or broken): the stop goes on without it."""
    import ray

    try:
        return ray.get(method.remote(), timeout=timeout)
    except (ray.exceptions.GetTimeoutError, ray.exceptions.RayError):
        return None


def _end_processes(pids: list[list[float]], wait_s: float = 10.0) -> None:
    """SIGTERM each (pid, start time) still running, SIGKILL what is left after ``wait_s`` and wait
    (up to 5 s) for those to end, so that what they held is free when this returns; a pid reused by
    another process (a start time more than a second apart: psutil derives it from the boot time,
    which moves when the clock is stepped) is left alone."""
    import psutil

    from fedopd.core.procinfo import terminate_then_kill

    alive, seen = [], set()
    for pid, started in pids:
        if int(pid) in seen or int(pid) == os.getpid():
            continue
        seen.add(int(pid))
        try:
            proc = psutil.Process(int(pid))
            if abs(proc.create_time() - started) < 1.0:
                alive.append(proc)
        except psutil.Error:
            pass
    left = terminate_then_kill(alive, wait_s)
    # A SIGKILL is sent, not yet acted on. Polled rather than waited for (psutil's wait reaps a
    # child of this process, whose exit status belongs to whoever started it).
    end = time.monotonic() + 5.0
    while time.monotonic() < end and any(_alive(proc) for proc in left):
        time.sleep(0.05)


def _alive(proc) -> bool:
    """Whether ``proc`` (a psutil.Process) still runs: an ended child not yet reaped is a zombie."""
    import psutil

    try:
        return proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m client_app.resident", description="The resident workers on this host's Ray instance.")
    parser.add_argument("command", choices=["status", "stop"])
    parser.add_argument("--address", default="auto", help="Ray address (default: auto, the instance of `ray start --head`)")
    parser.add_argument("--name", default=None, help="only the workers of this node config worker-name")
    parser.add_argument("--ray-insecure", action="store_true", help="join a Ray instance that runs without authentication (trusted networks only)")
    args = parser.parse_args(argv)
    connect(args.address, args.ray_insecure)
    import ray

    if args.command == "stop":
        for name in stop_workers(args.name):
            print(f"stopped {name}")
        return 0
    for name in list_workers():
        if args.name is None or worker_group(name) == args.name:
            info = ray.get(ray.get_actor(name, namespace=NAMESPACE).info.remote())
            print(f"{name}  pid {info['pid']}  model loads {info['model-loads']}  {json.dumps(info['identity'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
