"""MATH client partition on a local file with the columns of EleutherAI/hendrycks_math."""

import json
from collections import Counter

import pytest

from fedopd.data import MATH_CLIENT_GROUPS, load_math_rows, partition_math

SUBJECTS = ["Prealgebra", "Algebra", "Number Theory", "Counting & Probability", "Intermediate Algebra", "Precalculus", "Geometry"]


def _rows():
    rows = []
    for s_index, subject in enumerate(SUBJECTS):
        for level in range(1, 6):
            for k in range(6 + 2 * level + s_index):  # unequal strata
                rows.append(
                    {
                        "problem": f"{subject} problem L{level} #{k}",
                        "level": f"Level {level}",
                        "type": subject,
                        "solution": f"Work... so the answer is $\\boxed{{{s_index}{level}{k}}}$.",
                    }
                )
    rows.append({"problem": "Algebra problem L1 #0", "level": "Level 1", "type": "Algebra", "solution": r"\boxed{999}"})  # duplicate
    rows.append({"problem": "  Algebra   problem L1 #1 ", "level": "Level 1", "type": "Algebra", "solution": r"\boxed{7}"})  # duplicate up to spaces
    rows.append({"problem": "No boxed answer", "level": "Level 2", "type": "Algebra", "solution": "The answer is 4."})
    return rows


@pytest.fixture()
def math_file(tmp_path):
    path = tmp_path / "hendrycks_math_train.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in _rows()))
    return path


def test_three_clients_by_subject_group_and_disjoint(math_file):
    clients = partition_math(load_math_rows(str(math_file)), 40, seed=42)
    assert len(clients) == 3
    for rows, group in zip(clients, MATH_CLIENT_GROUPS):
        assert len(rows) == 40
        assert {r["type"] for r in rows} <= set(group)
        assert all({"problem", "level", "type", "solution", "answer"} <= set(r) for r in rows)
    problems = [r["problem"] for rows in clients for r in rows]
    assert len(problems) == len(set(problems))
    assert not any(r["type"] == "Geometry" for rows in clients for r in rows)


def test_rows_without_boxed_answers_and_duplicates_are_dropped(math_file):
    clients = partition_math(load_math_rows(str(math_file)), 60, seed=0)
    problems = [r["problem"] for r in clients[0]]
    assert "No boxed answer" not in problems
    assert not any(r["answer"] in ("999", "7") for r in clients[0])  # the repeats, never the first copies
    by_problem = {r["problem"]: r["answer"] for r in clients[0]}
    if "Algebra problem L1 #0" in by_problem:
        assert by_problem["Algebra problem L1 #0"] == "110"  # \boxed{s_index level k} of the first copy


def test_strata_are_proportional_to_subject_and_level(math_file):
    rows = load_math_rows(str(math_file))
    clients = partition_math(rows, 40, seed=1)
    pool = [r for r in rows if r["type"] in MATH_CLIENT_GROUPS[1] and "\\boxed" in r["solution"]]
    sizes = Counter((r["type"], r["level"]) for r in pool)
    got = Counter((r["type"], r["level"]) for r in clients[1])
    total = sum(sizes.values())
    for stratum, size in sizes.items():
        assert abs(got[stratum] - 40 * size / total) < 1.0  # largest-remainder allocation
    assert sum(got.values()) == 40


def test_partition_is_deterministic_in_the_seed(math_file):
    rows = load_math_rows(str(math_file))
    assert partition_math(rows, 30, seed=42) == partition_math(rows, 30, seed=42)
    assert partition_math(rows, 30, seed=42) != partition_math(rows, 30, seed=43)


def test_too_many_prompts_per_client_is_refused(math_file):
    with pytest.raises(ValueError, match="MATH client 0 \\(Prealgebra \\+ Algebra\\) has .* fewer than data.prompts-per-client = 570"):
        partition_math(load_math_rows(str(math_file)), 570, seed=42)


def test_missing_local_data_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="data.path = '.*nowhere' does not exist"):
        load_math_rows(str(tmp_path / "nowhere"))


def test_client_partition_for_math_needs_three_partitions(math_file):
    from fedopd.config import DataSettings
    from fedopd.data import partition_rows

    data = DataSettings(name="math", prompts_per_client=20, path=str(math_file), seed=42)
    assert len(partition_rows(data, 2, 3)) == 20
    with pytest.raises(ValueError, match="3 subject-group clients; num-partitions is 4"):
        partition_rows(data, 0, 4)
