import os

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


_OWN_CACHE = []


def pytest_configure(config):
    # Tests build the tiny models into a cache of their own unless one is given; it is removed
    # when the session ends.
    if "FEDTOPS_CACHE" not in os.environ:
        import tempfile

        os.environ["FEDTOPS_CACHE"] = tempfile.mkdtemp(prefix="fedtops-test-cache-")
        _OWN_CACHE.append(os.environ["FEDTOPS_CACHE"])


def pytest_unconfigure(config):
    import shutil

    for path in _OWN_CACHE:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_pair():
    """The built-in tiny student (LoRA attached, seed 0) and teacher, loaded once per session."""
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
def model_copies(tmp_path_factory):
    """Folders of sandbox-model copies with real checkpoints' metadata (tests/model_fixtures.py), by name."""
    from model_fixtures import BUILDERS

    root = tmp_path_factory.mktemp("model-copies")
    return {name: str(build(root / name)) for name, build in BUILDERS.items()}
