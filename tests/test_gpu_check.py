"""The prepared GPU check (benchmarks/gpu_check.py): its FLOP counts against hand calculations and
the Qwen3 model cards, the card peaks, the cap it fits to a budget, the test report it reads, and its
CPU dry run (``--tiny``), which hides what the lent machines' image lacks."""

import dataclasses
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.gpu_check import (  # noqa: E402
    IMAGE_LACKS,
    Arch,
    attention_flops,
    child_env,
    choose_cap,
    dense_flops,
    gpu_test_files,
    junit_cases,
    local_opd_flops,
    peak_tflops,
    teacher_pass_flops,
)

# hidden 2, 1 layer, 1 head of width 2 (q, k, v, o: 2 x 2 each), ffn 3 (gate, up, down: 2 x 3 each), vocab 5
TOY = Arch(hidden=2, layers=1, heads=1, kv_heads=1, head_dim=2, ffn=3, vocab=5)


def test_a_layers_matmul_weights_are_its_projections_and_mlp():
    assert TOY.layer_params == 4 * (2 * 2) + 3 * (2 * 3)  # 34


def test_the_layer_weights_give_the_qwen3_model_cards_non_embedding_parameters():
    # Qwen's model cards: Qwen3-0.6B 0.44B and Qwen3-8B 6.95B non-embedding parameters (norms aside).
    small = Arch(hidden=1024, layers=28, heads=16, kv_heads=8, head_dim=128, ffn=3072, vocab=151936)
    large = Arch(hidden=4096, layers=36, heads=32, kv_heads=8, head_dim=128, ffn=12288, vocab=151936)
    assert small.layers * small.layer_params == 440_401_920
    assert large.layers * large.layer_params == 6_945_767_424


def test_dense_flops_are_two_per_weight_and_token_in_every_layer():
    assert dense_flops(TOY, 10) == 2 * 34 * 10
    assert dense_flops(dataclasses.replace(TOY, layers=3), 10) == 3 * 2 * 34 * 10


def test_causal_attention_flops_sum_the_positions_each_query_attends_to():
    # queries 1, 2, 3 attend to 1, 2, 3 positions; QK^T and AV each 2 * width(2) per position
    assert attention_flops(TOY, 3) == sum(2 * 2 * 2 * i for i in (1, 2, 3))
    assert attention_flops(dataclasses.replace(TOY, layers=3, heads=2), 3) == 3 * 2 * 48


def test_the_teacher_pass_is_one_forward_per_rollout_without_the_head():
    assert teacher_pass_flops(TOY, 4, 3) == 4 * (2 * 34 * 3 + 48)


def test_local_opd_counts_the_students_forward_its_input_backward_and_both_heads():
    teacher = Arch(hidden=4, layers=1, heads=1, kv_heads=1, head_dim=2, ffn=3, vocab=5)
    # per rollout of 3 tokens: forward 204 + 48, backward 204 + 2 * 48; 2 response positions:
    # student head forward and backward 2 * (2 * 5 * 2), teacher head forward 2 * 5 * 4
    expected = 2 * ((204 + 48) + (204 + 96)) + 2 * (2 * (2 * 5 * 2) + 2 * 5 * 4)
    assert local_opd_flops(TOY, teacher, 2, 3, 2) == expected


@pytest.mark.parametrize(
    ("name", "peak"),
    [
        ("NVIDIA H100 80GB HBM3", 989.0),
        ("NVIDIA H100 PCIe", 756.0),
        ("NVIDIA H100 NVL", 835.0),
        ("NVIDIA H200", 989.0),
        ("NVIDIA A100-SXM4-80GB", 312.0),
        ("Tesla T4", None),
    ],
)
def test_the_cards_dense_bf16_peak_comes_from_its_name(name, peak):
    assert peak_tflops(name) == peak


def test_the_cap_is_the_largest_halving_predicted_to_fit():
    # warm-up at 32 tokens: 1 s of generation, 2 s of the rest at prompt 96 + 32 = 128 tokens.
    # cap c: c / 32 s + 2 * (96 + c) / 128 s; 4096: 128 + 65.5 = 193.5; 2048: 64 + 33.5 = 97.5
    assert choose_cap(4096, 32, 96, 1.0, 2.0, 200.0) == (4096, 193.5)
    assert choose_cap(4096, 32, 96, 1.0, 2.0, 150.0) == (2048, 97.5)
    assert choose_cap(4096, 32, 96, 1.0, 2.0, 1.0) == (32, 3.0)  # nothing fits: the warm-up's cap
    assert choose_cap(16, 16, 96, 1.0, 2.0, 1.0)[0] == 16


def test_the_junit_report_gives_each_tests_outcome_and_reason():
    xml = """<testsuites><testsuite name="pytest">
      <testcase classname="tests.test_a" name="test_ok[cuda-bf16]" time="1.5"/>
      <testcase classname="tests.test_a" name="test_skip" time="0"><skipped message="no CUDA device on this machine">x</skipped></testcase>
      <testcase classname="tests.test_b" name="test_bad" time="0.25"><failure message="assert 1 == 2&#10;more">trace</failure></testcase>
      <testcase classname="tests.test_b" name="test_err" time="0"><error message="fixture failed">trace</error></testcase>
    </testsuite></testsuites>"""
    assert junit_cases(xml) == [
        {"test": "tests/test_a.py::test_ok[cuda-bf16]", "outcome": "passed", "seconds": 1.5, "reason": ""},
        {"test": "tests/test_a.py::test_skip", "outcome": "skipped", "seconds": 0.0, "reason": "no CUDA device on this machine"},
        {"test": "tests/test_b.py::test_bad", "outcome": "failed", "seconds": 0.25, "reason": "assert 1 == 2"},
        {"test": "tests/test_b.py::test_err", "outcome": "error", "seconds": 0.0, "reason": "fixture failed"},
    ]


def test_the_checks_test_files_are_the_files_pytest_collects_gpu_tests_from():
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-m", "gpu", "--collect-only", "-q", "-o", "addopts=", "-p", "no:cacheprovider", "tests"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    )
    collected = sorted({line.partition("::")[0] for line in done.stdout.splitlines() if "::" in line})
    assert collected and gpu_test_files(ROOT / "tests") == collected


def test_the_engine_the_run_config_and_preflight_import_without_what_the_image_lacks(tmp_path):
    code = (
        "import importlib.util, sys\n"
        "assert importlib.util.find_spec('flwr') is None and importlib.util.find_spec('torch') is not None\n"
        "import fedopd.config, fedopd.preflight, fedopd.engine.round, fedopd.distill.cache, fedopd.rollout\n"
        "cfg = fedopd.config.parse_run_config({'strategy.name': 'fedtops', 'rollout.backend': 'hf'})\n"
        "assert cfg.strategy.name == 'fedtops'\n"
        "print(sorted({m.partition('.')[0] for m in sys.modules} & set(sys.argv[1:])))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, *IMAGE_LACKS, "fedtops_strategy"],
        env=child_env(IMAGE_LACKS, tmp_path),
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]"


# As `python3 benchmarks/gpu_check.py` starts on the lent image, where the project is not installed:
# only the script's folder on sys.path (here the editable install would put the root there too).
AS_ON_THE_IMAGE = """import runpy, sys
root, script = sys.argv[1], sys.argv[2]
sys.path[:] = [p for p in sys.path if p not in ("", root)]
sys.path.insert(0, root + "/benchmarks")
sys.argv = sys.argv[2:]
runpy.run_path(script, run_name="__main__")
"""


@pytest.mark.slow
def test_the_cpu_dry_run_writes_the_report_of_every_part(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", AS_ON_THE_IMAGE, str(ROOT), str(ROOT / "benchmarks" / "gpu_check.py"), str(tmp_path), "--tiny", "--commit", "abc1234"],
        cwd=tmp_path,
        env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"},
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    result = json.loads((tmp_path / "gpu_check.json").read_text())
    assert result["commit"] == "abc1234" and result["tiny"] and result["errors"] == {}
    assert result["hidden_packages"] == list(IMAGE_LACKS)
    tests = result["tests"]
    assert tests["returncode"] == 0 and tests["passed"] > 0 and tests["failed"] == tests["error"] == 0
    assert all(c["reason"] for c in tests["cases"] if c["outcome"] == "skipped")
    assert {c["test"] for c in tests["cases"] if "[cuda-bf16]" in c["test"]} <= {c["test"] for c in tests["cases"] if c["outcome"] == "skipped"}
    r = result["round"]
    assert r["settings"]["cap"] == r["settings"]["cap_requested"] == 16 and r["settings"]["rollouts"] == 8
    assert r["settings"]["candidates"] == [0.5, 1.0, 2.0, 3.0, 5.0, 10.0]  # the paper preset's
    assert r["cap_hit_rate"] == 1.0 and len(r["scores"]["J"]) == 6
    assert set(r["seconds"]) == {"rollout_s", "grade_s", "teacher_s", "cache_s", "opd_s", "score_s", "round_s"}
    assert r["memory_plan"]["peak_gib"] > 0 and r["mfu"] == {"teacher_pass": None, "local_opd": None}  # no card, no peak
    rows = result["loss"]["rows"]
    assert [(row["positions"], row["case"]) for row in rows] == [(64, "app"), (64, "unchunked"), (256, "app"), (256, "unchunked")]
    for app, full in zip(rows[::2], rows[1::2]):  # the chunked loss is the full one, summed in another order
        # fp32 sums of P positions' KLs in two orders differ by at most about P float32 epsilons
        assert app["loss_per_token"] == pytest.approx(full["loss_per_token"], rel=app["positions"] * 2**-23)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu_check.json", "gpu_check.md"]  # nothing partial left
    page = (tmp_path / "gpu_check.md").read_text()
    assert "## GPU tests" in page and "## One client round" in page and "## The reverse-KL loss" in page


def test_a_cut_off_pytest_run_gives_what_it_printed_and_the_test_it_was_in():
    output = (
        "tests/test_a.py::test_one[cuda-bf16] PASSED                 [ 10%]\n"
        "tests/test_a.py::test_two SKIPPED (no CUDA device)          [ 20%]\n"
        "tests/test_b.py::test_three FAILED                          [ 30%]\n"
        "tests/test_b.py::test_hangs "
    )
    from benchmarks.gpu_check import running_test, verbose_cases

    assert [(c["test"], c["outcome"]) for c in verbose_cases(output)] == [
        ("tests/test_a.py::test_one[cuda-bf16]", "passed"),
        ("tests/test_a.py::test_two", "skipped"),
        ("tests/test_b.py::test_three", "failed"),
    ]
    assert running_test(output) == "tests/test_b.py::test_hangs"
    assert running_test(output.rsplit("\n", 1)[0]) is None  # ended on an outcome: nothing was running


def test_the_caps_reason_says_whether_it_was_asked_for_fitted_or_nothing_fit():
    from benchmarks.gpu_check import cap_reason

    assert cap_reason(4096, 4096, 190.0, 200.0).startswith("the requested cap (predicted 190 s of the 200 s left)")
    assert cap_reason(2048, 4096, 97.5, 150.0).startswith("the largest halving of 4096 predicted to fit the 150 s left")
    assert cap_reason(32, 4096, 3.0, 1.0).startswith("no cap was predicted to fit the 1 s left")


def test_a_child_past_its_deadline_is_ended_with_everything_it_started(tmp_path):
    from benchmarks.gpu_check import run_child

    marker = tmp_path / "grandchild-ran-on"
    # the child starts a grandchild that would write the marker after 3 s, then waits
    grandchild = f"import time; time.sleep(3); open({str(marker)!r}, 'w')"
    script = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {grandchild!r}]); time.sleep(60)"
    started = time.monotonic()
    returncode, _, _ = run_child([sys.executable, "-c", script], dict(os.environ), 1.0)
    assert returncode is None and time.monotonic() - started < 10
    time.sleep(4)
    assert not marker.exists()  # the grandchild was killed with the child's process group


def test_a_check_stopped_by_sigterm_ends_its_children(tmp_path):
    marker = tmp_path / "child-ran-on"
    child = f"import time; time.sleep(3); open({str(marker)!r}, 'w')"
    parent = (
        f"import sys, signal, os; sys.path.insert(0, {str(ROOT)!r}); from benchmarks.gpu_check import run_child, _stop; "
        f"signal.signal(signal.SIGTERM, _stop); run_child([sys.executable, '-c', {child!r}], dict(os.environ), 60)"
    )
    proc = subprocess.Popen([sys.executable, "-c", parent])
    time.sleep(1.5)  # the child has started
    proc.terminate()
    proc.wait(timeout=10)
    time.sleep(3)
    assert not marker.exists()
