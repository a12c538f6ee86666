"""LoRA factor arithmetic in wire coordinates (paper App. 'Coordinate-level meaning for LoRA')."""

import numpy as np

from fedopd.lora import apply_increment, check_compatible, increment, weighted_mean


def _arrays(seed):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((8, 5)).astype(np.float32), rng.standard_normal((5, 8)).astype(np.float32)]


def test_apply_increment_is_theta_plus_a_delta_per_factor():
    theta, delta = _arrays(0), _arrays(1)
    out = apply_increment(theta, delta, 3.0)
    for t, d, o in zip(theta, delta, out):
        assert o.dtype == np.float32
        assert np.array_equal(o, t + np.float32(3.0) * d)
    assert all(np.array_equal(t, o) for t, o in zip(theta, apply_increment(theta, delta, 0.0)))


def test_increment_is_new_minus_old():
    a, b = _arrays(2), _arrays(3)
    assert all(np.array_equal(d, x - y) for d, x, y in zip(increment(a, b), a, b))


def test_weighted_mean_uses_normalized_weights():
    a = [np.full((2, 2), 1.0, np.float32)]
    b = [np.full((2, 2), 4.0, np.float32)]
    assert np.allclose(weighted_mean([a, b], [2, 1])[0], 2.0)
    assert np.allclose(weighted_mean([a, b], [570, 570])[0], 2.5)


def test_check_compatible_names_the_problem():
    ref = _arrays(0)
    assert check_compatible(ref, _arrays(1)) is None
    assert "1 arrays, expected 2" in check_compatible(ref, ref[:1])
    assert "shape (5, 8), expected (8, 5)" in check_compatible(ref, [ref[1], ref[1]])
    bad = [ref[0].copy(), ref[1]]
    bad[0][0, 0] = np.nan
    assert "non-finite" in check_compatible(ref, bad)
