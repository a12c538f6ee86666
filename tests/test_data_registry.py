"""Prompt sets by name: a new one is a loader and one registry line, and the run config and the
workers take it from the registry."""

import pytest

from fedopd.config import ConfigError, parse_run_config
from fedopd.data import DATASETS, PromptSet


def _squares(data, partition_id, num_partitions):
    n = data.prompts_per_client
    return [{"problem": f"What is {k} squared?", "answer": str(k * k)} for k in range(partition_id * n, (partition_id + 1) * n)]


@pytest.fixture()
def squares(monkeypatch):
    monkeypatch.setitem(DATASETS, "squares", PromptSet(_squares))  # the one registry line, undone afterwards


def test_the_registry_holds_the_built_in_prompt_sets_and_which_have_held_out_problems():
    assert sorted(DATASETS) == ["math", "prompts", "sandbox", "tiny-arith"]
    assert [name for name, s in DATASETS.items() if s.heldout_rows is not None] == ["sandbox", "prompts"]


def test_a_registered_prompt_set_is_a_valid_data_name_and_feeds_the_clients(squares):
    from client_app.worker import setup

    cfg = parse_run_config(
        {
            "data.name": "squares",
            "data.prompts-per-client": 4,
            "eval.every": 0,
            "model.student": "builtin:tiny-student",
            "model.teacher": "builtin:tiny-teacher",
        }
    )
    _, prompts = setup(cfg, 1, 3)
    assert [p.problem for p in prompts] == [f"What is {k} squared?" for k in (4, 5, 6, 7)]
    assert [p.answer for p in prompts] == ["16", "25", "36", "49"]


def test_an_unregistered_name_is_refused_naming_the_registered_ones():
    with pytest.raises(ConfigError, match="'data.name' = 'squares' is invalid; allowed: one of 'sandbox', 'tiny-arith', 'math'"):
        parse_run_config({"data.name": "squares"})


def test_held_out_evaluation_needs_a_prompt_set_with_held_out_problems(squares):
    with pytest.raises(ConfigError, match="'eval.every' = 4 needs held-out problems .* data.name one of 'sandbox'"):
        parse_run_config({"data.name": "squares", "eval.every": 4})
