"""Differential privacy (privacy.*, docs/privacy.md): Flower's wrappers around the equal-weight mean,
FedTOPS's score channel, the accountant, the ClientApp's clipping mod, and the values refused.

Expected values are worked out by hand in the comments. Exact values are fp32 arithmetic on
numbers of order 1 (relative 1e-6). Noise is drawn from the OS's entropy (never seeded: a seed would
make it predictable), so its tests are statistical: n = 200,000 draws estimate a standard deviation
with relative standard error 1/sqrt(2n) = 0.16 %, and the 1 % tolerance is over 6 of those.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from conftest import TINY_RUN
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, MetricRecord, RecordDict
from scipy.stats import norm
from test_strategies import THETA, UPDATES, WEIGHTS, FakeGrid, _record, _run, message

from fedopd.config import ConfigError, StrategySettings, parse_run_config
from fedopd.core.settings import PrivacySettings
from fedtops_strategy import FedTOPS, make_strategy
from fedtops_strategy.privacy import PrivacyLedger, UpdatePrivacy, clip_scores, privatize_scores, score_noise_stds

pytestmark = pytest.mark.usefixtures("task_identity")

# Updates of THETA (0.5 ×6, -1.0 ×3): node 1 moves by (0.5 ×6, 1.0 ×3), norm sqrt(4.5);
# node 2 by (1.5 ×6, 2.0 ×3), norm sqrt(25.5). WEIGHTS are 1 and 3 (the non-private mean: 1.75, 0.75).
U1, U2 = (0.5, 1.0), (1.5, 2.0)
N1, N2 = math.sqrt(4.5), math.sqrt(25.5)


def _dp(**kw) -> PrivacySettings:
    return PrivacySettings(**{"clipping": "fixed", "clip_norm": 100.0, "noise_multiplier": 0.0, "score_noise": 0.0, **kw})


def _strategy(name="fedavg", num_clients=2, **kw):
    return make_strategy(StrategySettings(name=name), num_clients=num_clients, privacy=_dp(**kw))


# ---------------------------------------------------------------------------------------------
# The update: Flower's wrapper around the equal-weight FedAvg mean
# ---------------------------------------------------------------------------------------------


def test_the_private_mean_weighs_every_update_equally():
    # C = 100 clips nothing and z = 0 adds nothing: θ + (u1 + u2) / 2 = (0.5 + 1.0, -1 + 1.5),
    # not the num-examples-weighted 1.75 / 0.75 of FedAvg (weights 1 and 3).
    strategy = _strategy()
    new = _run(strategy, FakeGrid(UPDATES, WEIGHTS))
    np.testing.assert_allclose(new[0], 1.5, rtol=1e-6)
    np.testing.assert_allclose(new[1], 0.5, rtol=1e-6)
    assert strategy.client_weights == {1: 1.0, 2: 1.0}


def test_server_side_clipping_bounds_each_update_at_c_before_the_mean():
    # C = 1: each update is scaled to norm 1, u / |u|; the mean is ((0.5/N1 + 1.5/N2)/2, (1/N1 + 2/N2)/2).
    strategy = _strategy(clip_norm=1.0)
    new = _run(strategy, FakeGrid(UPDATES, WEIGHTS))
    np.testing.assert_allclose(new[0], 0.5 + (U1[0] / N1 + U2[0] / N2) / 2, rtol=1e-6)
    np.testing.assert_allclose(new[1], -1.0 + (U1[1] / N1 + U2[1] / N2) / 2, rtol=1e-6)
    record = strategy.records[1]["privacy"]
    assert record["clip-norm"] == 1.0 and record["clients"] == 2
    assert record["update-norm-median"] == pytest.approx((N1 + N2) / 2, rel=1e-6)  # before clipping


def test_a_fixed_multiplier_moves_a_times_along_the_private_mean():
    # a = 3 on the equal-weight mean's increment (1.0, 1.5): (0.5 + 3, -1 + 4.5); the noise is on the
    # mean, before a (a × the mean is post-processing), so a never changes the sensitivity C/m.
    strategy = make_strategy(StrategySettings(name="fixed", multiplier=3.0), num_clients=2, privacy=_dp())
    new = _run(strategy, FakeGrid(UPDATES, WEIGHTS))
    np.testing.assert_allclose(new[0], 3.5, rtol=1e-6)
    np.testing.assert_allclose(new[1], 3.5, rtol=1e-6)


def _views(updates, theta):
    out = []
    for i, u in enumerate(updates, 1):
        content = RecordDict({"arrays": ArrayRecord({"w": Array(theta + u)}), "metrics": MetricRecord({"num-examples": 1})})
        out.append(message(content, "train", src=i, message_id=f"r{i}"))
    return out


def test_the_noise_on_the_mean_has_std_z_c_over_m():
    # m = 4 updates of norm 0.5 < C = 2 (unclipped), z = 1.5: noise std 1.5 × 2 / 4 = 0.75 per entry.
    n = 200_000
    theta = np.zeros(n, np.float32)
    updates = [np.full(n, 0.5 / math.sqrt(n), np.float32) * s for s in (1, -1, 1, -1)]  # mean 0
    privacy = UpdatePrivacy(_dp(clip_norm=2.0, noise_multiplier=1.5), num_sampled=4, population=4)
    arrays, _, record = privacy.release(1, _views(updates, theta), ArrayRecord({"w": Array(theta)}))
    noise = arrays["w"].numpy().astype(np.float64)
    assert np.std(noise) == pytest.approx(0.75, rel=0.01)
    assert abs(np.mean(noise)) < 6 * 0.75 / math.sqrt(n)
    assert record["update-noise-std"] == pytest.approx(0.75, rel=1e-12)
    assert privacy.ledger.releases == 1


def _tiny_updates(n, m):
    """m updates of norm 1e-3 with alternating signs: their mean is 0 (m even), none is clipped."""
    return [np.full(n, 1e-3 / math.sqrt(n), np.float32) * (-1) ** i for i in range(m)]


def test_the_noise_is_calibrated_to_the_updates_that_were_averaged():
    # Two of the four sampled clients answer: the mean divides by 2, so the noise is z C / 2 (Flower's
    # wrapper alone would keep the num_sampled_clients = 4 it was built with: half the noise needed).
    n = 200_000
    theta = np.zeros(n, np.float32)
    privacy = UpdatePrivacy(_dp(clip_norm=1.0, noise_multiplier=1.0), num_sampled=4, population=4)
    arrays, _, _ = privacy.release(1, _views(_tiny_updates(n, 2), theta), ArrayRecord({"w": Array(theta)}))
    assert np.std(arrays["w"].numpy().astype(np.float64)) == pytest.approx(0.5, rel=0.01)


def test_adaptive_clipping_adds_noise_at_the_norm_the_updates_were_clipped_to():
    # Flower 1.41 moves C before it adds the noise. Here every update is under C = 1, so the noisy
    # unclipped share is about 1 (count noise 0.2 / 4 = 0.05), and C moves by exp(-1 × (1 - 0.5)),
    # about 0.61 (0.52-0.70 at 3 standard deviations). The noise must still be z' × 1 / 4, with
    # z' = (z^-2 - (2 σ_b)^-2)^-1/2 = (25 - 6.25)^-1/2 for z = 0.2, σ_b = 0.2 (Andrew et al.).
    n = 200_000
    theta = np.zeros(n, np.float32)
    settings = _dp(clipping="adaptive", clip_norm=1.0, noise_multiplier=0.2, clipped_count_stddev=0.2, clip_norm_lr=1.0)
    privacy = UpdatePrivacy(settings, num_sampled=4, population=4)
    arrays, _, record = privacy.release(1, _views(_tiny_updates(n, 4), theta), ArrayRecord({"w": Array(theta)}))
    z_update = (0.2**-2 - 0.4**-2) ** -0.5
    assert np.std(arrays["w"].numpy().astype(np.float64)) == pytest.approx(z_update * 1.0 / 4, rel=0.01)
    assert record["clip-norm"] == 1.0 and 0.4 < record["next-clip-norm"] < 0.8
    assert privacy.clipping_norm == record["next-clip-norm"]


@pytest.mark.parametrize("update_norm, direction", [(1e-3, "down"), (10.0, "up")])
def test_adaptive_clipping_moves_c_towards_the_target_share(update_norm, direction):
    # Andrew et al.: C ← C exp(−η (unclipped share − γ)), γ = 0.5, η = 1. Four updates under C = 1:
    # unclipped share ~1, C ~ exp(−0.5) = 0.61. Four of norm 10: share ~0, C ~ exp(0.5) = 1.65
    # (count noise 0.2 / 4: within [0.52, 0.70] and [1.43, 1.92] at 3 standard deviations).
    # Flower 1.41's wrapper alone moves the other way (its share is of clipped updates).
    n = 1000
    theta = np.zeros(n, np.float32)
    settings = _dp(clipping="adaptive", clip_norm=1.0, noise_multiplier=0.0, clipped_count_stddev=0.2, clip_norm_lr=1.0)
    privacy = UpdatePrivacy(settings, num_sampled=4, population=4)
    updates = [u * (update_norm / 1e-3) for u in _tiny_updates(n, 4)]
    privacy.release(1, _views(updates, theta), ArrayRecord({"w": Array(theta)}))
    low, high = (0.45, 0.8) if direction == "down" else (1.3, 2.1)
    assert low < privacy.clipping_norm < high


def test_the_noise_ignores_any_seed_set_before_and_leaves_numpy_s_stream_as_it_was():
    # Flower draws its noise from NumPy's global generator; a seed anyone can read (the run's) must
    # not decide it, and the generator's own stream goes on as if the release had not happened.
    n = 1000
    theta = np.zeros(n, np.float32)
    np.random.seed(0)
    seeded = np.random.normal(0.0, 1.0, n).astype(np.float32)  # what a seed of 0 would add (std z C / m = 1)
    np.random.seed(0)
    privacy = UpdatePrivacy(_dp(clip_norm=1.0, noise_multiplier=2.0), num_sampled=2, population=2)
    arrays, _, _ = privacy.release(1, _views(_tiny_updates(n, 2), theta), ArrayRecord({"w": Array(theta)}))
    assert not np.allclose(arrays["w"].numpy(), seeded, atol=1e-3)
    np.testing.assert_array_equal(np.random.normal(0.0, 1.0, n).astype(np.float32), seeded)


def test_a_round_that_released_nothing_still_records_the_privacy_spent_so_far():
    # Round 1 releases the mean (z = 1); in round 2 no client answers: ε stays that of one release.
    strategy = _strategy(noise_multiplier=1.0)
    _run(strategy, FakeGrid(UPDATES, WEIGHTS))
    first = strategy.records[1]["privacy"]["epsilon"]
    lost = FakeGrid(UPDATES, WEIGHTS, lost={1: ("train", "silent"), 2: ("train", "silent")})
    arrays = _record(THETA)
    strategy.aggregate_train(2, lost.send_and_receive(strategy.configure_train(2, arrays, ConfigRecord(), lost), timeout=1.0))
    assert strategy.records[2]["privacy"] == {"epsilon": first, "delta": 1e-5, "releases": 1}


def test_an_error_reply_does_not_stop_the_private_round():
    # Flower's wrappers skip aggregation when any reply is an error; screening drops it first, so
    # one failing (or hostile) client cannot stall a private federation.
    grid = FakeGrid(UPDATES, WEIGHTS, lost={2: ("train", "superlink")})
    strategy = _strategy()
    new = _run(strategy, grid)
    np.testing.assert_allclose(new[0], 0.5 + U1[0], rtol=1e-6)  # node 1 alone
    assert [e["node-id"] for e in strategy.records[1]["excluded"]] == [2]


# ---------------------------------------------------------------------------------------------
# Client side: the train config, the server's check, the ClientApp's mod
# ---------------------------------------------------------------------------------------------


def test_client_side_train_messages_carry_c_and_which_mod_clips():
    strategy = _strategy(side="client", clip_norm=10.0)
    grid = FakeGrid(UPDATES, WEIGHTS)
    _run(strategy, grid)
    config = grid.sent[0].content.config_records["config"]
    assert config["clipping_norm"] == 10.0 and config["privacy-clipping"] == "fixed"


def test_client_side_an_update_longer_than_the_c_it_was_sent_is_left_out():
    # C = 3: node 1's norm sqrt(4.5) = 2.12 passes, node 2's sqrt(25.5) = 5.05 was not clipped.
    strategy = _strategy(side="client", clip_norm=3.0)
    new = _run(strategy, FakeGrid(UPDATES, WEIGHTS))
    np.testing.assert_allclose(new[0], 0.5 + U1[0], rtol=1e-6)
    [excluded] = strategy.records[1]["excluded"]
    assert excluded["node-id"] == 2 and "exceeds the privacy clipping norm 3" in excluded["reason"]


@pytest.mark.parametrize("node2_bit", [{"norm_bit": 7}, {}], ids=["not-0-or-1", "absent"])
def test_client_side_adaptive_a_reply_without_its_norm_bit_is_left_out_not_a_crash(node2_bit):
    # Flower's wrapper raises AggregationError on a reply without 'norm_bit'; screening leaves it out.
    strategy = _strategy(side="client", clipping="adaptive", clip_norm=10.0, noise_multiplier=0.0)
    grid = FakeGrid(UPDATES, WEIGHTS, extra={("train", 1): {"norm_bit": 1}, ("train", 2): node2_bit})
    new = _run(strategy, grid)
    np.testing.assert_allclose(new[0], 0.5 + U1[0], rtol=1e-6)
    [excluded] = strategy.records[1]["excluded"]
    assert excluded["node-id"] == 2 and "norm_bit" in excluded["reason"]


def _train_message(theta, clipping=None):
    config = ConfigRecord({"learner": "federated"} | ({"clipping_norm": 1.0, "privacy-clipping": clipping} if clipping else {}))
    content = RecordDict({"arrays": ArrayRecord({"w": Array(theta)}), "config": config})
    return message(content, "train", dst=5, message_id="m1")


@pytest.mark.parametrize("clipping", [None, "fixed", "adaptive"])
def test_the_clientapp_mod_clips_only_when_the_train_config_asks(clipping):
    from client_app.app import privacy_clipping_mod

    theta = np.zeros(4, np.float32)
    msg = _train_message(theta, clipping)

    def handler(m, ctx):  # an update of norm 2 (entries 1): clipped to 1 (entries 0.5) when asked
        out = RecordDict({"arrays": ArrayRecord({"w": Array(np.ones(4, np.float32))}), "metrics": MetricRecord({"num-examples": 1})})
        return Message(content=out, reply_to=m)

    ctx = Context(run_id=1, node_id=5, node_config={}, state=RecordDict(), run_config={})
    reply = privacy_clipping_mod(msg, ctx, handler)
    w = reply.content.array_records["arrays"]["w"].numpy()
    np.testing.assert_allclose(w, 1.0 if clipping is None else 0.5, rtol=1e-6)
    assert ("norm_bit" in reply.content.metric_records["metrics"]) == (clipping == "adaptive")


def test_the_clientapp_mod_answers_an_unknown_clipping_mode_with_an_error_reply():
    from client_app.app import privacy_clipping_mod

    reply = privacy_clipping_mod(_train_message(np.zeros(4, np.float32), "huge"), None, lambda m, c: pytest.fail("handler ran"))
    assert reply.has_error() and "'privacy-clipping' = 'huge'" in reply.error.reason


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
    record = strategy.records[1]
    assert record["multiplier"] == 2.0 and not record["fallback"]
    np.testing.assert_allclose(new[0], 0.5 + 2 * 1.0, rtol=1e-6)
    # What is recorded is what was released: clipped (9.0 -> 1.0, inf -> 0.1)
    assert record["client_teacher_scores"][0][4] == 1.0 and record["change_scores"][0][5] == 0.1
    assert record["teacher_scores"][3] == pytest.approx(0.6, rel=1e-12)
    assert record["privacy"]["releases"] == 2  # the update and the scores
    assert record["privacy"]["score-noise-std"] == [0.0, 0.0]


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
    ledger = PrivacyLedger(1e-5, 3)
    ledger.compose(sigma, 3)
    assert _gaussian_epsilon_exact(sigma, 1e-5) <= ledger.epsilon <= _rdp_epsilon_classic(sigma, 1, 1e-5)


def test_two_releases_compose_as_one_gaussian_of_the_combined_multiplier():
    # RDP of a Gaussian is α/(2σ²) and adds up: noise 1 and 2 compose to 1/σ² = 1 + 1/4.
    two = PrivacyLedger(1e-5, 3)
    two.compose(1.0, 3)
    two.compose(2.0, 3)
    one = PrivacyLedger(1e-5, 3)
    one.compose((1 + 1 / 4) ** -0.5, 3)
    assert two.epsilon == pytest.approx(one.epsilon, rel=1e-9)
    assert two.releases == 2 and one.releases == 1


def test_a_round_with_more_clients_than_the_run_was_sized_for_keeps_every_earlier_release():
    # num-clients = 0 sizes the population at the nodes connected at the start; more may join.
    grown = PrivacyLedger(1e-5, 2)
    grown.compose(1.0, 2)
    grown.compose(1.0, 5)
    same = PrivacyLedger(1e-5, 5)
    same.compose(2**-0.5, 5)  # two releases of multiplier 1 = one of 1/sqrt(2)
    assert grown.population == 5 and grown.epsilon == pytest.approx(same.epsilon, rel=1e-9)


def test_the_journal_holds_every_release_before_it_leaves_and_a_cut_off_last_line_is_not_one(tmp_path):
    from fedtops_strategy.privacy import read_journal

    ledger = PrivacyLedger(1e-5, 3)
    ledger.journal = tmp_path / "privacy-ledger.jsonl"
    ledger.compose(2.0, 3, "round 1 update")
    ledger.compose(4.0, 2, "round 1 scores")
    lines = [json.loads(line) for line in ledger.journal.read_text().splitlines()]
    assert lines == [
        {"release": "round 1 update", "noise-multiplier": 2.0, "clients": 3},
        {"release": "round 1 scores", "noise-multiplier": 4.0, "clients": 2},
    ]
    with open(ledger.journal, "a") as f:
        f.write('{"release": "round 2 upd')  # the server stopped mid-write: that release never left
    assert read_journal(ledger.journal) == [(2.0, 3), (4.0, 2)]
    ledger.journal.write_text('{"noise-multiplier": 2.0, "clients": 3}\nnot json\n{"noise-multiplier": 4.0, "clients": 2}\n')
    with pytest.raises(ValueError, match="privacy-ledger.jsonl, line 2: not a privacy release"):
        read_journal(ledger.journal)


def test_a_resume_counts_the_journal_s_releases_and_takes_c_from_the_complete_rounds(tmp_path):
    from fedtops_strategy.privacy import read_journal

    journal = tmp_path / "privacy-ledger.jsonl"
    # Round 1 complete (update + scores), round 2's update released before the stop cut its record off.
    journal.write_text("".join(json.dumps({"noise-multiplier": z, "clients": 2}) + "\n" for z in (2.0, 4.0, 2.0)))
    records = [
        {
            "round": 1,
            "privacy": {"noise-multiplier": 2.0, "clients": 2, "score-noise-multiplier": 4.0, "next-clip-norm": 0.7},
            "scored-node-ids": [1, 2],
        }
    ]
    resumed = UpdatePrivacy(_dp(clipping="adaptive", noise_multiplier=0.2, clipped_count_stddev=0.2), 2, 2)
    resumed.replay(records, journal)
    assert resumed.ledger.events == [(2.0, 2), (4.0, 2), (2.0, 2)] and resumed.clipping_norm == 0.7
    older = UpdatePrivacy(_dp(clipping="adaptive", noise_multiplier=0.2, clipped_count_stddev=0.2), 2, 2)
    older.replay(records, tmp_path / "absent.jsonl")  # a run folder from before the journal: its records...
    assert older.ledger.events == [(2.0, 2), (4.0, 2)]
    assert read_journal(tmp_path / "absent.jsonl") == [(2.0, 2), (4.0, 2)]  # ...start the journal, for the next resume


def test_a_release_without_noise_makes_epsilon_infinite_and_none_spends_nothing():
    ledger = PrivacyLedger(1e-5, 3)
    assert ledger.epsilon == 0.0
    ledger.compose(1.0, 3)
    ledger.compose(0.0, 3)
    assert ledger.epsilon == math.inf and ledger.summary()["epsilon"] is None


# ---------------------------------------------------------------------------------------------
# Bad values, refused before round 1 and naming the key
# ---------------------------------------------------------------------------------------------

ON = {"privacy.clipping": "fixed"}


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


def test_adaptive_noise_beyond_what_the_count_noise_allows_is_refused_before_round_1():
    # Flower: z must be < 2 σ_b; σ_b defaults to m/20 = 0.15 for 3 clients.
    cfg = parse_run_config({"privacy.clipping": "adaptive", "privacy.noise-multiplier": 0.5})
    with pytest.raises(ConfigError, match="'privacy.noise-multiplier' = 0.5.*'privacy.clipped-count-stddev'"):
        make_strategy(cfg.strategy, num_clients=3, privacy=cfg.privacy)


# ---------------------------------------------------------------------------------------------
# Whole runs: ε in the record, the stream and the summary; resume
# ---------------------------------------------------------------------------------------------

RUN = {
    **TINY_RUN,
    "strategy.name": "fedtops",
    "privacy.clipping": "fixed",
    "privacy.clip-norm": 0.05,  # the tiny clients' updates have norms 0.1-0.35: every one is clipped
    "privacy.noise-multiplier": 2.0,
    "privacy.score-noise": 4.0,
}


def _records(run):
    return [json.loads(line) for line in (run / "rounds.jsonl").read_text().splitlines()]


def _expected_epsilon(rounds: int, delta: float = 1e-5) -> float:
    """Google's dp-accounting directly: per round one Gaussian of z = 2 and one of σ_s = 4."""
    import dp_accounting

    accountant = dp_accounting.rdp.RdpAccountant()
    for _ in range(rounds):
        accountant.compose(dp_accounting.GaussianDpEvent(2.0))
        accountant.compose(dp_accounting.GaussianDpEvent(4.0))
    return accountant.get_epsilon(delta)


@pytest.mark.slow
@pytest.mark.parametrize("side", ["server", "client"])
def test_a_private_fedtops_run_reports_epsilon_every_round(side, tmp_path, caplog):
    from server_app.inprocess import run_in_process

    caplog.set_level("INFO")
    run = run_in_process({**RUN, "num-server-rounds": 2, "privacy.side": side, "output-dir": str(tmp_path)}, num_clients=2)
    records = [r for r in _records(run) if r["round"] > 0]
    for t, r in enumerate(records, 1):
        assert r["privacy"]["epsilon"] == pytest.approx(_expected_epsilon(t), rel=1e-6)
        assert r["privacy"]["releases"] == 2 * t and r["privacy"]["delta"] == 1e-5
        assert r["candidates"] and "num-feasible" in r  # FedTOPS scored and selected
        assert not r["excluded"]  # client side: every update came back within C
        seen = r["privacy"]["update-norm-median"]  # server side: before clipping; client side: as the mod clipped it
        assert seen > 0.05 if side == "server" else seen <= 0.05 * (1 + 1e-5)
    stream = caplog.text
    # z = 2 and σ_s = 4 compose to one Gaussian of (1/4 + 1/16)^-1/2 = 1.789 per round
    assert "accounted at δ = 1e-05 as one Gaussian of multiplier 1.789 per round" in stream
    assert "round 2/2 [fedtops]" in stream and f"ε = {_expected_epsilon(2):.3g} (δ = 1e-05)" in stream
    assert f"differential privacy: ε = {_expected_epsilon(2):.3g} at δ = 1e-05 after 4 Gaussian releases in 2 rounds" in stream


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
    accountant.compose(dp_accounting.GaussianDpEvent(0.2), 2)
    assert second["privacy"]["epsilon"] == pytest.approx(accountant.get_epsilon(1e-5), rel=1e-6)
    assert second["privacy"]["releases"] == 2


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
    assert last["privacy"]["epsilon"] == pytest.approx(_expected_epsilon(3), rel=1e-6)
    assert len((run / "privacy-ledger.jsonl").read_text().splitlines()) == 6
    with open(run / "privacy-ledger.jsonl", "a") as f:
        f.write("edited by hand\n")
    with pytest.raises(ConfigError, match="'resume-from' = .*: its privacy account cannot be read: .*line 7: not a privacy release"):
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
