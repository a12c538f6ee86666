"""Rollout grading: the last boxed answer, checked with math-verify from any thread."""

import threading
import time

from fedopd.grading import is_correct, last_boxed


def test_last_boxed_takes_the_last_answer_and_balances_braces():
    assert last_boxed(r"first \boxed{1} then \boxed{\frac{1}{2}}") == r"\frac{1}{2}"
    assert last_boxed(r"so \boxed 7.") == "7"
    assert last_boxed("no answer here") is None
    assert last_boxed(r"\boxed{unbalanced") is None


def test_equivalent_answers_are_correct_and_others_are_not():
    assert is_correct(r"The answer is \boxed{0.5}", r"\frac{1}{2}")
    assert is_correct(r"\boxed{47}", "47")
    assert not is_correct(r"\boxed{46}", "47")
    assert not is_correct("47", "47")  # no boxed answer


def test_grading_works_outside_the_main_thread():
    results = []
    worker = threading.Thread(target=lambda: results.append(is_correct(r"\boxed{\sqrt{8}}", r"2\sqrt{2}")))
    start = time.monotonic()
    worker.start()
    worker.join(timeout=60)
    assert results == [True]
    assert time.monotonic() - start < 60
