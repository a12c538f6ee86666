"""The rollout-source intervention: rollouts come from the source, training starts from θ."""

import dataclasses
import json

import numpy as np
import pytest
from conftest import TINY
from precision import U32, coarse_kl_pair_error, logit_error, lse_error

from fedopd.config import parse_run_config
from fedopd.data import encode_prompts, tiny_arith_partition
from fedopd.engine.round import ClientModels, RoundPlan, train_round
from fedopd.rollout import HFRolloutEngine

pytestmark = pytest.mark.slow


class SpyEngine(HFRolloutEngine):
    """Records the student's LoRA factors at the moment rollouts are generated."""

    def generate(self, prompts, params):
        self.used = self.student.get_lora_arrays()
        return super().generate(prompts, params)


def test_rollouts_come_from_the_source_and_training_starts_from_theta(tiny_pair):
    student, teacher = tiny_pair
    engine = SpyEngine(student)
    models = ClientModels(student, teacher, engine)
    cfg = parse_run_config(TINY)
    theta = student.get_lora_arrays()
    source = {k: v + 0.5 for k, v in theta.items()}
    prompts = encode_prompts(student.tokenizer, tiny_arith_partition(0, 3, 8, 1), 2048)
    plan = RoundPlan(
        server_round=1,
        seed=0,
        rollout=dataclasses.replace(cfg.rollout, per_round=4, max_new_tokens=6),
        cache=cfg.cache,
        train=dataclasses.replace(cfg.train, lr=1e-9, mini_batch=4, micro_batch=4),
        step_offset=0,
        total_steps=1,
        build_cache=False,
    )
    out = train_round(models, theta, prompts, plan, source=source)
    assert all(np.array_equal(engine.used[k], source[k]) for k in theta)  # fp32 factors are copied bit-exactly
    # One AdamW step at lr = 1e-9 from θ, not from the source (0.5 away): the first Adam step is
    # lr·m̂/(√v̂ + eps) with |m̂/√v̂| ≤ 1 (≤ 1 + 8u as computed in fp32), the decoupled decay
    # lr·wd·|θ|, and the fp32 result is rounded twice (decay, update): ≤ 2u·|θ| more.
    lr, wd = 1e-9, cfg.train.weight_decay
    assert out.metrics["steps"] == 1
    bound = {k: lr * (1 + 8 * U32) * (1 + wd * np.abs(t)) + 2 * U32 * np.abs(t) for k, t in theta.items()}
    assert all(np.all(np.abs(out.arrays[k] - theta[k]) <= bound[k]) for k in theta)
    assert out.cache is None and "cache_teacher_score" not in out.metrics


def test_source_swap_runs_on_a_run_folder_and_reports_paired_differences(tmp_path):
    from client_app.app import app
    from eval.source_swap import main
    from server_app.app import run_server
    from server_app.inprocess import InProcessGrid, task_identity

    cfg = parse_run_config(
        {
            **TINY,
            "data.name": "sandbox",
            "strategy.name": "fixed",
            "strategy.multiplier": 2.0,
            "num-server-rounds": 2,
            "data.prompts-per-client": 8,
            "rollout.per-round": 4,
            "rollout.max-new-tokens": 8,
            "train.mini-batch": 4,
            "eval.every": 0,
            "eval.prompts-per-client": 3,
            "eval.samples": 2,
            "eval.max-new-tokens": 6,
            "output-dir": str(tmp_path),
        }
    )
    with task_identity():
        run = run_server(InProcessGrid(app, cfg.to_run_config(), 3), cfg)
    assert main([str(run), "--round", "2", "--receiver-rounds", "1", "--bootstrap", "100", "--out", str(tmp_path / "swap")]) == 0
    result = json.loads((tmp_path / "swap" / "source_swap.json").read_text())
    assert list(result["models"]) == ["start", "source a=1", "source a=3"] and result["questions"] == 9
    assert {(d["model"], d["minus"]) for d in result["differences"]} >= {("source a=3", "source a=1")}
    assert (tmp_path / "swap" / "receiver-a3" / "adapter_model.safetensors").is_file()
    # how far the sources are apart: from θ_1 to φ_1 and φ_3, and from φ_1 to φ_3, per client
    to_sources, between = result["source_distance"]
    assert (to_sources["reference"], to_sources["multipliers"], between["reference"], between["multipliers"]) == (0.0, [1.0, 3.0], 1.0, [3.0])
    assert len(between["per_client"]) == 3 and between["max"][0] == max(k[0] for k in between["per_client"]) > 0
    assert main([str(run), "--round", "5"]) == 1  # a round the run does not have


def test_a_source_is_at_distance_zero_from_itself(tmp_path):
    from client_app.app import app
    from eval.source_swap import recover_increment, source_distance
    from fedopd.models.lora import load_adapter
    from server_app.app import run_server
    from server_app.inprocess import InProcessGrid, task_identity

    cfg = parse_run_config(
        {
            **TINY,
            "data.name": "sandbox",
            "strategy.name": "fedavg",
            "num-server-rounds": 1,
            "data.prompts-per-client": 8,
            "rollout.per-round": 4,
            "rollout.max-new-tokens": 8,
            "train.mini-batch": 4,
            "eval.every": 0,
            "output-dir": str(tmp_path),
        }
    )
    with task_identity():
        run = run_server(InProcessGrid(app, cfg.to_run_config(), 3), cfg)
        theta = load_adapter(run / "round-000")
        delta = recover_increment(theta, load_adapter(run / "round-001"), 1.0)
        found = source_distance(cfg, theta, delta, 1.0, [1.0, 3.0], 0, 3)
        from client_app.worker import setup

        student = setup(cfg, 0, 3)[0].student
    # KL(π̃ ‖ π̃) = 0 exactly, but the candidate's forward is stacked and the cache's is not: two fp32
    # forwards of the same adapter differ by the rounding of the logits and of their logsumexp,
    # |K̂ − 0| ≤ coarse_kl_pair_error(0, δ, ε) (tests/precision.py)
    bound = coarse_kl_pair_error(0.0, logit_error(student, 64), lse_error(student))
    assert max(k[0] for k in found["per_client"]) <= bound < 1e-3 and found["max"][1] > 10 * bound
