"""``fedtops-se`` (the lr study's variant, docs/sandbox.md): the standard error of Ĵ_i(a) on the
client, its combination across clients, and the walk that keeps the smaller a unless a larger one
is better by more than its standard error. Expected values by hand."""

from __future__ import annotations

import math

import pytest
import torch
from test_scores import P0, PA, Q, _cache, _kl
from test_strategies import UPDATES, FakeGrid, _run

from fedopd.config import StrategySettings, parse_run_config
from fedopd.distill.cache import candidate_scores
from fedtops_strategy import make_strategy
from fedtops_strategy.fedtops_se import FedTOPSStandardError, combined_se, smallest_clear_step

pytestmark = pytest.mark.usefixtures("task_identity")


def test_the_client_standard_error_is_the_sd_of_the_per_position_kls_over_root_n():
    q2, a2 = [0.1, 0.1, 0.8], [0.25, 0.25, 0.5]
    j, _, se = candidate_scores(_cache([Q, q2], [P0, P0]), torch.tensor([PA, a2], dtype=torch.float64), with_se=True)
    x = [_kl(Q, PA), _kl(q2, a2)]
    # two values: sd = |x1 - x2| / sqrt(2), over sqrt(2): |x1 - x2| / 2
    assert se == pytest.approx(abs(x[0] - x[1]) / 2, rel=1e-12)
    assert j == pytest.approx(sum(x) / 2, rel=1e-12)
    assert candidate_scores(_cache([Q], [P0]), torch.tensor([PA], dtype=torch.float64), with_se=True)[2] == math.inf


def test_the_combined_standard_error_of_a_weighted_mean():
    # weights 1 and 3, se 0.4 and 0.2 at the first candidate: sqrt(0.16 + 0.36) / 4
    assert combined_se([[0.4, 1.0], [0.2, 0.0]], [1, 3]) == pytest.approx([math.sqrt(0.52) / 4, 0.25], rel=1e-12)


def test_a_standard_error_too_large_to_square_combines_to_inf_not_an_overflow_error():
    # (3 × 1e200)² overflows a float: the combined SE is inf (the walk then stays at the smallest a).
    assert combined_se([[1e200, 0.1]], [3]) == [math.inf, pytest.approx(0.1, rel=1e-12)]


@pytest.mark.parametrize(
    "teacher, se, ceiling, expected",
    [
        ([0.50, 0.45, 0.40], [0.0, 0.01, 0.01], 2.0, 2.0),  # each step better by 0.05 > 0.01: up to 2
        ([0.50, 0.45, 0.40], [0.0, 0.10, 0.10], 2.0, 0.5),  # 0.05 < 0.10 at each step: stays at 0.5
        ([0.50, 0.49, 0.40], [0.0, 0.05, 0.05], 2.0, 2.0),  # 1 is not clearly better than 0.5, 2 is (0.10 > 0.05)
        ([0.50, 0.45, 0.40], [0.0, 0.01, 0.01], 1.0, 1.0),  # never above the paper's choice
    ],
)
def test_the_walk_moves_up_only_when_a_larger_a_is_better_by_more_than_its_standard_error(teacher, se, ceiling, expected):
    assert smallest_clear_step([0.5, 1.0, 2.0], teacher, se, [0, 1, 2], ceiling) == expected


def test_the_walk_keeps_to_the_feasible_candidates():
    assert smallest_clear_step([0.5, 1.0, 2.0], [0.50, 0.45, 0.40], [0.0, 0.01, 0.01], [1, 2], 2.0) == 2.0
    assert smallest_clear_step([0.5, 1.0, 2.0], [0.50, 0.45, 0.40], [0.0, 0.10, 0.10], [1, 2], 2.0) == 1.0


# Candidates (0.5, 1, 2, 3, 5, 10), δ = 0.05; both clients weigh 1. Feasible: 0.5, 1, 2 (a = 3's
# K̂ 0.08 > δ at node 1). Ĵ means 0.90, 0.85, 0.60: the paper's rule takes 2 (lowest Ĵ).
SCORES = {
    1: ([0.90, 0.85, 0.60, 0.5, 0.5, 0.5], [0.001, 0.01, 0.04, 0.08, 0.3, 0.5]),
    2: ([0.90, 0.85, 0.60, 0.5, 0.5, 0.5], [0.001, 0.01, 0.03, 0.04, 0.06, 0.2]),
}
EQUAL = {1: 1, 2: 1}


@pytest.mark.parametrize(
    "se, expected",
    [
        # combined SE = sqrt(se² + se²) / 2 = se / sqrt(2). se = 0.01: every step (0.05, 0.25) is clear: 2
        (0.01, 2.0),
        # se = 0.1 (combined 0.0707): 0.5 -> 1 (0.05) is not clear, 0.5 -> 2 (0.30) is: 2
        (0.1, 2.0),
        # se = 0.5 (combined 0.354): nothing is clear: the smallest feasible, 0.5
        (0.5, 0.5),
    ],
)
def test_fedtops_se_refines_the_paper_choice_from_the_clients_standard_errors(se, expected):
    strategy = make_strategy(StrategySettings(name="fedtops-se"), num_clients=2)
    assert isinstance(strategy, FedTOPSStandardError)
    grid = FakeGrid(UPDATES, EQUAL, scores=SCORES, extra={("query.score", n): {"teacher-score-se": [se] * 6} for n in (1, 2)})
    ran = _run(strategy, grid)
    query = next(m for m in grid.sent if m.metadata.message_type == "query.score")
    assert query.content.config_records["config"]["score-se"] is True
    record = ran.records[1]
    assert (record["paper-multiplier"], record["multiplier"]) == (2.0, expected)
    assert record["teacher-score-se"][0] == pytest.approx(se / math.sqrt(2), rel=1e-12)


@pytest.mark.parametrize(
    "node2",
    # Taken at face value, -0.01 and five of 0.01 would make every step clear (combined SE 0.007): a = 2.
    [{"teacher-score-se": [-0.01] * 6}, {"teacher-score-se": [0.01] * 5}, {"teacher-score-se": [float("nan")] * 6}, {}],
    ids=["negative", "wrong-length", "nan", "absent"],
)
def test_a_client_without_valid_standard_errors_keeps_fedtops_se_at_the_smallest_feasible_a(node2):
    strategy = make_strategy(StrategySettings(name="fedtops-se"), num_clients=2)
    extra = {("query.score", 1): {"teacher-score-se": [0.01] * 6}, ("query.score", 2): node2}
    ran = _run(strategy, FakeGrid(UPDATES, EQUAL, scores=SCORES, extra=extra))
    assert ran.records[1]["multiplier"] == 0.5


def test_the_paper_fedtops_score_query_asks_for_nothing_more():
    strategy = make_strategy(StrategySettings(name="fedtops"), num_clients=2)
    grid = FakeGrid(UPDATES, EQUAL, scores=SCORES)
    ran = _run(strategy, grid)
    query = next(m for m in grid.sent if m.metadata.message_type == "query.score")
    assert dict(query.content.config_records["config"]) == {"candidates": [0.5, 1.0, 2.0, 3.0, 5.0, 10.0], "server-round": 1}
    assert ran.records[1]["multiplier"] == 2.0 and "paper-multiplier" not in ran.records[1]


def test_fedtops_se_is_a_registered_strategy_name():
    assert parse_run_config({"strategy.name": "fedtops-se"}).strategy.name == "fedtops-se"


@pytest.mark.slow
def test_a_fedtops_se_run_gets_standard_errors_from_real_clients(tmp_path):
    from conftest import TINY_RUN

    from server_app.inprocess import run_in_process

    config = {**TINY_RUN, "num-server-rounds": 1, "strategy.name": "fedtops-se", "output-dir": str(tmp_path)}
    import json

    run = run_in_process(config, num_clients=2)
    [record] = [json.loads(line) for line in (run / "rounds.jsonl").read_text().splitlines() if json.loads(line)["round"] == 1]
    se = record["teacher-score-se"]
    # 2 clients, 4 rollouts × 16 positions each: finite, positive standard errors, one per candidate
    assert len(se) == 6 and all(v is not None and v > 0 for v in se)
    # the walk never goes above the paper's choice and lands on a candidate
    assert record["multiplier"] <= record["paper-multiplier"] and record["multiplier"] in record["candidates"]


# ---------------------------------------------------------------------------------------------
# fedtops-heldout-cache: the scoring cache from prompts the client does not train on this round
# ---------------------------------------------------------------------------------------------


def test_untrained_indices_avoid_the_round_batch_and_repeat_for_a_seed():
    from fedopd.data.prompts import untrained_indices

    picked = untrained_indices(10, [0, 2, 4, 6, 8], 4, seed=7)
    assert len(set(picked.tolist())) == 4 and not set(picked.tolist()) & {0, 2, 4, 6, 8}
    assert picked.tolist() == untrained_indices(10, [0, 2, 4, 6, 8], 4, seed=7).tolist()
    with pytest.raises(ValueError, match="needs 6 prompts outside"):
        untrained_indices(10, [0, 2, 4, 6, 8], 6, seed=7)


def test_the_train_message_asks_for_a_heldout_cache_only_under_that_variant():
    from client_app.requests import TrainRequest

    for name, expected in (("fedtops", None), ("fedtops-heldout-cache", "untrained")):
        strategy = make_strategy(StrategySettings(name=name), num_clients=2)
        grid = FakeGrid(UPDATES, EQUAL, scores=SCORES)
        _run(strategy, grid)
        config = grid.sent[0].content.config_records["config"]
        assert config.get("scoring-cache") == expected
        assert TrainRequest.from_config({**dict(config), "server-round": 1}).scoring_cache == (expected or "round")
    with pytest.raises(ValueError, match="'scoring-cache' = 'future'"):
        TrainRequest.from_config({"server-round": 1, "scoring-cache": "future"})


@pytest.mark.slow
def test_a_heldout_cache_holds_rollouts_of_prompts_the_round_does_not_train_on(tiny_pair):
    import dataclasses

    from conftest import TINY

    from fedopd.data import encode_prompts, round_indices, tiny_arith_partition
    from fedopd.engine.round import ClientModels, RoundPlan, train_round
    from fedopd.rollout import HFRolloutEngine

    student, teacher = tiny_pair
    models = ClientModels(student, teacher, HFRolloutEngine(student))
    cfg = parse_run_config(TINY)
    prompts = encode_prompts(student.tokenizer, tiny_arith_partition(0, 3, 64, 42), 2048)
    plan = RoundPlan(
        server_round=1,
        seed=42,
        rollout=dataclasses.replace(cfg.rollout, per_round=8, max_new_tokens=16),
        cache=cfg.cache,
        train=dataclasses.replace(cfg.train, mini_batch=4, micro_batch=2),
        step_offset=0,
        total_steps=2,
        cache_source="untrained",
    )
    out = train_round(models, student.get_lora_arrays(), prompts, plan)
    trained = {tuple(prompts[i].token_ids) for i in round_indices(len(prompts), 1, 8, 42)}
    rows = [tuple(r[m.astype(bool)].tolist()) for r, m in zip(out.cache.input_ids, out.cache.attention_mask)]
    starts = [next((tuple(p.token_ids) for p in prompts if row[: len(p.token_ids)] == tuple(p.token_ids)), None) for row in rows]
    assert len(rows) == cfg.cache.rollouts and all(s is not None for s in starts)  # each row is one of the client's prompts...
    assert not set(starts) & trained  # ...that the round did not train on


def test_a_heldout_cache_run_with_too_few_prompts_per_client_is_refused_before_anything_is_written(tmp_path):
    from conftest import TINY_RUN

    from fedopd.config import ConfigError
    from server_app.inprocess import run_in_process

    # 8 prompts a round + 4 for the cache = 12 needed; each client holds 10.
    config = {**TINY_RUN, "strategy.name": "fedtops-heldout-cache", "data.prompts-per-client": 10, "output-dir": str(tmp_path / "runs")}
    with pytest.raises(ConfigError, match=r"partition 0 of 2 has 10 prompts; strategy.name = 'fedtops-heldout-cache' .* = 8 \+ 4 needs at least 12"):
        run_in_process(config, num_clients=2)
    assert not (tmp_path / "runs").exists()
    from server_app.app import check_data

    check_data(parse_run_config({**config, "strategy.name": "fedtops"}), 2)  # the paper's cache needs no more than the batch


def test_a_client_with_too_few_prompts_for_a_heldout_cache_fails_before_its_rollouts():
    from conftest import TINY_RUN

    from fedopd.data.prompts import Prompt
    from fedopd.engine.round import ClientModels, RoundPlan, train_round

    class NoRollouts:
        def set_adapter(self, arrays):
            pass

        def generate(self, prompts, params):
            raise AssertionError("generated rollouts for a round that cannot build its cache")

    cfg = parse_run_config(TINY_RUN)
    prompts = [Prompt(problem=f"{i}+0", answer=str(i), group="", token_ids=(1, 2, i)) for i in range(10)]  # 8 a round + 4 for the cache > 10
    with pytest.raises(ValueError, match="needs 4 prompts outside the round's 8; the client has 10"):
        train_round(
            ClientModels(None, None, NoRollouts()),
            {},
            prompts,
            RoundPlan(
                server_round=1, seed=42, rollout=cfg.rollout, cache=cfg.cache, train=cfg.train, step_offset=0, total_steps=2, cache_source="untrained"
            ),
        )
