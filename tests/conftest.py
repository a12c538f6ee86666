import os

import pytest


def pytest_configure(config):
    # Tests build the tiny models into a cache of their own unless one is given.
    if "FEDTOPS_CACHE" not in os.environ:
        import tempfile

        os.environ["FEDTOPS_CACHE"] = tempfile.mkdtemp(prefix="fedtops-test-cache-")


@pytest.fixture(scope="session")
def tiny_pair():
    """The built-in tiny student (LoRA attached, seed 0) and teacher, loaded once per session."""
    from fedopd.config import LoraSettings
    from fedopd.models import load_pair

    return load_pair("builtin:tiny-student", "builtin:tiny-teacher", lora=LoraSettings(), seed=0)
