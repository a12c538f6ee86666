"""The app bundle (FAB) that ``flwr run .`` ships to the SuperLink and the SuperNodes: only what the
ServerApp and the ClientApps import (``fab-include`` in pyproject.toml), not the repository's docs,
tests, benchmarks, scripts or presets.

Built in memory with ``flwr.cli.build.build_fab_from_disk``, the function ``flwr run`` and
``flwr build`` call (``flwr build`` itself also wants the checkout's folder name to be a valid app
name, which a clone need not have).
"""

import io
import zipfile
from pathlib import Path

import pytest
import tomllib

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def fab() -> tuple[bytes, list[str]]:
    from flwr.cli.build import build_fab_from_disk

    data = build_fab_from_disk(REPO)
    return data, zipfile.ZipFile(io.BytesIO(data)).namelist()


def _packages() -> list[str]:
    with open(REPO / "pyproject.toml", "rb") as f:
        return tomllib.load(f)["tool"]["hatch"]["build"]["targets"]["wheel"]["packages"]


def test_the_fab_holds_the_app_packages_and_the_readme_only(fab):
    _, names = fab
    top = {name.split("/", 1)[0] for name in names}
    # the wheel's packages: the ServerApp and ClientApp components and all they import
    assert top == {".info", "pyproject.toml", "README.md", *_packages()}
    for folder in ("docs", "tests", "benchmarks", "scripts", "configs", ".ci", "runs"):
        assert folder not in top


def test_the_fab_holds_every_module_of_the_app_packages(fab):
    # an allow-list that is too narrow would fail at import time on the SuperNodes, not here
    _, names = fab
    modules = {
        p.relative_to(REPO).as_posix()
        for package in _packages()
        for p in (REPO / package).rglob("*.py")
        if "__pycache__" not in p.parts and not p.name.startswith("test_") and not p.name.endswith("_test.py")
    }
    assert modules and modules <= set(names), sorted(modules - set(names))


def test_the_fab_carries_the_sandbox_models_json_files_but_no_weights(fab):
    # Flower bundles .py/.toml/.md/.json/.yaml only: the weights (and chat templates) come from the
    # installed package (fedopd/sandbox/__init__.py: sandbox_model_path, docs/deployment.md)
    _, names = fab
    for model in ("sandbox-student", "sandbox-teacher"):
        for file in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
            assert f"fedopd/sandbox/models/{model}/{file}" in names
    assert not [n for n in names if n.endswith((".safetensors", ".jinja", ".png"))]


def test_the_fab_is_far_under_flowers_size_limit(fab):
    from flwr.common.constant import FAB_MAX_SIZE

    data, _ = fab
    assert len(data) < FAB_MAX_SIZE / 4  # about 0.8 MB; 1.6 MB with docs/, tests/, benchmarks/
