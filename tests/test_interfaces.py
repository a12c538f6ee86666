"""The import paths that users' code and the design document name keep working after the code moved
(fedopd/ in subpackages): the same objects, not copies."""

import importlib

import pytest

# (old path, name, where the code lives now)
INTERFACES = [
    ("fedopd.cache", "coarsen", "fedopd.distill.cache"),
    ("fedopd.cache", "kl", "fedopd.distill.cache"),
    ("fedopd.opd", "reverse_kl", "fedopd.distill.opd"),
    ("fedtops_strategy.selection", "select_multiplier", "fedtops_strategy.selection"),
    ("eval.theory", "construction_scores", "eval.theory"),
    ("eval.metrics", "avg_at_k", "fedopd.engine.metrics"),
    ("eval.metrics", "pass_at_k", "fedopd.engine.metrics"),
    # the run config, the models and the rollouts are imported from their package by the apps and users
    ("fedopd.config", "parse_run_config", "fedopd.config.parse"),
    ("fedopd.config", "RunConfig", "fedopd.core.settings"),
    ("fedopd.config", "ConfigError", "fedopd.core.errors"),
    ("fedopd.models", "load_pair", "fedopd.models.load"),
    ("fedopd.models", "ModelLoadError", "fedopd.core.errors"),
    ("fedopd.rollout", "make_rollout_engine", "fedopd.rollout.factory"),
    ("fedopd.data", "DATASETS", "fedopd.data.registry"),
    ("fedopd.data", "register_dataset", "fedopd.data.registry"),
]


@pytest.mark.parametrize(("path", "name", "home"), INTERFACES, ids=[f"{p}.{n}" for p, n, _ in INTERFACES])
def test_an_interface_path_gives_the_object_where_the_code_lives(path, name, home):
    assert getattr(importlib.import_module(path), name) is getattr(importlib.import_module(home), name)


def test_the_interface_functions_keep_the_documented_signatures():
    import inspect

    from fedopd.cache import coarsen, kl
    from fedopd.opd import reverse_kl

    assert list(inspect.signature(coarsen).parameters) == ["probs", "token_ids"]
    assert list(inspect.signature(kl).parameters) == ["p", "q"]
    assert list(inspect.signature(reverse_kl).parameters)[:3] == ["student_logits", "teacher_logits", "mask"]
