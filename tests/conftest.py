import os
import sys

import pytest

# The random tiny models and tiny-arith prompts (configs/tiny.toml): fast tests of the machinery.
TINY = {
    "model.student": "builtin:tiny-student",
    "model.teacher": "builtin:tiny-teacher",
    "data.name": "tiny-arith",
    "data.prompts-per-client": 64,
    "rollout.max-new-tokens": 64,
    "train.lr": 2e-3,
    "train.mini-batch": 8,
    "train.micro-batch": 4,
    "num-server-rounds": 5,
    "eval.every": 0,
}
# A whole in-process run of the app on the tiny models in seconds: 8 short rollouts per client and round.
TINY_RUN = {
    **TINY,
    "rollout.backend": "hf",
    "rollout.per-round": 8,
    "rollout.max-new-tokens": 16,
    "data.prompts-per-client": 16,
    "train.mini-batch": 4,
    "train.micro-batch": 2,
    "eval.every": 0,
}


_OWN_CACHE = []


def pytest_configure(config):
    # CPU and fp32 on any host: the tests assert fp32 bounds. The library reads FEDTOPS_DEVICE
    # wherever it picks a device (fedopd.models.paths.default_device; model.dtype and
    # rollout.backend 'auto' follow it), and every process started from here inherits it: flwr
    # run's SuperLink and simulation, Ray workers, SuperNodes, eval subprocesses. The tests marked
    # gpu choose their device themselves (tests/devices.py). Set before any test runs, and on
    # every xdist worker (each runs this hook).
    os.environ["FEDTOPS_DEVICE"] = "cpu"
    if "PYTEST_XDIST_WORKER" in os.environ:  # one compute thread per worker (and its subprocesses)
        for name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ.setdefault(name, "1")
        if "torch" in sys.modules:  # a plugin imported it before the variable could act
            sys.modules["torch"].set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    # Tests build the tiny models into a cache of their own unless one is given; it is removed
    # when the session ends.
    if "FEDTOPS_CACHE" not in os.environ:
        import tempfile

        os.environ["FEDTOPS_CACHE"] = tempfile.mkdtemp(prefix="fedtops-test-cache-")
        _OWN_CACHE.append(os.environ["FEDTOPS_CACHE"])


# The suite runs on every core (pytest-xdist, -n auto in pyproject.toml), each test on its own
# except for the tests that start processes of a federation: a local Ray instance (Flower's
# simulation, the resident worker, its vLLM lifecycle) or a whole local deployment (a SuperLink,
# SuperNodes and Ray, scripts/local-deployment.sh). They run one after another on one worker (the
# group "ray", by the scheduler below): a Ray client started without an address joins the latest
# local instance, so two of them must not overlap; and two of them at once on CI's 2 cores slowed
# Ray's start past the 30 s it gives its raylet, failing runs and deployments (stop 44). The group
# also keeps each deployment module fixture (tests/test_deployment.py) on the worker that built it.
# (xdist's own --dist loadgroup does not group under pytest 9: its nodeid suffix is ignored.)
# Each worker computes with one thread (pytest_configure): two workers of two threads each on two
# cores spin against each other, and ran the suite slower than one process did.
RAY_FILES = {
    "test_flwr_run.py",
    "test_vllm_app.py",
    "test_simulation.py",
    "test_ray_auth.py",
    "test_resident.py",
    "test_engine_lifecycle.py",
    "test_deployment.py",
}


def schedule_unit(nodeid: str) -> str:
    """The scheduling unit of a test: the group "ray", or the test itself."""
    path = nodeid.partition("::")[0]
    return "ray" if path.rsplit("/", 1)[-1] in RAY_FILES else nodeid


def pytest_xdist_make_scheduler(config, log):
    from xdist.scheduler import LoadScopeScheduling

    class GroupScheduling(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return schedule_unit(nodeid)

    return GroupScheduling(config, log)


def pytest_unconfigure(config):
    import shutil

    for path in _OWN_CACHE:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_pair():
    """The built-in tiny student (LoRA attached, seed 0) and teacher, loaded once per session (on
    the CPU in fp32: FEDTOPS_DEVICE, pytest_configure)."""
    from fedopd.config import LoraSettings
    from fedopd.models import load_pair

    return load_pair("builtin:tiny-student", "builtin:tiny-teacher", lora=LoraSettings(), seed=0)


@pytest.fixture()
def task_identity():
    """Messages take their sender from the process's task identity, set by Flower's runtime."""
    from flwr.supercore.task_identity import TaskIdentity

    saved = (TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id)
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 0, 1
    yield
    TaskIdentity._run_id, TaskIdentity._node_id, TaskIdentity._task_id = saved


@pytest.fixture(scope="session")
def vllm_gpu_student(tmp_path_factory):
    """A tiny random student whose attention head size vLLM's GPU backends take (tests/model_fixtures.py)."""
    from model_fixtures import tiny_student_for_vllm_gpu

    return str(tiny_student_for_vllm_gpu(tmp_path_factory.mktemp("vllm-gpu-student") / "student"))


@pytest.fixture(scope="session")
def model_copies(tmp_path_factory):
    """Folders of sandbox-model copies with real checkpoints' metadata (tests/model_fixtures.py), by name."""
    from model_fixtures import BUILDERS

    root = tmp_path_factory.mktemp("model-copies")
    return {name: str(build(root / name)) for name, build in BUILDERS.items()}
