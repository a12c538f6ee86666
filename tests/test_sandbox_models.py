"""The shipped sandbox models: a teacher that solves the task, a student that has much to learn."""

import numpy as np
import pytest

from fedopd.sandbox import MODELS_DIR

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def accuracy():
    from fedopd.sandbox.train import heldout_accuracy

    # 12 held-out problems per group (36 in all): the first of those training.json scores
    return {name: heldout_accuracy(f"builtin:sandbox-{name}", 12) for name in ("teacher", "student")}


def test_the_teacher_solves_at_least_95_percent_of_held_out_problems_greedily(accuracy):
    assert np.mean(list(accuracy["teacher"].values())) >= 95.0


def test_the_student_is_well_above_zero_and_clearly_below_the_teacher(accuracy):
    student = np.mean(list(accuracy["student"].values()))
    assert 5.0 <= student <= np.mean(list(accuracy["teacher"].values())) - 25.0


def test_they_load_like_hub_models_share_one_tokenizer_and_are_stored_as_safetensors():
    from fedopd.config import LoraSettings
    from fedopd.data import render_prompt
    from fedopd.models import load_pair

    student, teacher = load_pair("builtin:sandbox-student", "builtin:sandbox-teacher", lora=LoraSettings(), seed=0)
    assert student.tokenizer.get_vocab() == teacher.tokenizer.get_vocab()
    text = render_prompt(student.tokenizer, "Compute 1 + 2.")
    assert text.startswith("<|im_start|>user\nCompute 1 + 2.\nPlease reason step by step")
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    for name in ("sandbox-student", "sandbox-teacher"):
        assert (MODELS_DIR / name / "model.safetensors").is_file()
    assert teacher.causal_lm.config.model_type == student.causal_lm.config.model_type == "qwen3"
    assert sum(p.numel() for p in teacher.model.parameters()) > 3 * sum(p.numel() for p in student.causal_lm.parameters())


def test_the_default_run_raises_held_out_accuracy_visibly(tmp_path):
    """The README's main job (the sandbox preset: FedTOPS, 3 clients, 8 rounds) learns: the global
    adapter's held-out greedy accuracy after round 8 is at least 15 points above the initial
    adapter's (measured: 17.7 -> 47.9 %). A run that does not apply its updates, or learns nothing,
    stays at the initial accuracy."""
    from server_app.inprocess import run_in_process
    from server_app.run_folder import read_rounds

    rounds = read_rounds(run_in_process({"output-dir": str(tmp_path), "eval.every": 8}))
    assert [r["round"] for r in rounds if "evaluation" in r] == [0, 8]
    start, end = rounds[0]["evaluation"]["accuracy"], rounds[-1]["evaluation"]["accuracy"]
    assert 5.0 <= start <= 30.0  # the shipped student: well above 0, far below the teacher
    assert end >= start + 15.0


def test_regenerating_the_student_by_default_leaves_it_mid_training_at_lr_1e_3(tmp_path):
    """``python -m fedopd.sandbox.train`` defaults rebuild the shipped student's recipe: warmup, then a
    constant 1e-3 (no cooldown), recorded in training.json (2 steps here instead of 270)."""
    import json
    import shutil

    from fedopd.sandbox.train import main

    shutil.copytree(MODELS_DIR / "sandbox-teacher", tmp_path / "sandbox-teacher")  # --only needs its tokenizer
    assert main(["--only", "student", "--out", str(tmp_path), "--student-steps", "2", "--eval-problems", "1"]) == 0
    sft = json.loads((tmp_path / "training.json").read_text())["sandbox-student"]["sft"]
    assert sft["lr"] == 1e-3
    assert sft["schedule"] == "linear warmup min(50, steps/5), then constant"
    assert (tmp_path / "sandbox-student" / "model.safetensors").is_file()
