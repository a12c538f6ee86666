"""Benchmark registry and local JSONL loading (offline machines)."""

import json

import pytest

from eval.benchmarks import BENCHMARKS, PAPER_ORDER, load_benchmark, normalize_row


def test_the_six_paper_benchmarks_with_their_expected_sizes():
    assert PAPER_ORDER == ("math500", "amc23", "minerva", "olympiadbench", "aime24", "aime25")
    assert {n: b.expected for n, b in BENCHMARKS.items()} == {
        "math500": (500,),
        "amc23": (40,),
        "minerva": (272,),
        "olympiadbench": (674, 675),
        "aime24": (30,),
        "aime25": (30,),
    }
    assert sum(b.expected[0] for b in BENCHMARKS.values()) == 1546  # paper: 1,546 problems


def test_local_jsonl_files_replace_the_hub(tmp_path):
    rows = [{"problem": "p1", "answer": "1"}, {"question": "p2", "final_answer": ["2", "3"]}, {"problem": "p3", "solution": r"so \boxed{4}"}]
    (tmp_path / "aime24.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")
    assert load_benchmark("aime24", tmp_path) == [
        {"problem": "p1", "answer": "1"},
        {"problem": "p2", "answer": "2, 3"},
        {"problem": "p3", "answer": "4"},
    ]


def test_missing_file_unknown_name_and_bad_rows_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="math500.jsonl' does not exist"):
        load_benchmark("math500", tmp_path)
    with pytest.raises(ValueError, match="unknown benchmark 'gsm8k'"):
        load_benchmark("gsm8k", tmp_path)
    with pytest.raises(ValueError, match="x.jsonl:1: a row needs a problem"):
        normalize_row({"text": "?"}, "x.jsonl:1")


def test_an_unreachable_hub_benchmark_fails_fast_naming_the_offline_options(monkeypatch):
    import time

    import datasets.config
    import huggingface_hub.constants

    import eval.benchmarks as benchmarks

    monkeypatch.setattr(benchmarks, "hub_reachable", lambda timeout=3.0: False)
    # Imported before, as in a long test session: the offline switch must reach their flags too.
    for module, name in (
        (datasets.config, "HF_HUB_OFFLINE"),
        (datasets.config, "HF_DATASETS_OFFLINE"),
        (huggingface_hub.constants, "HF_HUB_OFFLINE"),
    ):
        monkeypatch.setattr(module, name, False)
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "0")
    monkeypatch.setenv("HF_DATASETS_CACHE", "/nonexistent-fedtops-test-cache")
    started = time.perf_counter()
    with pytest.raises(benchmarks.BenchmarkUnavailable) as err:
        benchmarks.load_benchmark("aime24")
    assert time.perf_counter() - started < 20  # no retry loop (datasets' own takes ~25 s)
    message = str(err.value)
    assert "'aime24'" in message and "--data-dir" in message and "--benchmark-file aime24=PATH" in message


@pytest.mark.parametrize(
    "requested, longest, positions, expected, noted",
    [
        (8192, 95, 1024, 929, True),  # the tiny models hold 1,024 positions
        (512, 95, 1024, 512, False),  # fits: unchanged
        (4096, 200, None, 4096, False),  # a model that does not say: unchanged
        (929, 95, 1024, 929, False),  # exactly full
    ],
)
def test_eval_run_caps_new_tokens_at_what_the_model_holds(requested, longest, positions, expected, noted):
    from eval.run import cap_new_tokens

    got, note = cap_new_tokens(requested, longest, positions, "m")
    assert got == expected and (note is not None) == noted
    if noted:
        assert f"--max-new-tokens {requested} exceeds what m holds ({positions} positions" in note


def test_eval_run_refuses_prompts_longer_than_the_model():
    from eval.run import cap_new_tokens

    with pytest.raises(ValueError, match="longest prompt has 2000 tokens, but m holds 1024 positions"):
        cap_new_tokens(10, 2000, 1024, "m")
