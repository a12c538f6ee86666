"""The server optimizers (FedAvgM, FedAdam, FedYogi, FedAdagrad, FedExP) driven by hand-made
replies through the strategies' own rounds: each update rule against its published formula,
written out here, and against Flower's own strategy on the same replies; FedExP's step size by
hand; the step's geometry; what each rule composes with."""

import math

import numpy as np
import pytest
from flwr.app import MetricRecord, RecordDict
from flwr.serverapp.strategy import FedAdagrad, FedAdam, FedAvgM, FedYogi
from test_strategies import KEYS, THETA, FakeGrid, _common, _record, _run, message

from fedopd.config import ConfigError, StrategySettings, parse_run_config
from fedopd.core.settings import PrivacySettings
from fedtops_strategy import make_strategy
from fedtops_strategy.fedexp import FedExP, fedexp_step_size
from fedtops_strategy.round import step_geometry

pytestmark = pytest.mark.usefixtures("task_identity")

# Two clients whose replies are the same absolute adapters every round, weights 1 and 3: round t's
# average is MEAN, and Δ_t = MEAN − θ_t.
UPDATES = {1: [np.full((2, 3), 1.0), np.full((3,), 0.0)], 2: [np.array([[2.0, 0.0, 1.0], [0.5, 3.0, -1.0]]), np.array([1.0, -2.0, 0.5])]}
WEIGHTS = {1: 1, 2: 3}
MEAN = [(1 * np.asarray(UPDATES[1][i], np.float64) + 3 * np.asarray(UPDATES[2][i], np.float64)) / 4 for i in range(2)]
ROUNDS = 3
# fp32 arithmetic over a few rounds of a handful of operations: a few ulps of values of order 1-10
RTOL, ATOL = 1e-5, 1e-6


def run_rule(name: str, rounds: int = ROUNDS, **settings):
    strategy = make_strategy(StrategySettings(name=name, **settings), num_clients=2)
    return _run(strategy, FakeGrid(UPDATES, WEIGHTS), rounds=rounds)


def reference(rule, rounds: int = ROUNDS):
    """θ after ``rounds`` rounds of ``rule(theta, delta, t, state) -> theta`` in float64 from THETA, MEAN."""
    theta = [np.asarray(t, np.float64) for t in THETA]
    state: dict = {}
    for t in range(1, rounds + 1):
        delta = [m - x for m, x in zip(MEAN, theta)]
        theta = rule(theta, delta, t, state)
    return theta


def test_fedavgm_is_hsu_et_als_server_momentum():
    eta, beta = 0.5, 0.9

    def momentum(theta, delta, t, state):  # v_t = β v_{t−1} + g_t (v_1 = g_1), g = −Δ; θ ← θ − η v
        g = [-d for d in delta]
        state["v"] = g if t == 1 else [beta * v + x for v, x in zip(state["v"], g)]
        return [x - eta * v for x, v in zip(theta, state["v"])]

    got = run_rule("fedavgm", server_lr=eta, server_momentum=beta)
    for g, want in zip(got, reference(momentum)):
        np.testing.assert_allclose(g, want, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("rule", ["fedadam", "fedyogi", "fedadagrad"])
def test_the_adaptive_rules_follow_reddi_et_als_algorithm_2_as_flower_states_it(rule):
    eta, b1, b2, tau = 0.05, 0.9, 0.99, 1e-3

    def adaptive(theta, delta, t, state):
        beta1 = 0.0 if rule == "fedadagrad" else b1  # Flower's FedAdagrad has no first moment
        m = state.get("m", [np.zeros_like(d) for d in delta])
        v = state.get("v", [np.zeros_like(d) for d in delta])
        m = [beta1 * a + (1 - beta1) * d for a, d in zip(m, delta)]
        if rule == "fedadam":
            v = [b2 * a + (1 - b2) * d**2 for a, d in zip(v, delta)]
            step = eta * math.sqrt(1 - b2 ** (t + 1)) / (1 - b1 ** (t + 1))  # Flower's bias correction
        elif rule == "fedyogi":
            v = [a - (1 - b2) * d**2 * np.sign(a - d**2) for a, d in zip(v, delta)]
            step = eta
        else:
            v = [a + d**2 for a, d in zip(v, delta)]
            step = eta
        state.update(m=m, v=v)
        return [x + step * a / (np.sqrt(b) + tau) for x, a, b in zip(theta, m, v)]

    settings = {"server_lr": eta, "tau": tau} | ({} if rule == "fedadagrad" else {"beta1": b1, "beta2": b2})
    got = run_rule(rule, **settings)
    for g, want in zip(got, reference(adaptive)):
        np.testing.assert_allclose(g, want, rtol=RTOL, atol=ATOL)


FLOWER = {
    "fedavgm": (lambda: FedAvgM(server_learning_rate=0.5, server_momentum=0.9), {"server_lr": 0.5, "server_momentum": 0.9}),
    "fedadam": (lambda: FedAdam(eta=0.05, beta_1=0.8, beta_2=0.95, tau=1e-2), {"server_lr": 0.05, "beta1": 0.8, "beta2": 0.95, "tau": 1e-2}),
    "fedyogi": (lambda: FedYogi(eta=0.05, beta_1=0.8, beta_2=0.95, tau=1e-2), {"server_lr": 0.05, "beta1": 0.8, "beta2": 0.95, "tau": 1e-2}),
    "fedadagrad": (lambda: FedAdagrad(eta=0.05, tau=1e-2), {"server_lr": 0.05, "tau": 1e-2}),
}


@pytest.mark.parametrize("rule", list(FLOWER))
def test_each_rule_moves_theta_as_flowers_own_strategy_does_on_the_same_replies(rule):
    """Flower's strategy averages the two weighted replies itself and keeps θ_t from its own
    configure_train (FedAvgM: its own last output); ours averages through the boundary and hands
    Flower's rule the average."""
    build, settings = FLOWER[rule]
    flower = build()
    theta = _record(THETA)
    replies = [
        message(
            RecordDict({"arrays": _record(UPDATES[n]), "metrics": MetricRecord({"num-examples": WEIGHTS[n]})}), "train", src=n, message_id=f"r{n}"
        )
        for n in (1, 2)
    ]
    for t in range(1, ROUNDS + 1):
        if rule == "fedavgm":
            flower.current_arrays = flower.current_arrays or theta
        else:
            flower.current_arrays = {k: a.numpy() for k, a in theta.items()}
        theta, _ = flower.aggregate_train(t, replies)
    ours = run_rule(rule, **settings)
    for got, want in zip(ours, [theta[k].numpy() for k in KEYS]):
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


def test_fedexp_step_size_by_hand():
    # Δ_1 = 1, Δ_2 = −0.5 (one coordinate), equal weights: Σ w‖Δ_i‖² = 0.625, Δ̄ = 0.25, ‖Δ̄‖² = 0.0625;
    # with ε = 0.0625: η_g = 0.625 / (2 × 0.125) = 2.5
    assert fedexp_step_size(0.625, 0.0625, 0.0625) == 2.5
    # identical updates: Σ w‖Δ_i‖² = ‖Δ̄‖², so the ratio is below 1/2 and η_g = 1
    assert fedexp_step_size(4.0, 4.0, 1e-3) == 1.0


def test_fedexp_extrapolates_along_the_average_by_its_step_size():
    """Two clients, equal weights, whose updates point apart: Δ_1 = +1, Δ_2 = −0.5 on every
    coordinate of the first factor, 0 on the second. d = 6 coordinates: Σ w‖Δ_i‖² = 0.5·6 + 0.5·1.5
    = 3.75, Δ̄ = 0.25 (‖Δ̄‖² = 0.375), ε = 0.375: η_g = 3.75 / (2 × 0.75) = 2.5, θ_1 = θ_0 + 0.625."""
    updates = {1: [THETA[0] + 1.0, THETA[1]], 2: [THETA[0] - 0.5, THETA[1]]}
    strategy = FedExP(epsilon=0.375, **_common(2))
    got = _run(strategy, FakeGrid(updates, {1: 5, 2: 5}))
    np.testing.assert_allclose(got[0], THETA[0] + 0.625, rtol=1e-6)
    np.testing.assert_array_equal(got[1], THETA[1])
    record = got.records[1]
    assert record["multiplier"] == pytest.approx(2.5, rel=1e-12)
    assert record["fedexp"]["eta-g"] == pytest.approx(2.5, rel=1e-12)
    assert record["effective-multiplier"] == pytest.approx(2.5, rel=1e-6)


def test_fedexp_weighs_each_updates_norm_by_its_share_of_the_average():
    """Weights 1 and 3: Σ w‖Δ_i‖² = (1·6·1 + 3·6·0.25)/4 = 2.625; Δ̄ = (1 − 1.5)/4 = −0.125 (‖Δ̄‖² =
    0.09375); ε = 0.01: η_g = 2.625 / (2 × 0.10375)."""
    updates = {1: [THETA[0] + 1.0, THETA[1]], 2: [THETA[0] - 0.5, THETA[1]]}
    got = _run(FedExP(epsilon=0.01, **_common(2)), FakeGrid(updates, {1: 1, 2: 3}))
    assert got.records[1]["multiplier"] == pytest.approx(2.625 / (2 * 0.10375), rel=1e-9)


def test_fedexp_evaluates_the_average_of_its_last_two_iterates_and_trains_from_the_last():
    updates = {1: [THETA[0] + 1.0, THETA[1]], 2: [THETA[0] - 0.5, THETA[1]]}
    strategy = FedExP(epsilon=0.375, average_last_two=True, **_common(2))
    got = _run(strategy, FakeGrid(updates, {1: 5, 2: 5}))
    evaluated = strategy.evaluation_arrays(1, _record(got))
    np.testing.assert_allclose(evaluated[KEYS[0]].numpy(), THETA[0] + 0.3125, rtol=1e-6)  # (θ_0 + θ_1)/2
    np.testing.assert_allclose(got[0], THETA[0] + 0.625, rtol=1e-6)  # the global adapter: θ_1
    assert FedExP(epsilon=0.375, **_common(2)).evaluated_arrays(_record(got)) is None  # off: θ_{t+1} itself


def test_step_geometry_by_hand():
    theta = {"a": np.zeros(2, np.float32)}
    delta = {"a": np.array([3.0, 4.0], np.float32)}  # ‖Δ‖ = 5
    assert step_geometry(theta, {"a": np.array([0.0, 5.0], np.float32)}, delta) == {"effective-multiplier": 1.0, "step-cosine": 0.8}
    assert step_geometry(theta, {"a": np.array([6.0, 8.0], np.float32)}, delta) == {"effective-multiplier": 2.0, "step-cosine": 1.0}
    assert step_geometry(theta, {"a": np.array([-3.0, -4.0], np.float32)}, delta)["step-cosine"] == -1.0
    assert step_geometry(theta, theta, delta) == {"effective-multiplier": 0.0, "step-cosine": None}
    assert step_geometry(theta, theta, {"a": np.zeros(2, np.float32)}) == {"effective-multiplier": None, "step-cosine": None}


@pytest.mark.parametrize(("name", "settings", "a"), [("fedavg", {}, 1.0), ("fixed", {"multiplier": 3.0}, 3.0)])
def test_a_step_along_the_average_records_its_multiplier_and_cosine_one(name, settings, a):
    record = run_rule(name, rounds=1, **settings).records[1]
    assert record["effective-multiplier"] == pytest.approx(a, rel=1e-6)
    assert record["step-cosine"] == pytest.approx(1.0, abs=1e-6)


def test_fedadam_records_how_far_its_step_went_and_in_which_direction():
    got = run_rule("fedadam", rounds=1, server_lr=0.05, tau=1e-3)
    record = got.records[1]
    step = [g - t for g, t in zip(got, THETA)]
    delta = [m - t for m, t in zip(MEAN, THETA)]
    norm = lambda xs: math.sqrt(sum(float(np.sum(np.square(x, dtype=np.float64))) for x in xs))  # noqa: E731
    assert record["multiplier"] == pytest.approx(norm(step) / norm(delta), rel=1e-5)
    assert record["effective-multiplier"] == record["multiplier"]
    cosine = sum(float(np.vdot(s, d)) for s, d in zip(step, delta)) / (norm(step) * norm(delta))
    assert record["step-cosine"] == pytest.approx(cosine, rel=1e-5)
    assert record["step-cosine"] < 0.999  # a per-coordinate step is not along Δ_t here


def test_a_step_that_is_not_finite_holds_and_leaves_the_optimizers_state_as_it_was():
    strategy = make_strategy(StrategySettings(name="fedadam", server_lr=1e39), num_clients=2)  # finite in float64, not in fp32
    got = _run(strategy, FakeGrid(UPDATES, WEIGHTS))
    np.testing.assert_array_equal(got[0], THETA[0])
    assert got.records[1]["multiplier"] == 0.0 and "not finite" in got.records[1]["hold-reason"]
    assert strategy.optimizer.m_t is None and strategy.optimizer.v_t is None


SERVER_KEYS = {
    "server-lr": 0.5,
    "server-momentum": 0.5,
    "beta1": 0.5,
    "beta2": 0.5,
    "tau": 0.5,
    "fedexp-epsilon": 0.5,
    "fedexp-average": True,
}
USES = {
    "fedavgm": {"server-lr", "server-momentum"},
    "fedadam": {"server-lr", "beta1", "beta2", "tau"},
    "fedyogi": {"server-lr", "beta1", "beta2", "tau"},
    "fedadagrad": {"server-lr", "tau"},
    "fedexp": {"fedexp-epsilon", "fedexp-average"},
}


@pytest.mark.parametrize("name", ["fedavg", "fixed", "fedtops", "local", "centralized", *USES])
@pytest.mark.parametrize("key", list(SERVER_KEYS))
def test_a_server_optimizers_key_is_refused_where_it_has_no_effect(name, key):
    config = {"preset": "sandbox", "strategy.name": name, f"strategy.{key}": SERVER_KEYS[key]}
    if name == "fixed":
        config["strategy.multiplier"] = 2.0
    if key in USES.get(name, ()):
        assert getattr(parse_run_config(config).strategy, key.replace("-", "_")) == SERVER_KEYS[key]
    else:
        with pytest.raises(ConfigError, match=f"'strategy.{key}'.*no effect"):
            parse_run_config(config)


def test_fedexp_refuses_a_robust_aggregator_and_privacy():
    with pytest.raises(ConfigError, match="'strategy.aggregator' = 'median'.*update norm"):
        parse_run_config({"preset": "sandbox", "strategy.name": "fedexp", "strategy.aggregator": "median", "num-clients": 5})
    with pytest.raises(ConfigError, match="privacy.clipping.*'fedexp'"):
        parse_run_config({"preset": "sandbox", "strategy.name": "fedexp", "privacy.clipping": "fixed", "num-clients": 3})


@pytest.mark.parametrize("name", ["fedavgm", "fedadam", "fedyogi", "fedadagrad"])
def test_a_stateful_rule_composes_with_privacy_and_a_robust_mean_but_refuses_to_resume(name):
    parse_run_config({"preset": "sandbox", "strategy.name": name, "privacy.clipping": "fixed", "num-clients": 3})
    parse_run_config({"preset": "sandbox", "strategy.name": name, "strategy.aggregator": "median", "num-clients": 3})
    with pytest.raises(ConfigError, match="'resume-from'.*optimizer state"):
        parse_run_config({"preset": "sandbox", "strategy.name": name, "resume-from": "runs/x"})


@pytest.mark.parametrize("name", ["fedavgm", "fedadam", "fedyogi", "fedadagrad"])
def test_under_privacy_the_rule_steps_on_the_released_private_mean_and_spends_what_fedavg_spends(name):
    """The rule is post-processing of the private mean (equal weights over the fixed n = 2, clipped
    at C, Gaussian noise): with noise 0 and C large its step is the rule's step on the plain
    equal-weight mean, and the round spends the same ε as FedAvg's with the same settings."""
    private = PrivacySettings(clipping="fixed", clip_norm=100.0, noise_multiplier=0.0, score_noise=0.0)
    settings = {"fedavgm": {"server_lr": 0.5}, "fedadagrad": {"server_lr": 0.05}}.get(name, {"server_lr": 0.05})
    ran = _run(make_strategy(StrategySettings(name=name, **settings), num_clients=2, privacy=private), FakeGrid(UPDATES, WEIGHTS), rounds=2)
    plain = _run(make_strategy(StrategySettings(name=name, **settings), num_clients=2), FakeGrid(UPDATES, {1: 1, 2: 1}), rounds=2)
    for got, want in zip(ran, plain):
        np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)
    fedavg = _run(make_strategy(StrategySettings(name="fedavg"), num_clients=2, privacy=private), FakeGrid(UPDATES, WEIGHTS), rounds=2)
    assert ran.records[2]["privacy"] == fedavg.records[2]["privacy"]


def test_an_optimizer_state_that_overflows_holds_the_round_and_is_restored():
    # Δ ≈ 1e25 per coordinate: Δ² overflows fp32 in v_t while θ + η m/(√v + τ) stays finite (m/∞ = 0)
    huge = {1: [THETA[0] + 1e25, THETA[1]], 2: [THETA[0] + 1e25, THETA[1]]}
    strategy = make_strategy(StrategySettings(name="fedadagrad", server_lr=0.05), num_clients=2)
    got = _run(strategy, FakeGrid(huge, WEIGHTS))
    np.testing.assert_array_equal(got[0], THETA[0])
    assert "not finite" in got.records[1]["hold-reason"] and got.records[1]["multiplier"] == 0.0
    assert strategy.optimizer.v_t is None


def test_momentum_that_moves_theta_while_the_average_does_not_records_how_far_it_went():
    # FedAvgM η = 1, β = 0.9: round 1 moves to the mean (θ_1 = MEAN); round 2's replies are the same,
    # so Δ_2 = 0, and momentum alone moves θ by 0.9 Δ_1: no multiplier of Δ_2, a step of 0.9‖Δ_1‖
    got = run_rule("fedavgm", rounds=2, server_lr=1.0, server_momentum=0.9)
    delta1 = [m - t for m, t in zip(MEAN, THETA)]
    norm1 = math.sqrt(sum(float(np.sum(d**2)) for d in delta1))
    record = got.records[2]
    assert record["multiplier"] is None and "effective-multiplier" not in record
    assert record["step-norm"] == pytest.approx(0.9 * norm1, rel=1e-5)
    assert got.records[1]["step-norm"] == pytest.approx(norm1, rel=1e-5)


def test_flowers_start_evaluates_what_the_strategy_evaluates():
    updates = {1: [THETA[0] + 1.0, THETA[1]], 2: [THETA[0] - 0.5, THETA[1]]}
    seen = {}
    strategy = FedExP(epsilon=0.375, average_last_two=True, **_common(2))
    strategy.start(
        FakeGrid(updates, {1: 5, 2: 5}), _record(THETA), num_rounds=1, evaluate_fn=lambda t, arrays: seen.setdefault(t, arrays[KEYS[0]].numpy())
    )
    np.testing.assert_allclose(seen[1], THETA[0] + 0.3125, rtol=1e-6)  # (θ_0 + θ_1)/2, θ_1 = θ_0 + 0.625


@pytest.mark.parametrize(("tau", "ok"), [(1e-30, True), (9e-31, False), (0.0, False), (float("inf"), False)])
def test_tau_must_stay_representable_in_fp32(tau, ok):
    config = {"preset": "sandbox", "strategy.name": "fedadagrad", "strategy.tau": tau}
    if ok:
        assert parse_run_config(config).strategy.tau == tau
    else:
        with pytest.raises(ConfigError, match="'strategy.tau'"):
            parse_run_config(config)


# -- generated inputs at the boundaries: client updates (untrusted replies) and run-config values --
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

FIXED = settings(max_examples=60, derandomize=True, deadline=None, database=None)
finite = st.floats(min_value=-1e6, max_value=1e6, allow_nan=False, width=32)


@FIXED
@given(
    moves=st.lists(st.tuples(finite, finite), min_size=2, max_size=4),
    weights=st.lists(st.integers(min_value=1, max_value=100), min_size=4, max_size=4),
    epsilon=st.sampled_from([1e-6, 1e-3, 1.0]),
)
def test_whatever_the_clients_send_fedexps_step_stays_within_its_bound(moves, weights, epsilon):
    """Any finite updates (a hostile client may cancel the others to shrink ‖Δ̄‖): η_gΔ̄ is either
    Δ̄ (η_g = 1, ‖Δ̄‖ ≤ √S by Jensen) or S·Δ̄ / (2(‖Δ̄‖² + ε)), whose norm is at most S / (4√ε),
    S = Σ w_i‖Δ_i‖²; θ_{t+1} is finite or the round holds."""
    updates = {n + 1: [THETA[0] + np.float32(a), THETA[1] + np.float32(b)] for n, (a, b) in enumerate(moves)}
    ws = {n + 1: weights[n] for n in range(len(moves))}
    got = _run(FedExP(epsilon=epsilon, **_common(len(moves))), FakeGrid(updates, ws))
    record = got.records[1]
    assert all(np.all(np.isfinite(x)) for x in got)
    if record["multiplier"] == 0.0:  # held: θ_t kept
        np.testing.assert_array_equal(got[0], THETA[0])
        return
    spread = record["fedexp"]["mean-update-norm-sq"]
    step = math.sqrt(sum(float(np.sum((np.asarray(g, np.float64) - t) ** 2)) for g, t in zip(got, THETA)))
    bound = max(math.sqrt(spread), spread / (4 * math.sqrt(epsilon)))
    assert step <= bound * (1 + 1e-5) + 1e-6 * (1 + max(abs(a) for m in moves for a in m))  # fp32 rounding of θ_{t+1}
    # η_g by hand from the updates as the server received them (fp32 θ + move, back in float64)
    deltas = [[np.asarray(u, np.float64) - t for u, t in zip(updates[n], THETA)] for n in updates]
    w = np.array([ws[n] for n in updates], np.float64) / sum(ws.values())
    spread_hand = sum(wi * sum(float(np.sum(d**2)) for d in di) for wi, di in zip(w, deltas))
    mean_sq = sum(float(np.sum(sum(wi * di[k] for wi, di in zip(w, deltas)) ** 2)) for k in range(2))
    # fp32 averaging errs by ~1e-7 relative to the updates, i.e. by ≤ 1e-4 of ‖Δ̄‖² when S / ‖Δ̄‖² ≤ 1e3
    if mean_sq > 1e-3 * spread_hand:  # no cancellation that fp32 averaging would blur
        assert record["multiplier"] == pytest.approx(max(1.0, spread_hand / (2 * (mean_sq + epsilon))), rel=1e-3)


RANGES = {  # key: (accepted value?)
    "strategy.server-lr": lambda v: (v > 0 or v == -1.0) and math.isfinite(v),
    "strategy.server-momentum": lambda v: 0 <= v < 1,
    "strategy.beta1": lambda v: 0 <= v < 1,
    "strategy.beta2": lambda v: 0 <= v < 1,
    "strategy.tau": lambda v: math.isfinite(v) and v >= 1e-30,
    "strategy.fedexp-epsilon": lambda v: math.isfinite(v) and v > 0,
}
OWNER = {
    "strategy.server-lr": "fedadam",
    "strategy.server-momentum": "fedavgm",
    "strategy.beta1": "fedadam",
    "strategy.beta2": "fedyogi",
    "strategy.tau": "fedadagrad",
    "strategy.fedexp-epsilon": "fedexp",
}


@FIXED
@given(key=st.sampled_from(list(RANGES)), value=st.one_of(st.floats(allow_nan=True), st.sampled_from([-1.0, 0.0, 1.0, 1e-30, 1e-31, 0.999999])))
def test_a_server_optimizers_value_is_accepted_exactly_in_its_declared_range(key, value):
    config = {"preset": "sandbox", "strategy.name": OWNER[key], key: value}
    if RANGES[key](value):
        parse_run_config(config)
    else:
        with pytest.raises(ConfigError, match=f"'{key}'"):
            parse_run_config(config)
