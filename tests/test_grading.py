"""Grading with math-verify on the last boxed answer; timeouts that cannot hang a run."""

import threading
import time

import pytest

from eval.grading import is_correct, last_boxed


def test_last_boxed_takes_the_last_answer_and_balances_braces():
    assert last_boxed(r"first \boxed{1} then \boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert last_boxed(r"so \boxed 7.") == "7"
    assert last_boxed(r"\fbox{3}") == "3"
    assert last_boxed("no answer here") is None
    assert last_boxed(r"\boxed{unbalanced") is None


@pytest.mark.parametrize(
    "response, gold",
    [
        (r"The answer is \boxed{0.5}.", r"\frac{1}{2}"),
        (r"So we get \boxed{\frac{3}{4}}", "0.75"),
        (r"\boxed{2\sqrt{2}}", r"\sqrt{8}"),
        (r"\boxed{\frac{\sqrt{3}}{3}}", r"\frac{1}{\sqrt{3}}"),
        (r"\boxed{(1, 2)}", "(1,2)"),
        (r"\boxed{47}", "47"),
    ],
)
def test_equivalent_answers_are_correct(response, gold):
    assert is_correct(response, gold)


@pytest.mark.parametrize(
    "response, gold",
    [
        (r"\boxed{46}", "47"),
        (r"\boxed{(2, 1)}", "(1,2)"),
        (r"First \boxed{47}, but on reflection \boxed{48}", "47"),  # the last boxed answer counts
        ("The answer is 47.", "47"),  # no boxed answer
        (r"\boxed{}", "47"),
    ],
)
def test_other_answers_are_wrong(response, gold):
    assert not is_correct(response, gold)


def test_the_last_of_several_boxed_answers_counts():
    assert is_correct(r"maybe \boxed{3}, no: \boxed{5}", "5")


def test_a_pathological_expression_times_out_as_wrong_within_the_timeout():
    assert is_correct(r"\boxed{1}", r"\frac{2}{2}")  # start the worker: start-up is not a request's cost
    start = time.monotonic()
    assert not is_correct(r"\boxed{9^{9^{9^{9}}}}", "7", timeout=2.0)
    assert time.monotonic() - start < 2.0 + 0.5
    assert is_correct(r"\boxed{0.25}", r"\frac{1}{4}")  # a fresh worker takes over


def test_grading_works_outside_the_main_thread():
    results = []
    worker = threading.Thread(target=lambda: results.append(is_correct(r"\boxed{\sqrt{8}}", r"2\sqrt{2}")))
    worker.start()
    worker.join(timeout=120)
    assert results == [True]
