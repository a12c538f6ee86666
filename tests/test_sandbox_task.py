"""The sandbox task: step-by-step solutions, shared sub-skills, and a held-out split."""

import pytest

from fedopd.data.grading import is_correct, last_boxed
from fedopd.sandbox import task


def test_addition_is_written_column_by_column_with_carries():
    # 958 + 67: 8+7=15 (write 5, carry 1), 5+6+1=12 (write 2, carry 1), 9+0+1=10 -> 1025
    assert task.addition_steps(958, 67) == ["958+67:", "8+7=15", "5+6+1=12", "9+0+1=10", "=1025"]


def test_multiplication_adds_its_partial_products_with_the_addition_steps():
    # 7 * 46 = 7*40 + 7*6 = 280 + 42, and the sum is group 1's column addition
    steps = task.multiplication_steps(7, 46)
    assert steps[:3] == ["7*46:", "7*6=42", "7*40=280"]
    assert steps[3:] == task.addition_steps(280, 42) == ["280+42:", "0+2=2", "8+4=12", "2+0+1=3", "=322"]


def test_an_expression_is_an_addition_followed_by_a_multiplication():
    assert task.expression_steps(23, 45, 7) == task.addition_steps(23, 45) + task.multiplication_steps(7, 68)


@pytest.mark.parametrize("group", task.GROUPS)
def test_every_solution_ends_in_a_boxed_answer_that_the_grader_accepts(group):
    for row in task.problems(group, 20, seed=3):
        a = row["problem"].removeprefix("Compute ").removesuffix(".")
        assert int(row["answer"]) == eval(a)  # the problem's own arithmetic
        assert row["solution"].endswith(f"\\boxed{{{row['answer']}}}")
        assert last_boxed(row["solution"]) == row["answer"]
        assert is_correct(row["solution"], row["answer"])


def test_held_out_problems_are_never_training_problems_and_are_the_same_for_every_run():
    for group in task.GROUPS:
        train = {r["problem"] for seed in (0, 1, 42) for r in task.problems(group, 200, seed)}
        heldout = [r["problem"] for r in task.client_heldout(task.GROUPS.index(group), 3, 40)]
        assert len(set(heldout)) == 40 and not train & set(heldout)
        assert all(task.is_heldout(p) for p in heldout) and not any(task.is_heldout(p) for p in train)
    assert task.client_heldout(1, 3, 10) == task.client_heldout(1, 3, 10)


def test_each_client_holds_its_own_group_and_clients_never_share_a_problem():
    parts = [task.client_partition(i, 6, 30, seed=5) for i in range(6)]
    assert [{r["group"] for r in p} for p in parts] == [{g} for g in task.GROUPS * 2]
    problems = [r["problem"] for p in parts for r in p]
    assert len(problems) == len(set(problems)) == 180
    assert task.client_partition(2, 3, 30, seed=5) != task.client_partition(2, 3, 30, seed=6)


def test_a_bad_partition_or_group_is_a_clear_error():
    with pytest.raises(ValueError, match="partition-id 3 is not in"):
        task.client_partition(3, 3, 10, seed=0)
    with pytest.raises(ValueError, match="unknown sandbox group 'division'"):
        task.problems("division", 1, seed=0)
    with pytest.raises(ValueError, match="cannot provide 1000 distinct training problems"):
        task.problems("multiplication", 1000, seed=0)  # 8 x 90 problems exist in all


def test_the_student_sft_schedule_warms_up_then_stays_constant_or_decays_to_zero():
    from fedopd.sandbox.train import lr_scale

    # warmup 4 of 10 steps: 0.25, 0.5, 0.75, 1.0, then constant 1.0 or cosine 1 -> 0 over 6 steps
    assert [lr_scale(s, 10, 4, "constant") for s in range(10)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0]
    cosine = [lr_scale(s, 10, 4, "cosine") for s in range(4, 10)]
    assert cosine == pytest.approx([1.0, 0.9330127, 0.75, 0.5, 0.25, 0.0669873])
    with pytest.raises(ValueError, match="schedule"):
        lr_scale(0, 10, 4, "linear")
