"""The hosts' Ray instances let no one in: token authentication, and a resident that refuses a
Ray instance without it (client_app/resident.py; scripts/local-deployment.sh starts Ray so).

The first tests use a stand-in GCS (a gRPC server answering Ray's GetClusterId call) and start no
Ray. The others start a real Ray head with RAY_AUTH_MODE=token in a temp dir on free ports: the
resident worker started by a process with the token cannot be reached by a process without it,
or with another token; and an unauthenticated Ray instance (this test process's own) is refused
unless node config ray-insecure = true.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import textwrap
import time
from concurrent import futures
from pathlib import Path

import grpc
import pytest
from conftest import TINY

from client_app import resident
from client_app.resident import NAMESPACE, check_authentication
from fedopd.config import parse_run_config

REPO = Path(__file__).resolve().parent.parent
TOOLS = REPO / "scripts" / "deployment_tools.py"
BIN = Path(sys.executable).parent
RUN = parse_run_config({**TINY, "rollout.backend": "hf"}).to_run_config()


# --- a stand-in GCS: no Ray ----------------------------------------------------------------------


class _FakeGcs:
    """Answers Ray's GetClusterId: to anyone (``token=None``), or only to ``Bearer <token>``."""

    def __init__(self, token: str | None):
        self.token, self.calls = token, []
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        self.server.add_generic_rpc_handlers([self])
        self.port = self.server.add_insecure_port("127.0.0.1:0")
        self.address = f"127.0.0.1:{self.port}"
        self.server.start()

    def service(self, details):
        if details.method != resident._PROBE:
            return None
        return grpc.unary_unary_rpc_method_handler(self._answer)

    def _answer(self, request, context):
        header = dict(context.invocation_metadata()).get("authorization")
        self.calls.append(header)
        if self.token is not None and header != f"Bearer {self.token}":
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "InvalidAuthToken: Authentication token is missing or incorrect")
        return b""


@pytest.fixture()
def fake_gcs(monkeypatch, tmp_path):
    servers = []

    def make(token: str | None = None) -> _FakeGcs:
        servers.append(_FakeGcs(token))
        return servers[-1]

    for var in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.ray/auth_token
    monkeypatch.setattr(resident, "_CHECKED", {})
    yield make
    for s in servers:
        s.server.stop(None)


def test_an_instance_that_answers_without_a_token_is_refused_naming_the_fix(fake_gcs, monkeypatch):
    import ray

    gcs = fake_gcs(token=None)
    with pytest.raises(RuntimeError) as err:
        check_authentication(gcs.address)
    message = str(err.value)
    assert "runs without authentication" in message
    assert "RAY_AUTH_MODE=token" in message and "RAY_AUTH_TOKEN_PATH" in message and "0600" in message
    assert "ray-insecure = true" in message
    assert gcs.calls == [None]  # it asked without a token, and was answered

    if ray.is_initialized():
        pytest.skip("a Ray instance is initialised in this process")
    monkeypatch.setattr(ray, "init", lambda *a, **k: pytest.fail("ray.init called for an unauthenticated instance"))
    with pytest.raises(RuntimeError, match="runs without authentication"):  # refused before joining
        resident.connect(gcs.address)
    with pytest.raises(RuntimeError, match="runs without authentication"):  # the node config path
        resident.get_worker(RUN, {"worker": "resident", "ray-address": gcs.address})


def test_the_opt_out_accepts_an_unauthenticated_instance_with_a_warning(fake_gcs, caplog):
    gcs = fake_gcs(token=None)
    with caplog.at_level(logging.WARNING, logger="flwr"):
        assert check_authentication(gcs.address, insecure=True) == "disabled"
    assert any(
        r.levelno == logging.WARNING and "ray-insecure = true" in r.getMessage() and "WITHOUT authentication" in r.getMessage()
        for r in caplog.records
    )
    with pytest.raises(RuntimeError, match="runs without authentication"):  # the opt-out is not remembered for others
        check_authentication(gcs.address)


@pytest.mark.parametrize("value, expected", [(True, True), (False, False), ("true", True), ("False", False)])
def test_the_opt_out_is_read_from_the_node_config(value, expected):
    assert resident._node_bool({"ray-insecure": value}, "ray-insecure") is expected
    assert resident._node_bool({}, "ray-insecure") is False


def test_a_bad_opt_out_value_is_refused_naming_the_key():
    with pytest.raises(ValueError, match="node config 'ray-insecure' = 'yes': expected true or false"):
        resident._node_bool({"ray-insecure": "yes"}, "ray-insecure")


def test_an_instance_that_wants_a_token_is_joined_only_with_the_right_one(fake_gcs, monkeypatch, tmp_path):
    gcs = fake_gcs(token="right")
    with pytest.raises(RuntimeError, match="requires token authentication and this process has no token.*RAY_AUTH_TOKEN_PATH"):
        check_authentication(gcs.address)
    token_file = tmp_path / "token"
    token_file.write_text("right\n")
    monkeypatch.setenv("RAY_AUTH_TOKEN_PATH", str(token_file))
    with pytest.raises(RuntimeError, match="RAY_AUTH_MODE = '', so Ray would not send its token"):
        check_authentication(gcs.address)
    monkeypatch.setenv("RAY_AUTH_MODE", "token")
    assert check_authentication(gcs.address) == "token"
    monkeypatch.setattr(resident, "_CHECKED", {})
    monkeypatch.setenv("RAY_AUTH_TOKEN", "wrong")  # RAY_AUTH_TOKEN comes before RAY_AUTH_TOKEN_PATH, as in Ray
    with pytest.raises(RuntimeError, match="refuses this process's token \\(from RAY_AUTH_TOKEN\\)"):
        check_authentication(gcs.address)


def test_the_token_file_is_made_0600_never_overwritten_never_printed(tmp_path):
    path = tmp_path / "ray.token"
    done = subprocess.run([sys.executable, str(TOOLS), "ray-token", str(path)], capture_output=True, text=True, check=True)
    token = path.read_text().strip()
    assert len(token) == 64 and int(token, 16) >= 0  # 256 random bits
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert token not in done.stdout + done.stderr
    subprocess.run([sys.executable, str(TOOLS), "ray-token", str(path)], capture_output=True, check=True)
    assert path.read_text().strip() == token  # kept
    path.chmod(0o644)
    done = subprocess.run([sys.executable, str(TOOLS), "ray-token", str(path)], capture_output=True, text=True, check=False)
    assert done.returncode != 0 and "chmod 600" in done.stderr and path.read_text().strip() == token


# --- real Ray heads: one with token authentication, one without (Ray's default) -------------------


def _free_port() -> str:
    return subprocess.run([sys.executable, str(TOOLS), "free-port"], capture_output=True, text=True, check=True).stdout.strip()


def _clean_env(home: Path, **extra: str) -> dict[str, str]:
    """This environment without any Ray token, HOME in a temp dir (no ~/.ray/auth_token)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_AUTH") and k != "RAY_ADDRESS"}
    return {**env, "HOME": str(home), "PATH": f"{BIN}{os.pathsep}{env.get('PATH', '')}", **extra}


def _start_head(root: Path, token: bool) -> tuple[subprocess.Popen, dict]:
    """``ray start --head`` in its own session (process group), temp dir and free ports."""
    env = _clean_env(root)
    if token:
        subprocess.run([sys.executable, str(TOOLS), "ray-token", str(root / "ray.token")], check=True, capture_output=True)
        env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN_PATH=str(root / "ray.token"))
    port = _free_port()
    with open(root / "ray.log", "w") as log:
        head = subprocess.Popen(
            # --num-cpus 0: the resident worker takes no CPU, and Ray starts no idle workers.
            [
                "ray",
                "start",
                "--head",
                "--block",
                "--include-dashboard=false",
                "--disable-usage-stats",
                "--num-cpus",
                "0",
                "--port",
                port,
                "--ray-client-server-port",
                _free_port(),
                "--dashboard-agent-listen-port",
                _free_port(),
                "--temp-dir",
                str(root / "t"),
            ],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return head, {"address": f"127.0.0.1:{port}", "env": env, "root": root}


def _stop_heads(heads: list[subprocess.Popen]) -> None:
    """SIGTERM to each head's process group (GCS, raylet, agents, workers), SIGKILL after 3 s."""
    for sig, wait in ((signal.SIGTERM, 3.0), (signal.SIGKILL, 5.0)):
        for head in heads:
            try:
                os.killpg(head.pid, sig)
            except ProcessLookupError:
                pass
        end = time.monotonic() + wait
        while time.monotonic() < end:
            alive = False
            for head in heads:
                head.poll()
                try:
                    os.killpg(head.pid, 0)
                    alive = True
                except ProcessLookupError:
                    pass
            if not alive:
                return
            time.sleep(0.1)


class _Heads:
    """The two Ray heads, by kind. A head found dead when a test asks for it is started again:
    `ray start --block` stops the whole head when any one of its processes exits, which a loaded
    2-core CI machine has done between the fixture's start and a later test (the test then saw
    "nothing answers" and failed on the fixture, not on the code). Its log goes to stderr."""

    def __init__(self, roots: dict[str, Path]):
        self.roots, self.heads, self.info = roots, {}, {}

    def start(self, kind: str) -> None:
        root = self.roots[kind]
        self.heads[kind], self.info[kind] = _start_head(root, token=kind == "token")
        host, port = self.info[kind]["address"].split(":")
        ready = subprocess.run([sys.executable, str(TOOLS), "wait-port", host, port, "60"], check=False)
        assert ready.returncode == 0, (root / "ray.log").read_text()

    def __getitem__(self, kind: str) -> dict:
        if self.heads[kind].poll() is not None or not resident._reachable(self.info[kind]["address"]):
            log = (self.roots[kind] / "ray.log").read_text(errors="replace")
            print(f"the {kind} Ray head had stopped; starting it again. Its log:\n{log[-3000:]}", file=sys.stderr)
            _stop_heads([self.heads[kind]])
            self.start(kind)
        return self.info[kind]


@pytest.fixture(scope="module")
def ray_heads():
    """{"token": ..., "plain": ...}: two Ray heads started side by side, stopped and removed at the end."""
    if shutil.which("ray", path=f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}") is None:
        pytest.skip("the ray command is not installed")
    roots = {kind: Path(tempfile.mkdtemp(prefix=f"ftr{kind[0]}", dir="/tmp")) for kind in ("token", "plain")}  # short socket paths
    heads = _Heads(roots)
    try:
        for kind in roots:
            heads.start(kind)
        yield heads
    finally:
        _stop_heads(list(heads.heads.values()))
        for root in roots.values():
            shutil.rmtree(root, ignore_errors=True)


def _python(code: str, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout, check=False
    )


STRANGER = """
    import ray
    ray.init(address={address!r}, namespace={namespace!r}, log_to_driver=False)
    actor = ray.get_actor({name!r}, namespace={namespace!r})
    assert ray.get(actor.__ray_ready__.remote())
    print("CALLED", actor._actor_id.hex())
"""


@pytest.mark.slow
@pytest.mark.deployment
def test_only_a_process_with_the_token_can_reach_the_resident_worker(ray_heads, tmp_path):
    ray_token = ray_heads["token"]
    address = ray_token["address"]
    # The worker, started as a SuperNode's ClientApp would: with RAY_AUTH_MODE and the token file.
    owner = _python(
        f"""
        import json, ray
        from client_app.resident import get_worker, list_workers
        worker = get_worker({RUN!r}, {{"worker": "resident", "worker-name": "auth", "ray-address": {address!r}}})
        assert ray.get(worker.__ray_ready__.remote())
        print(json.dumps({{"name": list_workers()[0], "id": worker._actor_id.hex()}}))
    """,
        ray_token["env"],
    )
    assert owner.returncode == 0, owner.stderr[-3000:]
    worker = json.loads(owner.stdout.strip().splitlines()[-1])

    # Ray's own client, without a token, or with another one: the GCS turns it away, so it never
    # gets to look the worker up, let alone call it. (It would retry for 20 s; 2 tries are enough.)
    code = textwrap.dedent(STRANGER.format(address=address, namespace=NAMESPACE, name=worker["name"]))
    patience = {"RAY_NUM_REDIS_GET_RETRIES": "2"}
    envs = [_clean_env(tmp_path, **patience), _clean_env(tmp_path, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="0" * 64, **patience)]
    strangers = [
        subprocess.Popen([sys.executable, "-c", code], env=env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for env in envs
    ]
    for stranger in strangers:
        out, err = stranger.communicate(timeout=120)
        assert stranger.returncode != 0 and "CALLED" not in out
        assert "Unauthenticated" in err and "Authentication token is missing or incorrect" in err, err[-3000:]

    # The resident itself says at once what is missing, instead of Ray's 20 s and "Failed to connect".
    start = time.monotonic()
    refused = _python(f"from client_app.resident import connect; connect({address!r})", _clean_env(tmp_path))
    assert refused.returncode != 0 and time.monotonic() - start < 15
    assert "requires token authentication" in refused.stderr and "RAY_AUTH_MODE=token and RAY_AUTH_TOKEN_PATH" in refused.stderr

    # The same code with the token reaches the same worker: it is the token, nothing else.
    again = _python(code, ray_token["env"])
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stdout.split() == ["CALLED", worker["id"]]


@pytest.mark.slow
@pytest.mark.deployment
def test_the_resident_refuses_an_unauthenticated_ray_instance_unless_the_node_config_opts_out(ray_heads, monkeypatch, caplog):
    """As a SuperNode's ClientApp: node config worker = 'resident', ray-address = a Ray head that
    runs without authentication (Ray's default), in this process."""
    import ray

    if ray.is_initialized():
        pytest.skip("a Ray instance is initialised in this process")
    if os.environ.get("RAY_AUTH_MODE", "").lower() == "token":
        pytest.skip("RAY_AUTH_MODE=token in this process")
    monkeypatch.setattr(resident, "_CHECKED", {})
    address = ray_heads["plain"]["address"]
    node = {"worker": "resident", "worker-name": "auth", "worker-gpus": 0, "ray-address": address}
    try:
        with pytest.raises(RuntimeError) as err:  # joining it
            resident.get_worker(RUN, node)
        assert f"refusing the Ray instance at {address}: it runs without authentication" in str(err.value)
        assert "RAY_AUTH_MODE=token" in str(err.value) and "ray-insecure = true" in str(err.value)
        assert not ray.is_initialized()  # refused before joining

        with caplog.at_level(logging.WARNING, logger="flwr"):
            worker = resident.get_worker(RUN, {**node, "ray-insecure": True})
        assert ray.get(worker.__ray_ready__.remote())  # joined, and the worker runs
        assert f"node config ray-insecure = true: joining the Ray instance at {address}, which runs WITHOUT authentication" in caplog.text

        with pytest.raises(RuntimeError, match="runs without authentication"):  # already joined, without the opt-out
            resident.get_worker(RUN, node)
    finally:
        if ray.is_initialized():
            resident.stop_workers()
            ray.shutdown()
