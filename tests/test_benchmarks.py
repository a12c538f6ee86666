"""Benchmark registry and local JSONL loading (offline machines)."""

import json

import pytest

from eval.benchmarks import BENCHMARKS, PAPER_ORDER, load_benchmark, normalize_row


def test_the_six_paper_benchmarks_with_their_expected_sizes():
    assert PAPER_ORDER == ("math500", "amc23", "minerva", "olympiadbench", "aime24", "aime25")
    assert {n: b.expected for n, b in BENCHMARKS.items()} == {
        "math500": (500,), "amc23": (40,), "minerva": (272,), "olympiadbench": (674, 675), "aime24": (30,), "aime25": (30,),
    }
    assert sum(b.expected[0] for b in BENCHMARKS.values()) == 1546  # paper: 1,546 problems


def test_local_jsonl_files_replace_the_hub(tmp_path):
    rows = [{"problem": "p1", "answer": "1"}, {"question": "p2", "final_answer": ["2", "3"]}, {"problem": "p3", "solution": r"so \boxed{4}"}]
    (tmp_path / "aime24.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    assert load_benchmark("aime24", tmp_path) == [
        {"problem": "p1", "answer": "1"}, {"problem": "p2", "answer": "2, 3"}, {"problem": "p3", "answer": "4"},
    ]


def test_missing_file_unknown_name_and_bad_rows_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="math500.jsonl' does not exist"):
        load_benchmark("math500", tmp_path)
    with pytest.raises(ValueError, match="unknown benchmark 'gsm8k'"):
        load_benchmark("gsm8k", tmp_path)
    with pytest.raises(ValueError, match="x.jsonl:1: a row needs a problem"):
        normalize_row({"text": "?"}, "x.jsonl:1")
