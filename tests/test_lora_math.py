"""LoRA factor arithmetic in wire coordinates (paper App. 'Coordinate-level meaning for LoRA')."""

import numpy as np
import pytest

from fedopd.models.lora import apply_increment, check_compatible, from_record, increment


def _arrays(seed):
    rng = np.random.default_rng(seed)
    return {
        "l.lora_A.weight": rng.standard_normal((8, 5)).astype(np.float32),
        "l.lora_B.weight": rng.standard_normal((5, 8)).astype(np.float32),
    }


def test_apply_increment_is_theta_plus_a_delta_per_named_factor():
    theta = {"a": np.array([1.0, 2.0], np.float32), "b": np.array([[0.5]], np.float32)}
    delta = {"b": np.array([[0.25]], np.float32), "a": np.array([-1.0, 0.5], np.float32)}  # other order
    out = apply_increment(theta, delta, 3.0)
    assert list(out) == ["a", "b"]
    assert out["a"].tolist() == [-2.0, 3.5] and out["b"].tolist() == [[1.25]]
    assert all(o.dtype == np.float32 for o in out.values())
    assert all(np.array_equal(theta[n], o) for n, o in apply_increment(theta, delta, 0.0).items())


def test_increment_is_new_minus_old_by_name():
    old = {"a": np.array([1.0], np.float32), "b": np.array([4.0], np.float32)}
    new = {"b": np.array([1.0], np.float32), "a": np.array([3.0], np.float32)}
    d = increment(new, old)
    assert d["a"].tolist() == [2.0] and d["b"].tolist() == [-3.0]


def test_arithmetic_on_mismatched_names_is_refused():
    with pytest.raises(ValueError, match="factor 'b' is missing"):
        increment({"a": np.zeros(1)}, {"a": np.zeros(1), "b": np.zeros(1)})
    with pytest.raises(ValueError, match="factor 'c' is not in the adapter"):
        apply_increment({"a": np.zeros(1)}, {"a": np.zeros(1), "c": np.zeros(1)}, 1.0)


def test_check_compatible_names_the_problem():
    ref = _arrays(0)
    assert check_compatible(ref, _arrays(1)) is None
    assert "factor 'l.lora_B.weight' is missing" in check_compatible(ref, {"l.lora_A.weight": ref["l.lora_A.weight"]})
    swapped = {"l.lora_A.weight": ref["l.lora_B.weight"], "l.lora_B.weight": ref["l.lora_A.weight"]}
    assert "factor 'l.lora_A.weight' has shape (5, 8), expected (8, 5)" in check_compatible(ref, swapped)
    bad = {k: v.copy() for k, v in ref.items()}
    bad["l.lora_B.weight"][0, 0] = np.nan
    assert "factor 'l.lora_B.weight' has non-finite values" in check_compatible(ref, bad)


def test_from_record_keeps_names_and_order():
    from flwr.app import Array, ArrayRecord

    record = ArrayRecord({"z": Array(np.ones(2, np.float32)), "a": Array(np.zeros(3, np.float32))})
    named = from_record(record)
    assert list(named) == ["z", "a"] and named["z"].tolist() == [1.0, 1.0]
