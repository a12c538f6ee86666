"""Differential privacy (privacy.*, docs/privacy.md): the private mean over a fixed denominator,
adaptive clipping's centred count, FedTOPS's score rows, the accountant, the budget, the ClientApp's
clipping mod, and the values refused.

Expected values are worked out by hand in the comments. Exact values are fp32 arithmetic on
numbers of order 1 (relative 1e-6). Noise is drawn from the OS's entropy (never seeded: a seed would
make it predictable), so its tests are statistical: n draws estimate a standard deviation with
relative standard error 1/sqrt(2n) (0.16 % for n = 200,000), and each tolerance is 6 of those.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from conftest import TINY_RUN
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from hypothesis import example, given, settings
from hypothesis import strategies as st
from scipy.stats import norm
from test_strategies import THETA, UPDATES, WEIGHTS, FakeGrid, _record, _run, message

from fedopd.config import ConfigError, StrategySettings, parse_run_config
from fedopd.core.settings import PrivacySettings
from fedtops_strategy import FedTOPS, make_strategy
from fedtops_strategy.privacy import (
    PrivacyBudgetSpent,
    PrivacyLedger,
    UpdatePrivacy,
    adaptive_multipliers,
    clip_scores,
    clip_update,
    end_journal_lines,
    noisy_unclipped_share,
    privatize_scores,
    public_score_row,
    read_journal,
    score_noise_stds,
)
from fedtops_strategy.round import play_round

pytestmark = pytest.mark.usefixtures("task_identity")
FIXED = settings(max_examples=60, derandomize=True, deadline=None, database=None)

# Updates of THETA (0.5 ×6, -1.0 ×3): node 1 moves by (0.5 ×6, 1.0 ×3), norm sqrt(4.5);
# node 2 by (1.5 ×6, 2.0 ×3), norm sqrt(25.5). WEIGHTS are 1 and 3 (the non-private mean: 1.75, 0.75).
U1, U2 = (0.5, 1.0), (1.5, 2.0)
N1, N2 = math.sqrt(4.5), math.sqrt(25.5)


def _dp(**kw) -> PrivacySettings:
    return PrivacySettings(**{"clipping": "fixed", "clip_norm": 100.0, "noise_multiplier": 0.0, "score_noise": 0.0, **kw})


def _strategy(name="fedavg", num_clients=2, **kw):
    return make_strategy(StrategySettings(name=name), num_clients=num_clients, privacy=_dp(**kw))


def _fp32_vectors(size: int):
    """Hypothesis: fp32-representable vectors of ``size`` entries in ±1e6."""
    return st.lists(st.floats(-1e6, 1e6, allow_nan=False, width=32), min_size=size, max_size=size)


def _rel_se(n: int) -> float:
    """The relative standard error of a sample standard deviation over n normal draws."""
    return 1 / math.sqrt(2 * n)


# ---------------------------------------------------------------------------------------------
# The update: the sum of clipped updates over a fixed n, plus noise
# ---------------------------------------------------------------------------------------------


def test_the_private_mean_weighs_every_update_equally():
    # C = 100 clips nothing and z = 0 adds nothing: θ + (u1 + u2) / 2 = (0.5 + 1.0, -1 + 1.5),
    # not the num-examples-weighted 1.75 / 0.75 of FedAvg (weights 1 and 3).
    result = play_round(_strategy(), FakeGrid(UPDATES, WEIGHTS), 1, _record(THETA), ConfigRecord(), train_timeout=None, score_timeout=None)
    new = list(result.step.theta.values())
    np.testing.assert_allclose(new[0], 1.5, rtol=1e-6)
    np.testing.assert_allclose(new[1], 0.5, rtol=1e-6)
    assert result.train.weights == {1: 1.0, 2: 1.0}


def test_server_side_clipping_bounds_each_update_at_c_before_the_mean():
    # C = 1: each update is scaled to norm 1, u / |u|; the mean is ((0.5/N1 + 1.5/N2)/2, (1/N1 + 2/N2)/2).
    strategy = _strategy(clip_norm=1.0)
    new = _run(strategy, FakeGrid(UPDATES, WEIGHTS))
    np.testing.assert_allclose(new[0], 0.5 + (U1[0] / N1 + U2[0] / N2) / 2, rtol=1e-6)
    np.testing.assert_allclose(new[1], -1.0 + (U1[1] / N1 + U2[1] / N2) / 2, rtol=1e-6)
    public, diagnostics = new.records[1]["privacy"], new.records[1]["privacy-diagnostics"]
    assert public["clip-norm"] == 1.0 and public["denominator"] == 2
    assert diagnostics == {"updates-averaged": 2, "updates-clipped": 2, "update-norm-median": pytest.approx((N1 + N2) / 2, rel=1e-6)}


def test_the_published_privacy_field_holds_no_norm_and_no_count_of_who_replied():
    strategy = _strategy(clip_norm=1.0, noise_multiplier=1.0)
    ran = _run(strategy, FakeGrid(UPDATES, WEIGHTS, lost={2: ("train", "superlink")}))
    public = ran.records[1]["privacy"]
    assert set(public) == {
        "denominator",
        "clip-norm",
        "noise-multiplier",
        "update-noise-multiplier",
        "update-noise-std",
        "epsilon",
        "epsilon-rdp",
        "epsilon-pld",
        "delta",
        "releases",
    }
    assert ran.records[1]["privacy-diagnostics"]["updates-averaged"] == 1


def test_a_fixed_multiplier_moves_a_times_along_the_private_mean():
    # a = 3 on the equal-weight mean's increment (1.0, 1.5): (0.5 + 3, -1 + 4.5); the noise is on the
    # mean, before a (a × the mean is post-processing), so a never changes the sensitivity C/n.
    strategy = make_strategy(StrategySettings(name="fixed", multiplier=3.0), num_clients=2, privacy=_dp())
    new = _run(strategy, FakeGrid(UPDATES, WEIGHTS))
    np.testing.assert_allclose(new[0], 3.5, rtol=1e-6)
    np.testing.assert_allclose(new[1], 3.5, rtol=1e-6)


def test_a_client_that_fails_counts_as_a_zero_update_over_the_fixed_n():
    # n = 2 whoever answers: node 2's error reply leaves θ + u1 / 2 = (0.5 + 0.25, -1 + 0.5),
    # not θ + u1 (the mean of the one update that arrived).
    grid = FakeGrid(UPDATES, WEIGHTS, lost={2: ("train", "superlink")})
    strategy = _strategy()
    new = _run(strategy, grid)
    np.testing.assert_allclose(new[0], 0.5 + U1[0] / 2, rtol=1e-6)
    np.testing.assert_allclose(new[1], -1.0 + U1[1] / 2, rtol=1e-6)
    assert [e["node-id"] for e in new.records[1]["excluded"]] == [2]


def test_a_round_without_any_update_still_releases_theta_plus_noise():
    # Not releasing would tell that no client's update arrived. z = 1, C = 2, n = 2: noise std 1.
    strategy = _strategy(clip_norm=2.0, noise_multiplier=1.0)
    lost = FakeGrid(UPDATES, WEIGHTS, lost={1: ("train", "silent"), 2: ("train", "silent")})
    new = _run(strategy, lost)
    assert not np.allclose(new[0], THETA[0])  # 6 draws of std 1: all within 1e-8 of 0 has probability ~1e-48
    assert new.records[1]["privacy"]["releases"] == 1
    assert new.records[1]["multiplier"] == 1.0


def test_a_round_asks_at_most_n_clients_when_more_are_connected():
    # num-clients = 2 declared, three connected: n = 2, and a round asks 2 (a random subset), so the
    # sum over n never holds more than n updates.
    updates = {**UPDATES, 3: [np.full((2, 3), 0.0), np.full((3,), 0.0)]}
    strategy = _strategy()
    grid = FakeGrid(updates, {1: 1, 2: 1, 3: 1})
    ran = _run(strategy, grid)
    assert len([m for m in grid.sent if m.metadata.message_type == "train"]) == 2
    assert len(ran.records[1]["sampled-node-ids"]) == 2


def _big(num: int = 38_912) -> tuple[dict[str, np.ndarray], list[str]]:
    """θ_t shaped like the sandbox's adapter: two factors of 38,912 entries in all."""
    keys = ["layer.lora_A.weight", "layer.lora_B.weight"]
    return {keys[0]: np.zeros((8, num // 16), np.float32), keys[1]: np.zeros((num // 16, 8), np.float32)}, keys


def _direction(theta, seed, norm_):
    """An update of θ with the given L2 norm (over both factors), in a seeded random direction."""
    rng = np.random.default_rng(seed)
    raw = {k: rng.normal(size=v.shape) for k, v in theta.items()}
    scale = norm_ / math.sqrt(sum(float(np.sum(r**2)) for r in raw.values()))
    return {k: (theta[k] + raw[k] * scale).astype(np.float32) for k in theta}


def _flat(named, keys):
    return np.concatenate([np.asarray(named[k], np.float64).ravel() for k in keys])


def _independent_epsilon(multiplier: float, steps: int = 1, delta: float = 1e-5) -> float:
    """ε of ``steps`` Gaussians of ``multiplier`` from Google's dp-accounting, composed one by one on
    a finer PLD grid than the app's (1e-4): the app's ε must not be below it for the same noise."""
    import dp_accounting
    from dp_accounting.pld import pld_privacy_accountant

    pld = pld_privacy_accountant.PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE, value_discretization_interval=1e-4)
    pld.compose(dp_accounting.GaussianDpEvent(multiplier), steps)
    return float(pld.get_epsilon(delta))


class _BigGrid(FakeGrid):
    def __init__(self, updates, lost=None):
        super().__init__(updates, dict.fromkeys(updates, 1), lost=lost)

    def send_and_receive(self, messages, *, timeout=None):
        replies = []
        for msg in messages:
            self.sent.append(msg)
            msg.metadata.__dict__["_message_id"] = f"m{len(self.sent)}"
            node = msg.metadata.dst_node_id
            if self.lost.get(node):
                continue
            arrays = ArrayRecord({k: Array(v) for k, v in self.updates[node].items()})
            content = RecordDict({"arrays": arrays, "metrics": MetricRecord({"num-examples": 1})})
            replies.append(message(content, "train", src=node, message_id=f"r{len(self.sent)}", reply_to=msg.metadata.message_id))
        return replies


def _private_round(updates, theta, keys, lost=None, **kw):
    """One round of a private FedAvg over ``updates`` (node -> θ + u); (released θ̃, the round's record)."""
    strategy = make_strategy(StrategySettings(name="fedavg"), num_clients=3, privacy=_dp(**kw))
    grid = _BigGrid(updates, lost)
    record = ArrayRecord({k: Array(theta[k]) for k in keys})
    result = play_round(strategy, grid, 1, record, ConfigRecord(), train_timeout=None, score_timeout=None)
    return {k: result.step.theta[k] for k in keys}, {1: result.to_record()}


def test_the_noise_measured_on_a_private_round_is_the_stated_z_c_over_n_and_the_reported_epsilon_covers_it():
    # Three known updates (norm 3: clipped to C = 1; norm 0.5: kept; a zero update) through a
    # private round with z = 1.3, n = 3. The released θ̃ minus the clipped mean θ + (u1/3 + u2 + 0)/3
    # is the noise: 38,912 draws estimate its std to 0.36 % (tolerance 6 of those, 2.2 %).
    theta, keys = _big()
    ups = {1: _direction(theta, 1, 3.0), 2: _direction(theta, 2, 0.5), 3: {k: v.copy() for k, v in theta.items()}}
    released, records = _private_round(ups, theta, keys, clip_norm=1.0, noise_multiplier=1.3)
    expected = (_flat(ups[1], keys) / 3.0 + _flat(ups[2], keys)) / 3
    noise = _flat(released, keys) - expected
    stated = 1.3 * 1.0 / 3
    tol = 6 * _rel_se(noise.size)
    assert np.std(noise) == pytest.approx(stated, rel=tol)
    assert abs(np.mean(noise)) < 6 * stated / math.sqrt(noise.size)
    assert records[1]["privacy"]["update-noise-std"] == pytest.approx(stated, rel=1e-12)
    # The largest noise the measurement allows, as a multiplier (sensitivity C/n): its ε is a lower
    # bound on the mechanism's, and the run must report at least that.
    measured_z = np.std(noise) * (1 + tol) / (1.0 / 3)
    reported = records[1]["privacy"]["epsilon"]
    assert reported >= _independent_epsilon(measured_z)
    assert reported == pytest.approx(_independent_epsilon(1.3), rel=1e-3)


def test_neighbouring_federations_release_with_the_same_noise_and_means_c_over_n_apart():
    # D holds clients 1, 2, 3; D' is D without client 3 (it never answers). n = 3 in both, so the
    # noise has std z C / 3 in both, and the means differ by ū_3 / 3, norm at most C / 3.
    theta, keys = _big()
    ups = {1: _direction(theta, 1, 0.4), 2: _direction(theta, 2, 0.7), 3: _direction(theta, 3, 5.0)}
    with_3, _ = _private_round(ups, theta, keys, clip_norm=1.0, noise_multiplier=1.0)
    without_3, records = _private_round(ups, theta, keys, lost={3: True}, clip_norm=1.0, noise_multiplier=1.0)
    base = (_flat(ups[1], keys) + _flat(ups[2], keys)) / 3
    clipped_3 = _flat(ups[3], keys) / 5.0  # clipped to norm 1
    tol = 6 * _rel_se(base.size)
    for noise in (_flat(with_3, keys) - base - clipped_3 / 3, _flat(without_3, keys) - base):
        assert np.std(noise) == pytest.approx(1.0 / 3, rel=tol)
    assert records[1]["privacy"]["update-noise-std"] == pytest.approx(1.0 / 3, rel=1e-12)
    assert np.linalg.norm(clipped_3 / 3) == pytest.approx(1.0 / 3, rel=1e-6)


def test_a_reply_refused_at_the_boundary_does_not_change_the_noise():
    # Client 3's reply has the wrong shape: the boundary refuses it, it adds a zero update, and the
    # noise stays z C / n with n = 3.
    theta, keys = _big()
    bad = {keys[0]: np.zeros((1, 1), np.float32), keys[1]: np.zeros((1, 1), np.float32)}
    ups = {1: _direction(theta, 1, 0.4), 2: _direction(theta, 2, 0.7), 3: bad}
    released, records = _private_round(ups, theta, keys, clip_norm=2.0, noise_multiplier=0.5)
    noise = _flat(released, keys) - (_flat(ups[1], keys) + _flat(ups[2], keys)) / 3
    assert np.std(noise) == pytest.approx(0.5 * 2.0 / 3, rel=6 * _rel_se(noise.size))
    assert [e["node-id"] for e in records[1]["excluded"]] == [3]
    assert records[1]["privacy-diagnostics"]["updates-averaged"] == 2


def test_a_zero_update_is_a_valid_update_on_the_server():
    # Flower's clipping divides by the update's norm: θ_t sent back unchanged ended the run.
    clipped, was = clip_update({"w": np.ones(3, np.float32)}, {"w": np.ones(3, np.float32)}, 1.0)
    assert not was and clipped["w"].tolist() == [1.0, 1.0, 1.0]


@FIXED
@given(_fp32_vectors(3), _fp32_vectors(3), st.floats(1e-3, 1e3))
def test_a_clipped_update_is_never_longer_than_c_beyond_fp32_rounding(theta, reply, clip_norm):
    t, r = np.array(theta, np.float32), np.array(reply, np.float32)
    clipped, _ = clip_update({"w": t}, {"w": r}, clip_norm)
    u = clipped["w"].astype(np.float64) - t.astype(np.float64)
    # fp32 rounding of θ + ū: at most eps/2 per entry of |θ + ū| <= |θ| + C
    slack = np.finfo(np.float32).eps * (np.linalg.norm(t.astype(np.float64)) + clip_norm)
    assert np.linalg.norm(u) <= clip_norm + slack


def test_the_server_clips_in_float64_so_fp32_rounding_cannot_lengthen_an_update(monkeypatch):
    # θ = 1 (fp32 ulp 2^-23 = 1.19e-7), each of 4 entries moved by 2 ulps, C = 2 × 0.7 ulp: clipped,
    # each entry moves 0.7 ulp. Re-formed from fp32 θ + ū, each entry rounds to a whole ulp and the
    # update is 1/0.7 = 1.43 × C long; kept in float64 it is C long.
    import fedtops_strategy.privacy as privacy_module

    ulp = 2.0**-23
    theta = {"w": np.ones(4, np.float32)}
    reply = {"w": np.full(4, 1.0 + 2 * ulp, np.float32)}
    clip_norm = 2 * 0.7 * ulp
    rounded, _ = clip_update(theta, reply, clip_norm)
    assert np.linalg.norm(rounded["w"].astype(np.float64) - 1.0) == pytest.approx(2 * ulp, rel=1e-12)  # 1.43 C: what fp32 gives
    summed = []
    real_noisy_mean = privacy_module.noisy_mean
    monkeypatch.setattr(privacy_module, "noisy_mean", lambda t, inc, *a: summed.extend(inc) or real_noisy_mean(t, inc, *a))
    UpdatePrivacy(_dp(clip_norm=clip_norm), 1).release(1, [reply], [None], theta)
    assert np.linalg.norm(summed[0]["w"]) == pytest.approx(clip_norm, rel=1e-12)


@FIXED
@given(_fp32_vectors(4), _fp32_vectors(4), st.floats(1e-12, 1e3))
def test_the_server_s_clipped_increment_is_never_longer_than_c(theta, reply, clip_norm):
    from fedtops_strategy.privacy import clipped_increment

    increment, _ = clipped_increment({"w": np.array(theta, np.float32)}, {"w": np.array(reply, np.float32)}, clip_norm)
    assert np.linalg.norm(increment["w"]) <= clip_norm * (1 + 1e-12)  # float64 rounding: a few 2^-53


def test_the_noise_ignores_any_seed_set_before_and_leaves_numpy_s_stream_as_it_was():
    # A seed anyone can read (the run's) must not decide the noise, and NumPy's global stream goes on
    # as if the release had not happened.
    n = 1000
    theta = {"w": np.zeros(n, np.float32)}
    np.random.seed(0)
    seeded = np.random.normal(0.0, 1.0, n).astype(np.float32)  # what a seed of 0 would add (std z C / n = 1)
    np.random.seed(0)
    privacy = UpdatePrivacy(_dp(clip_norm=1.0, noise_multiplier=2.0), 2)
    arrays, _, _ = privacy.release(1, [theta, theta], [None, None], theta)
    assert not np.allclose(arrays["w"], seeded, atol=1e-3)
    np.testing.assert_array_equal(np.random.normal(0.0, 1.0, n).astype(np.float32), seeded)


# ---------------------------------------------------------------------------------------------
# Adaptive clipping: the centred count, accounted as its own release
# ---------------------------------------------------------------------------------------------


def test_the_unclipped_share_is_centred_over_the_fixed_n():
    # Two unclipped and one clipped of n = 4, no noise: 1/2 + ((1 + 1 + 0) - 3/2) / 4 = 0.625. A
    # fourth client, clipped or not, moves it by ±(1/2)/4: the count's sensitivity is 1/2.
    rng = np.random.default_rng(0)
    assert noisy_unclipped_share([True, True, False], 4, 0.0, rng) == pytest.approx(0.625, abs=1e-15)
    assert noisy_unclipped_share([True, True, False, True], 4, 0.0, rng) == pytest.approx(0.75, abs=1e-15)
    assert noisy_unclipped_share([True, True, False, False], 4, 0.0, rng) == pytest.approx(0.5, abs=1e-15)


def test_the_noisy_share_is_clamped_to_0_1_and_has_the_count_s_noise_over_n():
    rng = np.random.default_rng(1)  # a test's own generator: the statistics, not secrecy
    shares = [noisy_unclipped_share([True] * 3, 4, 100.0, rng) for _ in range(2000)]
    assert min(shares) == 0.0 and max(shares) == 1.0 and all(0.0 <= s <= 1.0 for s in shares)
    # One unclipped client of n = 4 with σ_b = 0.3: 1/2 + (1 - 1/2)/4 = 0.625 with std 0.3 / 4 = 0.075,
    # 5 std from either bound (the clamp moves the std by less than 1e-5 of it).
    draws = np.array([noisy_unclipped_share([True], 4, 0.3, rng) for _ in range(200_000)])
    assert np.std(draws) == pytest.approx(0.075, rel=6 * _rel_se(draws.size))
    assert np.mean(draws) == pytest.approx(0.625, abs=6 * 0.075 / math.sqrt(draws.size))


def test_adaptive_z_splits_into_the_update_and_the_count_so_that_they_compose_to_z():
    # z = σ_b = 1: z_b = 2σ_b = 2 (noise 1 on a count of sensitivity 1/2), z_Δ = (1 - 1/4)^-1/2.
    z_update, z_count = adaptive_multipliers(1.0, 1.0)
    assert z_count == 2.0 and z_update == pytest.approx((1 - 0.25) ** -0.5, rel=1e-15)
    assert (z_update**-2 + z_count**-2) ** -0.5 == pytest.approx(1.0, rel=1e-15)
    with pytest.raises(ValueError, match="σ_b > z/2"):
        adaptive_multipliers(1.0, 0.5)


def test_adaptive_clipping_at_z_and_sigma_b_1_over_8_rounds_costs_what_z_1_costs():
    # The audit: Flower's uncentred count made the mechanism's ε 23.7 where 16.5 was reported. Centred,
    # the 16 releases (z_Δ and 2σ_b per round) compose to 8 Gaussians of z = 1: RDP ε 16.5 (dp-accounting).
    import dp_accounting

    privacy = UpdatePrivacy(_dp(clipping="adaptive", noise_multiplier=1.0, clipped_count_stddev=1.0), 3)
    for _ in range(8):
        for z in privacy.round_multipliers(scores=False):
            privacy.ledger.compose(z)
    rdp = dp_accounting.rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    rdp.compose(dp_accounting.GaussianDpEvent(1.0), 8)
    eps = privacy.ledger.epsilons()
    assert privacy.ledger.releases == 16
    assert eps["rdp"] == pytest.approx(rdp.get_epsilon(1e-5), rel=1e-6) and eps["rdp"] == pytest.approx(16.51, abs=0.01)
    assert eps["pld"] == pytest.approx(_independent_epsilon(1.0, 8), rel=1e-3)  # 15.46
    assert eps["epsilon"] == eps["pld"] < eps["rdp"]


def test_adaptive_clipping_adds_noise_at_the_norm_the_updates_were_clipped_to():
    # Every update is under C = 1, so the noisy unclipped share is about 1 and C moves to about
    # exp(-1 × (1 - 0.5)) = 0.61 for the next round. The noise must be z_Δ × 1 / 4 at this round's
    # C, with z_Δ = (z^-2 - (2 σ_b)^-2)^-1/2 = (25 - 6.25)^-1/2 for z = 0.2, σ_b = 0.2.
    n = 200_000
    theta = {"w": np.zeros(n, np.float32)}
    settings_ = _dp(clipping="adaptive", clip_norm=1.0, noise_multiplier=0.2, clipped_count_stddev=0.2, clip_norm_lr=1.0)
    privacy = UpdatePrivacy(settings_, 4)
    tiny = [{"w": np.full(n, 1e-3 / math.sqrt(n), np.float32) * (-1) ** i} for i in range(4)]  # mean 0, none clipped
    arrays, public, _ = privacy.release(1, tiny, [None] * 4, theta)
    z_update = (0.2**-2 - 0.4**-2) ** -0.5
    assert np.std(arrays["w"].astype(np.float64)) == pytest.approx(z_update * 1.0 / 4, rel=6 * _rel_se(n))
    assert public["clip-norm"] == 1.0 and 0.4 < public["next-clip-norm"] < 0.8
    assert privacy.clipping_norm == public["next-clip-norm"]
    assert privacy.ledger.releases == 2  # the update and the count


@pytest.mark.parametrize("update_norm, direction", [(1e-3, "down"), (10.0, "up")])
def test_adaptive_clipping_moves_c_towards_the_target_share(update_norm, direction):
    # Andrew et al.: C ← C exp(−η (unclipped share − γ)), γ = 0.5, η = 1. Four updates under C = 1:
    # unclipped share 1/2 + (4 - 2)/4 = 1 (noise 0.2 / 4 = 0.05, clamped at 1), C ~ exp(−0.5) = 0.61.
    # Four of norm 10: share ~0, C ~ exp(0.5) = 1.65. Flower 1.41's wrapper moves the other way.
    n = 1000
    theta = {"w": np.zeros(n, np.float32)}
    settings_ = _dp(clipping="adaptive", clip_norm=1.0, noise_multiplier=0.0, clipped_count_stddev=0.2, clip_norm_lr=1.0)
    privacy = UpdatePrivacy(settings_, 4)
    updates = [{"w": np.full(n, update_norm / math.sqrt(n), np.float32) * (-1) ** i} for i in range(4)]
    privacy.release(1, updates, [None] * 4, theta)
    low, high = (0.45, 0.8) if direction == "down" else (1.3, 2.1)
    assert low < privacy.clipping_norm < high


# ---------------------------------------------------------------------------------------------
# Client side: the train config, the server's checks, the ClientApp's mod
# ---------------------------------------------------------------------------------------------


def test_client_side_train_messages_carry_c_and_which_clipping():
    strategy = _strategy(side="client", clip_norm=10.0)
    grid = FakeGrid(UPDATES, WEIGHTS)
    _run(strategy, grid)
    config = grid.sent[0].content.config_records["config"]
    assert config["clipping_norm"] == 10.0 and config["privacy-clipping"] == "fixed"


def test_client_side_an_update_longer_than_c_is_clipped_again_on_the_server():
    # C = 3: node 1's norm sqrt(4.5) = 2.12 stays; node 2's sqrt(25.5) = 5.05 was not clipped by its
    # client, and the server clips it to 3: θ + (u1 + 3 u2/N2) / 2.
    strategy = _strategy(side="client", clip_norm=3.0)
    new = _run(strategy, FakeGrid(UPDATES, WEIGHTS))
    np.testing.assert_allclose(new[0], 0.5 + (U1[0] + 3 * U2[0] / N2) / 2, rtol=1e-6)
    np.testing.assert_allclose(new[1], -1.0 + (U1[1] + 3 * U2[1] / N2) / 2, rtol=1e-6)
    assert not new.records[1]["excluded"]


@pytest.mark.parametrize(
    "clip_norm, bit, refused",
    [
        (3.0, 1, "says its update was clipped to C = 3, but the update's norm is 2.12132"),  # norm sqrt(4.5) < C
        (2.0, 0, "says its update was not clipped, but its norm 2.12132 exceeds C = 2"),
        (3.0, 0, None),
        (2.0, 1, None),  # the server clips it again to 2
        (3.0, 7, "'norm_bit' is 7"),
        (3.0, 0.5, "'norm_bit' is 0.5"),
    ],
)
def test_client_side_adaptive_a_norm_bit_the_update_contradicts_is_refused(clip_norm, bit, refused):
    strategy = _strategy(side="client", clipping="adaptive", clip_norm=clip_norm, noise_multiplier=0.0)
    grid = FakeGrid(UPDATES, WEIGHTS, extra={("train", 1): {"norm_bit": bit}, ("train", 2): {"norm_bit": 1}})
    ran = _run(strategy, grid)
    excluded = ran.records[1]["excluded"]
    if refused is None:
        assert not excluded
    else:
        assert [e["node-id"] for e in excluded] == [1] and refused in excluded[0]["reason"], excluded


def test_client_side_adaptive_a_reply_without_its_norm_bit_is_left_out_not_a_crash():
    strategy = _strategy(side="client", clipping="adaptive", clip_norm=10.0, noise_multiplier=0.0)
    grid = FakeGrid(UPDATES, WEIGHTS, extra={("train", 1): {"norm_bit": 0}})
    new = _run(strategy, grid)
    np.testing.assert_allclose(new[0], 0.5 + U1[0] / 2, rtol=1e-6)  # node 2 adds a zero update
    [excluded] = new.records[1]["excluded"]
    assert excluded["node-id"] == 2 and "norm_bit" in excluded["reason"]


def _train_message(theta, clipping=None, clip_norm=1.0):
    config = ConfigRecord({"learner": "federated"} | ({"clipping_norm": clip_norm, "privacy-clipping": clipping} if clipping else {}))
    content = RecordDict({"arrays": ArrayRecord({"w": Array(theta)}), "config": config})
    return message(content, "train", dst=5, message_id="m1")


def _reply_with(values):
    def handler(m, ctx):
        out = RecordDict({"arrays": ArrayRecord({"w": Array(np.asarray(values, np.float32))}), "metrics": MetricRecord({"num-examples": 1})})
        return Message(content=out, reply_to=m)

    return handler


CTX = Context(run_id=1, node_id=5, node_config={}, state=RecordDict(), run_config={})


@pytest.mark.parametrize("clipping", [None, "fixed", "adaptive"])
def test_the_clientapp_mod_clips_only_when_the_train_config_asks(clipping):
    from client_app.app import privacy_clipping_mod

    # an update of norm 2 (entries 1): clipped to 1 (entries 0.5) when asked
    reply = privacy_clipping_mod(_train_message(np.zeros(4, np.float32), clipping), CTX, _reply_with(np.ones(4)))
    w = reply.content.array_records["arrays"]["w"].numpy()
    np.testing.assert_allclose(w, 1.0 if clipping is None else 0.5, rtol=1e-6)
    metrics = reply.content.metric_records["metrics"]
    assert ("norm_bit" in metrics) == (clipping == "adaptive") and metrics.get("norm_bit", 1) == 1


def test_the_clientapp_mod_keeps_a_zero_update_and_says_it_was_not_clipped():
    # Flower's adaptiveclipping_mod divides by the update's norm: a client that returned θ_t crashed.
    from client_app.app import privacy_clipping_mod

    theta = np.full(4, 0.25, np.float32)
    reply = privacy_clipping_mod(_train_message(theta, "adaptive"), CTX, _reply_with(theta))
    assert reply.content.array_records["arrays"]["w"].numpy().tolist() == [0.25] * 4
    assert reply.content.metric_records["metrics"]["norm_bit"] == 0


@pytest.mark.parametrize("mode, clip_norm, reason", [("huge", 1.0, "'privacy-clipping' = 'huge'"), ("fixed", -1.0, "'clipping_norm' = -1.0")])
def test_the_clientapp_mod_answers_a_bad_clipping_request_with_an_error_reply(mode, clip_norm, reason):
    from client_app.app import privacy_clipping_mod

    msg = _train_message(np.zeros(4, np.float32), mode, clip_norm)
    reply = privacy_clipping_mod(msg, CTX, lambda m, c: pytest.fail("handler ran"))
    assert reply.has_error() and reason in reply.error.reason


# ---------------------------------------------------------------------------------------------
# The score channel (FedTOPS)
# ---------------------------------------------------------------------------------------------


def test_score_noise_is_sigma_times_sqrt_2k_times_each_range():
    # k = 6 candidates: one client moves 12 values by at most their range: sqrt(12) range units.
    std_j, std_k = score_noise_stds(6, 0.5, 1.0, 0.1)
    assert std_j == pytest.approx(0.5 * math.sqrt(12), rel=1e-15)
    assert std_k == pytest.approx(0.05 * math.sqrt(12), rel=1e-15)


def test_scores_are_clipped_to_their_range_and_an_infeasible_one_to_the_top():
    assert clip_scores([-0.2, 0.03, 0.5, math.inf, math.nan], 0.1).tolist() == [0.0, 0.03, 0.1, 0.1, 0.1]


def test_released_scores_have_the_noise_of_their_range():
    rng = np.random.default_rng(0)  # a test's own generator: the statistics, not secrecy
    settings = _dp(score_noise=2.0, teacher_score_max=1.0, change_score_max=0.1)
    k = 1000
    released = [privatize_scores([0.5] * k, [0.05] * k, settings, rng) for _ in range(200)]
    j = np.array([r[0] for r in released]) - 0.5
    c = np.array([r[1] for r in released]) - 0.05
    assert np.std(j) == pytest.approx(2.0 * math.sqrt(2 * k) * 1.0, rel=0.01)
    assert np.std(c) == pytest.approx(2.0 * math.sqrt(2 * k) * 0.1, rel=0.01)


SCORES = {
    # candidates (0.5, 1, 2, 3, 5, 10), δ = 0.05, K̂ clipped to [0, 0.1], Ĵ to [0, 1]
    1: ([0.90, 0.80, 0.70, 5.0, 9.0, 9.0], [0.001, 0.01, 0.04, 0.08, 0.3, math.inf]),
    2: ([0.95, 0.85, 0.60, 0.2, 0.1, 0.1], [0.001, 0.01, 0.03, 0.04, 0.06, 0.2]),
}


def test_fedtops_still_scores_and_selects_under_dp():
    # The increment the clients score is the private mean's (1.0, 1.5), not FedAvg's weighted one.
    # Feasible (K̂ <= δ at both): a = 0.5, 1, 2; Ĵ means 0.925, 0.825, 0.65: a = 2 is selected.
    # a = 3 would win on Ĵ (clipped: (1.0 + 0.2)/2 = 0.6) but node 1's K̂ 0.08 > δ.
    strategy = _strategy(name="fedtops")
    assert isinstance(strategy, FedTOPS) and hasattr(strategy, "configure_score")
    grid = FakeGrid(UPDATES, WEIGHTS, scores=SCORES)
    new = _run(strategy, grid)
    query = [m for m in grid.sent if m.metadata.message_type == "query.score"]
    assert len(query) == 2
    inc = query[0].content.array_records["increment"].to_numpy_ndarrays()
    np.testing.assert_allclose(inc[0], 1.0, rtol=1e-6)
    np.testing.assert_allclose(inc[1], 1.5, rtol=1e-6)
    record = new.records[1]
    assert record["multiplier"] == 2.0 and not record["fallback"]
    np.testing.assert_allclose(new[0], 0.5 + 2 * 1.0, rtol=1e-6)
    # What is recorded is what was released: clipped (9.0 -> 1.0, inf -> 0.1)
    assert record["client_teacher_scores"][0][4] == 1.0 and record["change_scores"][0][5] == 0.1
    assert record["teacher_scores"][3] == pytest.approx(0.6, rel=1e-12)
    assert record["privacy"]["releases"] == 2  # the update and the scores
    assert record["privacy"]["score-noise-std"] == [0.0, 0.0] and record["privacy"]["score-rows"] == 2
    # one "privacy" entry and one "privacy-diagnostics" entry hold both releases' fields
    assert record["privacy"]["update-noise-std"] == 0.0 and record["privacy-diagnostics"]["updates-averaged"] == 2
    assert record["privacy-diagnostics"]["public-score-rows"] == []


def test_a_client_without_valid_scores_gets_the_public_row_which_allows_a_up_to_1():
    # Node 1 never answers the score query: its row is the public one, Ĵ = 0 and K̂ = (0, 0, 0.1 ...)
    # (feasible for a <= 1 only). Node 2 alone allows 0.5-3. Feasible: 0.5, 1; the equal-weight Ĵ
    # means 0.475 and 0.425: a = 1. The cap did not read who answered (multiplier-cap None).
    assert public_score_row((0.5, 1.0, 2.0, 3.0, 5.0, 10.0), 0.1) == ([0.0] * 6, [0.0, 0.0, 0.1, 0.1, 0.1, 0.1])
    strategy = _strategy(name="fedtops")
    ran = _run(strategy, FakeGrid(UPDATES, WEIGHTS, scores={2: SCORES[2]}))
    record = ran.records[1]
    assert record["multiplier"] == 1.0 and record["multiplier-cap"] is None
    assert record["scored-node-ids"] == [1, 2] and record["change_scores"][0] == [0.0, 0.0, 0.1, 0.1, 0.1, 0.1]
    assert record["teacher_scores"][:2] == [pytest.approx(0.475, rel=1e-12), pytest.approx(0.425, rel=1e-12)]
    assert record["privacy-diagnostics"]["public-score-rows"] == [1] and record["unscored-node-ids"] == [1]


def test_the_score_rows_noise_measured_is_the_stated_and_the_reported_epsilon_covers_it():
    # Three asked nodes, one without scores (the public row): every row gets noise σ_s √(2k) c on
    # each value. 4,000 rounds of 3 rows × 6 candidates: 72,000 draws per kind, std to 0.26 %.
    settings_ = _dp(score_noise=0.7, teacher_score_max=1.0, change_score_max=0.1)
    candidates = (0.5, 1.0, 2.0, 3.0, 5.0, 10.0)
    known = {1: ([0.4] * 6, [0.02] * 6), 3: ([0.6] * 6, [0.05] * 6)}
    j_noise, k_noise = [], []
    privacy = UpdatePrivacy(settings_, 3)
    for _ in range(4000):
        rows, record, filled = privacy.release_scores(known, [1, 2, 3], candidates)
        assert [n for n, _, _ in rows] == [1, 2, 3] and filled == [2]
        expected = {1: known[1], 2: public_score_row(candidates, 0.1), 3: known[3]}
        for node, j, k in rows:
            j_noise.extend(np.subtract(j, expected[node][0]))
            k_noise.extend(np.subtract(k, expected[node][1]))
    scale = 0.7 * math.sqrt(12)
    tol = 6 * _rel_se(len(j_noise))
    assert np.std(j_noise) == pytest.approx(scale * 1.0, rel=tol)
    assert np.std(k_noise) == pytest.approx(scale * 0.1, rel=tol)
    assert record["score-noise-std"] == [pytest.approx(scale), pytest.approx(scale * 0.1)]
    # in range units the row's sensitivity is √(2k): the measured multiplier, at its largest
    measured = min(np.std(j_noise) / 1.0, np.std(k_noise) / 0.1) * (1 + tol) / math.sqrt(12)
    one = PrivacyLedger(1e-5)
    one.compose(0.7)  # one round's score release, as release_scores accounts it
    assert one.epsilon >= _independent_epsilon(measured)


# ---------------------------------------------------------------------------------------------
# Accounting
# ---------------------------------------------------------------------------------------------


def _gaussian_epsilon_exact(sigma: float, delta: float) -> float:
    """The smallest ε of one Gaussian mechanism with multiplier σ at δ (Balle & Wang 2018, Thm 8):
    δ(ε) = Φ(1/(2σ) − εσ) − e^ε Φ(−1/(2σ) − εσ), solved by bisection."""

    def d(eps):
        return norm.cdf(1 / (2 * sigma) - eps * sigma) - math.exp(eps) * norm.cdf(-1 / (2 * sigma) - eps * sigma)

    lo, hi = 0.0, 100.0
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if d(mid) > delta else (lo, mid)
    return hi


def _rdp_epsilon_classic(sigma: float, releases: int, delta: float) -> float:
    """Mironov's conversion of the Gaussian's RDP α T / (2σ²): min over α of that + log(1/δ)/(α − 1),
    an upper bound that any RDP accountant's (tighter) conversion stays under."""
    alphas = np.linspace(1.01, 200, 200_000)
    return float(np.min(alphas * releases / (2 * sigma**2) + math.log(1 / delta) / (alphas - 1)))


@pytest.mark.parametrize("sigma", [0.8, 1.0, 2.0, 5.0])
def test_epsilon_of_one_release_lies_between_the_exact_gaussian_and_the_classic_rdp_bound(sigma):
    ledger = PrivacyLedger(1e-5)
    ledger.compose(sigma)
    exact = _gaussian_epsilon_exact(sigma, 1e-5)
    assert exact <= ledger.epsilon <= _rdp_epsilon_classic(sigma, 1, 1e-5)
    # the PLD is the exact ε up to its grid (1e-3 nats, pessimistic)
    assert exact <= ledger.epsilons()["pld"] <= exact + 2e-3


def test_two_releases_compose_as_one_gaussian_of_the_combined_multiplier():
    # RDP of a Gaussian is α/(2σ²) and adds up: noise 1 and 2 compose to 1/σ² = 1 + 1/4.
    import dp_accounting

    two = PrivacyLedger(1e-5)
    two.compose(1.0)
    two.compose(2.0)
    rdp = dp_accounting.rdp.RdpAccountant()
    rdp.compose(dp_accounting.GaussianDpEvent(1.0))
    rdp.compose(dp_accounting.GaussianDpEvent(2.0))
    assert two.epsilons()["rdp"] == pytest.approx(rdp.get_epsilon(1e-5), rel=1e-9)
    assert two.epsilons()["pld"] == pytest.approx(_gaussian_epsilon_exact((1 + 1 / 4) ** -0.5, 1e-5), abs=2e-3)
    assert two.releases == 2


def test_the_default_fedavg_run_reports_the_tighter_pld_epsilon():
    # z = 1 over 8 rounds at δ = 1e-5: RDP 16.51, PLD 15.46 (the audit's figures); ε is the smaller.
    ledger = PrivacyLedger(1e-5)
    for _ in range(8):
        ledger.compose(1.0)
    eps = ledger.epsilons()
    assert eps["rdp"] == pytest.approx(16.51, abs=0.01) and eps["pld"] == pytest.approx(15.46, abs=0.01)
    assert ledger.summary()["epsilon"] == eps["pld"] and ledger.summary()["epsilon-rdp"] == eps["rdp"]


def test_the_journal_holds_every_release_before_it_leaves_and_a_cut_off_last_line_is_not_one(tmp_path):
    ledger = PrivacyLedger(1e-5)
    ledger.journal = tmp_path / "privacy-ledger.jsonl"
    ledger.compose(2.0, "round 1 update")
    ledger.compose(4.0, "round 1 scores")
    lines = [json.loads(line) for line in ledger.journal.read_text().splitlines()]
    assert lines == [{"release": "round 1 update", "noise-multiplier": 2.0}, {"release": "round 1 scores", "noise-multiplier": 4.0}]
    with open(ledger.journal, "a") as f:
        f.write('{"release": "round 2 upd')  # the server stopped mid-write: that release never left
    assert read_journal(ledger.journal) == [("round 1 update", 2.0), ("round 1 scores", 4.0)]
    ledger.journal.write_text('{"noise-multiplier": 2.0}\nnot json\n{"noise-multiplier": 4.0}\n')
    with pytest.raises(ValueError, match="privacy-ledger.jsonl, line 2: not a privacy release"):
        read_journal(ledger.journal)


@FIXED
@given(st.text(max_size=300))
def test_a_journal_of_any_text_is_read_or_refused_with_a_value_error(text):
    import pathlib
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = pathlib.Path(d) / "privacy-ledger.jsonl"
        path.write_text(text, encoding="utf-8")
        try:
            entries = read_journal(path)
        except ValueError as err:
            assert "privacy-ledger.jsonl, line" in str(err)
        else:
            assert all(isinstance(w, str) and z >= 0 for w, z in entries)


@FIXED
@given(st.lists(st.sampled_from(['{"release": "r", "noise-multiplier": 1.0}', "\n", "\r", '{"rel', "x", "2", "{}"]), max_size=8))
@example(['{"release": "r", "noise-multiplier": 1.0}', "\r", '{"rel'])  # a release before a lone CR (review, 2026-11-26)
def test_ending_a_journal_s_lines_keeps_exactly_the_releases_it_counts(parts):
    """Whatever a journal holds (a line cut off, a stray carriage return, a tail that is JSON but no
    release), ending its lines keeps what read_journal counts, and a release appended reads back."""
    import pathlib
    import tempfile

    with tempfile.TemporaryDirectory() as d:
        path = pathlib.Path(d) / "privacy-ledger.jsonl"
        path.write_bytes("".join(parts).encode())
        try:
            counted = read_journal(path)
        except ValueError:
            return  # refused before the resume writes anything
        end_journal_lines(path)
        assert read_journal(path) == counted
        ledger = PrivacyLedger(1e-5)
        ledger.journal = path
        ledger.compose(2.0, "next")
        assert read_journal(path) == counted + [("next", 2.0)]


def test_a_resume_counts_the_journal_s_releases_and_takes_c_from_the_complete_rounds(tmp_path):
    journal = tmp_path / "privacy-ledger.jsonl"
    # Round 1 complete (update, count), round 2's update released before the stop cut its record off.
    journal.write_text("".join(json.dumps({"release": w, "noise-multiplier": z}) + "\n" for w, z in (("u", 0.2), ("c", 0.4), ("u", 0.2))))
    records = [{"round": 1, "privacy": {"releases": 2, "next-clip-norm": 0.7}}]
    resumed = UpdatePrivacy(_dp(clipping="adaptive", noise_multiplier=0.2, clipped_count_stddev=0.2), 2)
    resumed.replay(records, journal)
    assert [e.noise_multiplier for e in resumed.ledger.events] == [0.2, 0.4, 0.2] and resumed.clipping_norm == 0.7


@pytest.mark.parametrize(
    "tail, counted",
    [('{"release": "round 2 upd', 0), ('{"release": "round 2 update", "noise-multiplier": 1.0}', 1)],
    ids=["cut-mid-line", "only-the-newline-lost"],
)
def test_a_resume_after_a_cut_off_journal_write_appends_on_a_line_of_its_own_and_resumes_again(tmp_path, tail, counted):
    """The server stopped mid-write: the resume counts the cut-off release only when the line is
    whole (conservative), and what it journals next stays readable, so a second resume reads every
    release (audit, 2026-11-26: the redo was appended to the cut-off line, and the next resume was
    refused)."""
    journal = tmp_path / "privacy-ledger.jsonl"
    journal.write_text('{"release": "round 1 update", "noise-multiplier": 1.0}\n' + tail)
    records = [{"round": 1, "privacy": {"releases": 1}}]
    first = UpdatePrivacy(_dp(noise_multiplier=1.0), 2)
    first.replay(records, journal)
    assert len(first.ledger.events) == 1 + counted
    first.ledger.journal = journal
    first.ledger.compose(1.0, "round 2 update")
    second = UpdatePrivacy(_dp(noise_multiplier=1.0), 2)
    second.replay(records, journal)
    assert [e.what for e in second.ledger.events] == ["round 1 update"] + ["round 2 update"] * (1 + counted)


def test_a_resume_without_its_journal_or_with_a_shorter_one_is_refused(tmp_path):
    records = [{"round": 1, "privacy": {"releases": 2}}, {"round": 2, "privacy": {"releases": 4}}]
    privacy = UpdatePrivacy(_dp(noise_multiplier=1.0), 2)
    with pytest.raises(ValueError, match="privacy-ledger.jsonl is missing"):
        privacy.replay(records, tmp_path / "privacy-ledger.jsonl")
    (tmp_path / "privacy-ledger.jsonl").write_text('{"release": "round 1 update", "noise-multiplier": 1.0}\n')
    with pytest.raises(ValueError, match="holds 1 release.*the round records count 4"):
        privacy.replay(records, tmp_path / "privacy-ledger.jsonl")


def test_a_release_without_noise_makes_epsilon_infinite_and_none_spends_nothing():
    ledger = PrivacyLedger(1e-5)
    assert ledger.epsilon == 0.0
    ledger.compose(1.0)
    ledger.compose(0.0)
    assert ledger.epsilon == math.inf and ledger.summary()["epsilon"] is None


# ---------------------------------------------------------------------------------------------
# The budget
# ---------------------------------------------------------------------------------------------


def _budget_between(rounds: int, per_round: float) -> float:
    """A budget between ε after ``rounds`` and after ``rounds`` + 1 rounds of one Gaussian of
    ``per_round`` each (dp-accounting's PLD, independently of the app)."""
    return (_independent_epsilon(per_round, rounds) + _independent_epsilon(per_round, rounds + 1)) / 2


def test_the_budget_allows_the_rounds_whose_releases_fit_and_refuses_the_next_release(tmp_path):
    # FedTOPS: z = 2 and σ_s = 4 per round, one Gaussian of (1/4 + 1/16)^-1/2 = 1.789.
    per_round = (2.0**-2 + 4.0**-2) ** -0.5
    budget = _budget_between(3, per_round)
    privacy = UpdatePrivacy(_dp(noise_multiplier=2.0, score_noise=4.0, max_epsilon=budget), 3)
    assert privacy.rounds_within_budget(scores=True, rounds=10) == 3
    assert privacy.rounds_within_budget(scores=True, rounds=2) == 2
    privacy.ledger.journal = tmp_path / "privacy-ledger.jsonl"
    for t in range(1, 4):
        assert privacy.budget_stop(t, scores=True) is None
        privacy.ledger.compose(2.0, f"round {t} update")
        privacy.ledger.compose(4.0, f"round {t} scores")
    assert "round 4 not started: privacy.max-epsilon" in privacy.budget_stop(4, scores=True)
    # a release past the check (none should be) is refused by the ledger itself, and not journalled
    with pytest.raises(PrivacyBudgetSpent, match="round 4 update refused"):
        privacy.ledger.compose(2.0, "round 4 update")
    assert len(read_journal(privacy.ledger.journal)) == 6 and privacy.ledger.epsilon <= budget


# ---------------------------------------------------------------------------------------------
# Bad values, refused before round 1 and naming the key
# ---------------------------------------------------------------------------------------------

ON = {"privacy.clipping": "fixed", "num-clients": 3}


@pytest.mark.parametrize(
    "overrides, key",
    [
        ({**ON, "privacy.noise-multiplier": -0.1}, "privacy.noise-multiplier"),
        ({**ON, "privacy.clip-norm": 0.0}, "privacy.clip-norm"),
        ({**ON, "privacy.clip-norm": -1.0}, "privacy.clip-norm"),
        ({**ON, "privacy.score-noise": -1.0}, "privacy.score-noise"),
        ({**ON, "privacy.delta": 1.0}, "privacy.delta"),
        ({**ON, "privacy.target-quantile": 1.5}, "privacy.target-quantile"),
        ({**ON, "privacy.clipping": "gaussian"}, "privacy.clipping"),
        ({**ON, "privacy.side": "both"}, "privacy.side"),
        ({**ON, "strategy.aggregator": "median"}, "strategy.aggregator"),
        ({**ON, "strategy.aggregator": "krum"}, "strategy.aggregator"),
        ({**ON, "strategy.clip-norm": 2.0}, "strategy.clip-norm"),
        ({**ON, "strategy.max-weight": 2.0}, "strategy.max-weight"),
        ({**ON, "strategy.name": "local"}, "privacy.clipping"),
        ({**ON, "strategy.name": "centralized"}, "privacy.clipping"),
        ({**ON, "privacy.change-score-max": 0.05}, "privacy.change-score-max"),  # = δ: every candidate feasible
        ({"privacy.noise-multiplier": 2.0}, "privacy.noise-multiplier"),  # set while off: no privacy would be a surprise
        ({**ON, "strategy.name": "fedavg", "privacy.score-noise": 2.0}, "privacy.score-noise"),  # FedAvg has no score channel
        ({**ON, "strategy.name": "fixed", "strategy.multiplier": 2.0, "privacy.teacher-score-max": 2.0}, "privacy.teacher-score-max"),
        ({**ON, "privacy.target-quantile": 0.9}, "privacy.target-quantile"),  # fixed clipping has no quantile to track
        ({**ON, "privacy.clipped-count-stddev": 0.5}, "privacy.clipped-count-stddev"),
        ({"privacy.clipping": "fixed"}, "num-clients"),  # the fixed denominator needs the declared size
        ({**ON, "privacy.max-epsilon": -1.0}, "privacy.max-epsilon"),
        ({**ON, "privacy.max-epsilon": math.inf}, "privacy.max-epsilon"),
        ({**ON, "privacy.max-epsilon": 10.0, "privacy.score-noise": 0.0}, "privacy.max-epsilon"),  # ε = ∞ cannot fit
        ({"privacy.max-epsilon": 10.0}, "privacy.max-epsilon"),  # set while off
        # adaptive z must be < 2 σ_b; σ_b defaults to n/20 = 0.15 for 3 clients
        ({**ON, "privacy.clipping": "adaptive", "privacy.noise-multiplier": 0.5}, "privacy.noise-multiplier"),
    ],
)
def test_bad_privacy_values_are_refused_naming_the_key(overrides, key):
    with pytest.raises(ConfigError, match=f"'{key}'"):
        parse_run_config(overrides)


@pytest.mark.parametrize("name", ["fedavg", "fixed", "fedtops"])
def test_each_averaging_strategy_accepts_privacy(name):
    extra = {"strategy.multiplier": 2.0} if name == "fixed" else {}
    cfg = parse_run_config({**ON, "strategy.name": name, **extra})
    assert cfg.privacy.clipping == "fixed"


def test_under_privacy_no_stop_depends_on_who_answered():
    # max-failed-rounds has no effect (a round without updates releases θ_t plus noise), and
    # max-held-rounds counts a released a = 0, not "a = 0 with valid updates" (who answered is not released).
    from server_app.run_privacy import NoPrivacy, PrivateRun
    from server_app.stop_rules import no_update_failure

    cfg = parse_run_config({**ON, "max-failed-rounds": 3})
    private, plain = PrivateRun(cfg, _strategy().privacy, True).stop_rules(cfg), NoPrivacy().stop_rules(cfg)
    assert private.max_failed_rounds == 0 and plain.max_failed_rounds == 3
    assert no_update_failure(1, 1, 0, {}) is None and no_update_failure(5, 5, 0, {}) is None
    assert no_update_failure(1, 1, 3, {}) is not None  # without privacy a federation where nothing works stops
    no_update = {"multiplier": 0.0, "clients": [], "hold-reason": "no feasible candidate"}
    assert private.held(no_update) and not plain.held(no_update)
    assert not private.held({"multiplier": 1.0, "clients": [{}]})


def test_under_privacy_a_silent_node_never_sits_out():
    # Who is asked must not depend on who answered: timeout.skip-after has no effect.
    cfg = parse_run_config({**ON, "timeout.skip-after": 1})
    strategy = make_strategy(cfg.strategy, num_clients=3, privacy=cfg.privacy, timeouts=cfg.timeout)
    assert strategy.skip_after == 0
    plain = make_strategy(cfg.strategy, num_clients=3, timeouts=cfg.timeout)
    assert plain.skip_after == 1


# ---------------------------------------------------------------------------------------------
# Whole runs: ε in the record, the stream and the summary; the budget; resume
# ---------------------------------------------------------------------------------------------

RUN = {
    **TINY_RUN,
    "num-clients": 2,
    "strategy.name": "fedtops",
    "privacy.clipping": "fixed",
    "privacy.clip-norm": 0.05,  # the tiny clients' updates have norms 0.1-0.35: every one is clipped
    "privacy.noise-multiplier": 2.0,
    "privacy.score-noise": 4.0,
}
PER_ROUND = (2.0**-2 + 4.0**-2) ** -0.5  # z = 2 and σ_s = 4 compose to one Gaussian of 1.789 per round


def _records(run):
    return [json.loads(line) for line in (run / "rounds.jsonl").read_text().splitlines()]


def _expected_epsilon(rounds: int, delta: float = 1e-5) -> float:
    """Google's dp-accounting directly: per round one Gaussian of z = 2 and one of σ_s = 4; the
    smaller of its RDP and (finer-grid) PLD ε."""
    import dp_accounting

    accountant = dp_accounting.rdp.RdpAccountant()
    for _ in range(rounds):
        accountant.compose(dp_accounting.GaussianDpEvent(2.0))
        accountant.compose(dp_accounting.GaussianDpEvent(4.0))
    return min(accountant.get_epsilon(delta), _independent_epsilon(PER_ROUND, rounds, delta))


@pytest.mark.slow
@pytest.mark.parametrize("side", ["server", "client"])
def test_a_private_fedtops_run_reports_epsilon_every_round(side, tmp_path, caplog):
    from server_app.inprocess import run_in_process

    caplog.set_level("INFO")
    run = run_in_process({**RUN, "num-server-rounds": 2, "privacy.side": side, "output-dir": str(tmp_path)}, num_clients=2)
    records = [r for r in _records(run) if r["round"] > 0]
    for t, r in enumerate(records, 1):
        assert r["privacy"]["epsilon"] == pytest.approx(_expected_epsilon(t), rel=1e-3)
        assert r["privacy"]["releases"] == 2 * t and r["privacy"]["delta"] == 1e-5
        assert r["candidates"] and "num-feasible" in r  # FedTOPS scored and selected
        assert not r["excluded"]  # client side: every update came back clipped
        if side == "server":
            assert r["privacy-diagnostics"]["updates-clipped"] == 2
    stream = caplog.text
    assert "accounted at δ = 1e-05 as one Gaussian of multiplier 1.789 per round" in stream
    # the assumption behind one deadline per phase, with the deadlines this run has (the defaults)
    assert "the guarantee assumes that a client answers within timeout.train = 3600s and timeout.score = 600s" in stream
    assert "round 2/2 [fedtops]" in stream and f"ε = {records[-1]['privacy']['epsilon']:.3g} (δ = 1e-05)" in stream
    assert f"differential privacy: ε = {records[-1]['privacy']['epsilon']:.3g} at δ = 1e-05 after 4 Gaussian releases in 2 rounds" in stream


@pytest.mark.slow
def test_a_run_stops_on_its_budget_after_the_last_round_that_fits(tmp_path, caplog):
    from fedtops_strategy.record import PUBLISHABLE
    from server_app.inprocess import run_in_process

    caplog.set_level("INFO")
    budget = _budget_between(2, PER_ROUND)
    config = {**RUN, "num-server-rounds": 4, "privacy.max-epsilon": budget, "output-dir": str(tmp_path)}
    run = run_in_process(config, num_clients=2)
    status = json.loads((run / "status.json").read_text())
    assert status["status"] == "budget-spent" and status["rounds-done"] == 2
    assert "round 3 not started: privacy.max-epsilon" in status["error"]
    assert [r["round"] for r in _records(run)] == [1, 2] and _records(run)[-1]["privacy"]["epsilon"] <= budget
    assert len(read_journal(run / "privacy-ledger.jsonl")) == 4  # nothing of round 3 was released
    assert f"privacy.max-epsilon = {budget:g} allows 2 of the 4 rounds to run" in caplog.text
    published = [json.loads(line) for line in (run / "published.jsonl").read_text().splitlines()]
    assert [p["round"] for p in published] == [1, 2]
    assert all(set(p) <= {*PUBLISHABLE, "held"} and "privacy" in p and "multiplier" in p for p in published)
    assert "privacy-diagnostics" not in published[0] and "clients" not in published[0]
    # a larger budget lets the run go on from its journal
    run_in_process({**config, "privacy.max-epsilon": 100.0, "resume-from": str(run)}, num_clients=2)
    assert json.loads((run / "status.json").read_text())["status"] == "completed"
    assert _records(run)[-1]["privacy"]["releases"] == 8


def test_a_budget_below_one_round_is_refused_before_anything_is_written(tmp_path):
    # One round of z = 2 and σ_s = 4 (one Gaussian of 1.789) costs ε ≈ 2.3 at δ = 1e-5.
    from server_app.inprocess import run_in_process

    with pytest.raises(ConfigError, match=r"'privacy.max-epsilon' = 1.0 is below the ε of one round \(2\.\d+"):
        run_in_process({**RUN, "privacy.max-epsilon": 1.0, "output-dir": str(tmp_path / "runs")}, num_clients=2)
    assert not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_a_resumed_private_run_keeps_counting_and_adaptive_clipping_goes_on_from_its_c(tmp_path):
    from server_app.inprocess import run_in_process

    config = {
        **RUN,
        "strategy.name": "fedavg",
        "privacy.clipping": "adaptive",
        "privacy.noise-multiplier": 0.2,
        "privacy.clipped-count-stddev": 0.2,
        "privacy.score-noise": 1.0,
        "output-dir": str(tmp_path),
    }
    run = run_in_process({**config, "num-server-rounds": 1}, num_clients=2)
    run_in_process({**config, "num-server-rounds": 2, "resume-from": str(run)}, num_clients=2)
    first, second = [r for r in _records(run) if r["round"] > 0]
    assert second["privacy"]["clip-norm"] == first["privacy"]["next-clip-norm"] != first["privacy"]["clip-norm"]
    import dp_accounting

    accountant = dp_accounting.rdp.RdpAccountant()
    accountant.compose(dp_accounting.GaussianDpEvent(0.2), 2)  # two rounds of (update, count) = two Gaussians of z
    assert second["privacy"]["epsilon-rdp"] == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-6)
    assert second["privacy"]["releases"] == 4


@pytest.mark.slow
def test_a_round_cut_off_after_its_releases_still_counts_when_the_run_resumes(tmp_path):
    from server_app.inprocess import run_in_process

    run = run_in_process({**RUN, "num-server-rounds": 2, "output-dir": str(tmp_path)}, num_clients=2)
    lines = (run / "rounds.jsonl").read_text().splitlines(keepends=True)
    # The server stopped after round 2's update and scores were released, before its record.
    (run / "rounds.jsonl").write_text("".join(line for line in lines if json.loads(line)["round"] < 2))
    run_in_process({**RUN, "num-server-rounds": 2, "output-dir": str(tmp_path), "resume-from": str(run)}, num_clients=2)
    last = _records(run)[-1]
    # rounds 1, 2 (cut off) and 2 again: three rounds' releases, not two
    assert last["round"] == 2 and last["privacy"]["releases"] == 6
    assert last["privacy"]["epsilon"] == pytest.approx(_expected_epsilon(3), rel=1e-3)
    assert len((run / "privacy-ledger.jsonl").read_text().splitlines()) == 6
    with open(run / "privacy-ledger.jsonl", "a") as f:
        f.write("edited by hand\n")
    with pytest.raises(ConfigError, match="'resume-from' = .*: its privacy account cannot be read: .*line 7: not a privacy release"):
        run_in_process({**RUN, "num-server-rounds": 3, "output-dir": str(tmp_path), "resume-from": str(run)}, num_clients=2)
    (run / "privacy-ledger.jsonl").unlink()
    with pytest.raises(ConfigError, match="'resume-from' = .*: its privacy account cannot be read: .*privacy-ledger.jsonl is missing"):
        run_in_process({**RUN, "num-server-rounds": 3, "output-dir": str(tmp_path), "resume-from": str(run)}, num_clients=2)
    assert _records(run)[-1]["round"] == 2


# ---------------------------------------------------------------------------------------------
# The sandbox study's cells (python -m eval.privacy)
# ---------------------------------------------------------------------------------------------


def test_the_study_gives_fedtops_score_noise_equal_to_z_and_leaves_no_dp_cells_untouched(tmp_path):
    from eval.privacy import cell_config

    fedtops = parse_run_config(cell_config("fedtops", "0.1", 0, 1.0, 3e-3, 10, tmp_path, {}))
    fedavg = parse_run_config(cell_config("fedavg", "0.1", 0, 1.0, 3e-3, 10, tmp_path, {}))
    plain = parse_run_config(cell_config("fedtops", "none", 0, 1.0, 3e-3, 10, tmp_path, {}))
    assert (fedtops.privacy.clipping, fedtops.privacy.clip_norm, fedtops.privacy.noise_multiplier, fedtops.privacy.score_noise) == (
        "fixed",
        1.0,
        0.1,
        0.1,
    )
    assert (fedavg.privacy.noise_multiplier, fedavg.strategy.name) == (0.1, "fedavg")
    assert plain.privacy == PrivacySettings()  # off, every key at its default
    assert fedtops.train.lr == 3e-3 and fedtops.num_server_rounds == 10 and fedtops.eval.every == 0


def test_the_study_refuses_a_noise_level_that_is_not_a_number(capsys):
    from eval.privacy import main

    with pytest.raises(SystemExit):
        main(["--noise", "none,-1", "--out", "/nonexistent"])
    assert "--noise: '-1' is not a number >= 0 or 'none'" in capsys.readouterr().err


def test_epsilon_is_a_tensorboard_scalar_when_finite():
    from server_app.progress import round_scalars

    assert round_scalars({"round": 3, "privacy": {"epsilon": 4.25, "delta": 1e-5, "releases": 6}})["privacy/epsilon"] == 4.25
    assert "privacy/epsilon" not in round_scalars({"round": 3, "privacy": {"epsilon": None, "delta": 1e-5, "releases": 6}})


def test_a_run_folder_without_privacy_stays_readable_when_privacy_defaults_change(tmp_path):
    # A run made when privacy.clip-norm defaulted to 0.1 recorded it; with privacy off it had no
    # effect, and reading the folder (resume, the grid's reuse) must not refuse it as "set while off".
    from server_app.run_folder import read_run_config

    recorded = {**parse_run_config({}).to_run_config(), "privacy.clip-norm": 0.1}
    (tmp_path / "config.json").write_text(json.dumps(recorded))
    config = read_run_config(tmp_path)
    assert "privacy.clip-norm" not in config and config["privacy.clipping"] == "off"
    assert parse_run_config(config).privacy == PrivacySettings()


def test_fedtops_start_stops_before_a_round_its_budget_cannot_pay_for_and_returns_what_was_released():
    """Flower's contract under privacy: privacy.max-epsilon ends FedTOPS.start cleanly, with a
    Result, before the first round whose releases would exceed it (not mid-round)."""
    strategy = _strategy(name="fedtops", noise_multiplier=1.0, score_noise=1.0, max_epsilon=40.0)
    fit = strategy.privacy.rounds_within_budget(True, 50)
    assert 1 <= fit < 50
    rounds = []
    result = strategy.start(FakeGrid(UPDATES, WEIGHTS, scores=SCORES), _record(THETA), num_rounds=50, timeout=60.0, on_round=rounds.append)
    assert [r.server_round for r in rounds] == list(range(1, fit + 1)) and sorted(result.train_metrics_clientapp) == list(range(1, fit + 1))
    assert strategy.privacy.ledger.epsilons([])["epsilon"] <= 40.0


def test_a_private_run_has_its_journal_from_the_start(tmp_path):
    """A resume refuses a folder without a journal, so it exists before any release is written."""
    from fedopd.config import parse_run_config
    from fedtops_strategy.privacy import JOURNAL
    from server_app.run_privacy import NoPrivacy, PrivateRun

    strategy = _strategy(name="fedtops")
    PrivateRun(parse_run_config({"privacy.clipping": "fixed", "num-clients": 2}), strategy.privacy, True).open(tmp_path)
    assert (tmp_path / JOURNAL).is_file() and strategy.privacy.ledger.journal == tmp_path / JOURNAL
    NoPrivacy().open(tmp_path / "plain")
    assert not (tmp_path / "plain").exists()


def test_a_phase_lasts_its_deadline_when_an_asked_client_is_silent_and_ends_at_the_last_reply_otherwise():
    """The timing side channel docs/privacy.md states (not covered by the guarantee): a client that
    gets the next round's message sees from the round's length whether every client answered.
    On the server's grid: when all answer, a phase with a 5 s deadline ends before it; when one is
    silent, a phase with a 0.5 s deadline lasts at least that."""
    import time

    from server_app.grid import PromptGrid

    class Inner:
        """Replies at once for every node except ``silent``."""

        def __init__(self, silent):
            self.silent, self.replies = silent, []

        def push_messages(self, messages):
            ids = []
            for i, m in enumerate(messages):
                m.metadata.__dict__["_message_id"] = f"m{i}"
                ids.append(f"m{i}")
                if m.metadata.dst_node_id not in self.silent:
                    self.replies.append(message(RecordDict(), "train", src=m.metadata.dst_node_id, message_id=f"r{i}", reply_to=f"m{i}"))
            return ids

        def pull_messages(self, ids):
            out, self.replies = self.replies, []
            return out

    def phase_seconds(silent, timeout):
        grid = PromptGrid(Inner(silent))
        started = time.monotonic()
        grid.send_and_receive([Message(RecordDict(), dst_node_id=n, message_type="train") for n in (1, 2, 3)], timeout=timeout)
        return time.monotonic() - started

    assert phase_seconds(silent=(), timeout=5.0) < 5.0
    assert phase_seconds(silent=(3,), timeout=0.5) >= 0.5
