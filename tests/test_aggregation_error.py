"""The aggregation error of averaging LoRA factors separately (fedopd.models.lora.aggregation_errors),
checked against explicit d_out × d_in products and hand calculations, and as the strategies
record it every round."""

import math
from fractions import Fraction

import numpy as np
import pytest
from flwr.app import ConfigRecord

from fedopd.models.lora import aggregation_errors, lora_modules, product_gram
from fedtops_strategy import FedTOPS, FixedMultiplier, LoRAFedAvg
from fedtops_strategy.references import Centralized, LocalTraining

pytestmark = pytest.mark.usefixtures("task_identity")


def _scalar(b, a):
    """A one-module adapter with 1 × 1 factors: B A = b · a."""
    return {"m.lora_A.weight": np.array([[a]], np.float32), "m.lora_B.weight": np.array([[b]], np.float32)}


def test_two_scalar_clients_by_hand():
    # θ_t = (0, 0); clients (B, A) = (2, 2) and (0, 0), equal weights.
    # mean of products 0.5·4 + 0.5·0 = 2; product of means 1·1 = 1; update 2 − 0 = 2: error 1/2.
    theta, clients = _scalar(0, 0), [_scalar(2, 2), _scalar(0, 0)]
    # a = 2: factors (2, 2), product 4 = the target 0 + 2·2: no error.
    assert aggregation_errors(theta, clients, [1, 1], 2.0) == {"mean": 0.5, "applied": 0.0}
    # a = 3: product 9, target 6: |6 − 9| / |3 · 2| = 1/2.
    assert aggregation_errors(theta, clients, [1, 1], 3.0) == {"mean": 0.5, "applied": 0.5}
    # weights 3:1: mean of products 3; product of means 1.5 · 1.5 = 2.25: |3 − 2.25| / 3 = 1/4
    assert aggregation_errors(theta, clients, [3, 1])["mean"] == pytest.approx(0.25, rel=1e-12)


def _random_adapter(rng, shapes, scale=1.0):
    out = {}
    for name, (r, d_in, d_out) in shapes.items():
        out[f"{name}.lora_A.weight"] = (scale * rng.standard_normal((r, d_in))).astype(np.float32)
        out[f"{name}.lora_B.weight"] = (scale * rng.standard_normal((d_out, r))).astype(np.float32)
    return out


def _explicit(theta, clients, weights, a):
    """The definition with the products formed, in float64; the applied factors B_t + a(B̄ − B_t),
    A_t + a(Ā − A_t)."""
    w = np.asarray(weights, float) / np.sum(weights)
    err = chg = tgt = 0.0
    for a_name, b_name in lora_modules(list(theta)):
        prod = lambda f: np.asarray(f[b_name], float) @ np.asarray(f[a_name], float)  # noqa: E731
        mean_of_products = sum(wi * prod(c) for wi, c in zip(w, clients))
        b_bar = sum(wi * np.asarray(c[b_name], float) for wi, c in zip(w, clients))
        a_bar = sum(wi * np.asarray(c[a_name], float) for wi, c in zip(w, clients))
        b_t, a_t = np.asarray(theta[b_name], float), np.asarray(theta[a_name], float)
        applied = (b_t + a * (b_bar - b_t)) @ (a_t + a * (a_bar - a_t))
        err += np.sum((mean_of_products - b_bar @ a_bar) ** 2)
        chg += np.sum((mean_of_products - prod(theta)) ** 2)
        tgt += np.sum((prod(theta) + a * (mean_of_products - prod(theta)) - applied) ** 2)
    return np.sqrt(err / chg), np.sqrt(tgt / (a * a * chg))


def test_the_gram_computation_equals_the_explicit_products_over_several_modules():
    rng = np.random.default_rng(0)
    shapes = {"q": (4, 7, 5), "v": (2, 6, 9), "o": (4, 5, 3)}  # rank, d_in, d_out per module
    theta = _random_adapter(rng, shapes)
    clients = [{k: v + _random_adapter(rng, shapes, 0.3)[k] for k, v in theta.items()} for _ in range(3)]
    weights, a = [5.0, 1.0, 2.5], 2.7
    got = aggregation_errors(theta, clients, weights, a)
    mean, app = _explicit(theta, clients, weights, a)
    # Both in float64 from the same fp32 inputs; here the errors are within ~10× of ‖BA‖, so even
    # the explicit route's subtraction of products keeps ~1e-14 relative: 1e-9 is loose.
    assert got["mean"] == pytest.approx(mean, rel=1e-9) and got["applied"] == pytest.approx(app, rel=1e-9)
    assert 0.01 < got["mean"] < 1.0 and got["applied"] != pytest.approx(got["mean"], rel=0.01)  # non-trivial


def _exact(theta, clients, weights, a):
    """The definition in exact rational arithmetic on the fp32 inputs (small matrices only)."""
    w = [Fraction(x) / sum(map(Fraction, weights)) for x in weights]
    a = Fraction(a)

    def mat(x):
        return [[Fraction(float(v)) for v in row] for row in np.asarray(x)]

    def mul(x, y):
        return [[sum(x[i][k] * y[k][j] for k in range(len(y))) for j in range(len(y[0]))] for i in range(len(x))]

    def lin(*pairs):  # Σ c · X
        return [[sum(c * x[i][j] for c, x in pairs) for j in range(len(pairs[0][1][0]))] for i in range(len(pairs[0][1]))]

    def sq(x):
        return sum(v * v for row in x for v in row)

    err = chg = tgt = Fraction(0)
    for a_name, b_name in lora_modules(list(theta)):
        b_t, a_t = mat(theta[b_name]), mat(theta[a_name])
        bs, as_ = [mat(c[b_name]) for c in clients], [mat(c[a_name]) for c in clients]
        b_bar, a_bar = lin(*zip(w, bs)), lin(*zip(w, as_))
        mean_of_products = lin(*zip(w, [mul(b, x) for b, x in zip(bs, as_)]))
        p_t = mul(b_t, a_t)
        applied = mul(lin((1 - a, b_t), (a, b_bar)), lin((1 - a, a_t), (a, a_bar)))
        err += sq(lin((1, mean_of_products), (-1, mul(b_bar, a_bar))))
        chg += sq(lin((1, mean_of_products), (-1, p_t)))
        tgt += sq(lin((1 - a, p_t), (a, mean_of_products), (-1, applied)))
    return math.sqrt(err / chg), math.sqrt(tgt / (a * a * chg))


def test_a_small_update_next_to_a_large_adapter_keeps_float64_precision():
    # Late in a run the clients move θ_t by ~1e-3 of its size and the error is second order
    # (~1e-6 of ‖BA‖): a Gram of the products themselves would cancel terms of size ‖BA‖² to get
    # ~1e-12 of them and keep only ~4 digits. The reference is exact rational arithmetic.
    rng = np.random.default_rng(2)
    shapes = {"q": (2, 3, 4), "v": (3, 2, 2)}
    theta = _random_adapter(rng, shapes)
    clients = [{k: (v + _random_adapter(rng, shapes, 1e-3)[k]).astype(np.float32) for k, v in theta.items()} for _ in range(3)]
    weights, a = [1.0, 2.0, 4.0], 3.0
    got = aggregation_errors(theta, clients, weights, a)
    mean, app = _exact(theta, clients, weights, a)
    assert 1e-5 < mean < 1e-2  # second order in the update
    # float64 on terms of the errors' own size: ~1e-15 relative, times a few dozen operations
    assert got["mean"] == pytest.approx(mean, rel=1e-12) and got["applied"] == pytest.approx(app, rel=1e-12)


def test_clients_that_share_their_a_factors_average_without_error():
    rng = np.random.default_rng(1)
    shapes = {"q": (3, 4, 5)}
    theta = _random_adapter(rng, shapes)
    clients = [dict(theta, **{"q.lora_B.weight": rng.standard_normal((5, 3)).astype(np.float32)}) for _ in range(3)]
    # Σ w_i B_i A = B̄ A exactly: only the rounding of float64 sums remains
    assert aggregation_errors(theta, clients, [1, 2, 3])["mean"] < 1e-7


def test_no_update_and_a_hold_have_no_error_to_report():
    theta = _scalar(1, 1)
    assert aggregation_errors(theta, [theta, theta], [1, 1]) == {"mean": None, "applied": None}
    moved = [_scalar(2, 2), _scalar(0, 0)]
    assert aggregation_errors(theta, moved, [1, 1], 0.0)["applied"] is None


def test_factors_that_are_not_lora_pairs_are_refused():
    with pytest.raises(ValueError, match="no B factor"):
        lora_modules(["m.lora_A.weight"])
    with pytest.raises(ValueError, match="not LoRA factors"):
        product_gram([{"m.lora_A.weight": np.ones((2, 3)), "m.lora_B.weight": np.ones((3,))}])
    with pytest.raises(ValueError, match="positive"):
        aggregation_errors(_scalar(0, 0), [_scalar(1, 1)], [0.0])


# ------------------------------------------------------------------------------------------------
# As the strategies record it
# ------------------------------------------------------------------------------------------------

from tests.test_strategies import FakeGrid  # noqa: E402 - the same hand-made Grid

THETA = _scalar(0.0, 0.0)
UPDATES = {1: _scalar(2.0, 2.0), 2: _scalar(0.0, 0.0)}


def _round(strategy, scores=None):
    from flwr.app import Array, ArrayRecord

    from fedtops_strategy.round import play_round

    grid = FakeGrid({n: list(u.values()) for n, u in UPDATES.items()}, {1: 10, 2: 10}, scores=scores)
    import tests.test_strategies as ts

    keys, ts.KEYS = ts.KEYS, list(THETA)  # the fake replies carry this test's factor names
    try:
        arrays = ArrayRecord({k: Array(v) for k, v in THETA.items()})
        return play_round(strategy, grid, 1, arrays, ConfigRecord(), train_timeout=None, score_timeout=None).to_record()
    finally:
        ts.KEYS = keys


def _common():
    return {"min_available_nodes": 2, "min_train_nodes": 2}


def test_fedavg_and_a_fixed_multiplier_record_the_error_of_the_update_they_apply():
    record = _round(LoRAFedAvg(**_common()))
    assert (record["aggregation-error"], record["aggregation-error-applied"]) == (0.5, 0.5)  # a = 1: applied = mean
    record = _round(FixedMultiplier(3.0, **_common()))
    assert (record["aggregation-error"], record["aggregation-error-applied"]) == (0.5, 0.5)  # by hand above


def test_fedtops_records_the_error_at_the_multiplier_it_selected():
    # a = 2 has the lowest teacher score and every candidate is feasible: product (2·2) = target
    scores = {n: ([0.3, 0.1, 0.2], [0.0, 0.0, 0.0]) for n in UPDATES}
    record = _round(FedTOPS(candidates=(1.0, 2.0, 3.0), trust_budget=1.0, **_common()), scores)
    assert record["multiplier"] == 2.0
    assert (record["aggregation-error"], record["aggregation-error-applied"]) == (0.5, 0.0)


def test_local_and_centralized_average_nothing_and_record_no_error():
    assert "aggregation-error" not in _round(LocalTraining(**_common()))
    assert "aggregation-error" not in _round(Centralized(**_common()))
