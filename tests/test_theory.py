"""The paper's solvable construction reproduces its table, clock derivatives and scaling scores."""

import pytest
from precision import U64

from eval.theory import clock_derivatives, construction_scores, main, safe_multiplier_bound, scaled_score

# Paper, App. "Numerical illustration", Table 'construction'.
TABLE = {
    0.02: {"fedavg": 0.281532, "local_mean": 0.311221, "pooled": 0.360625, "swapped": 0.360494},
    0.06: {"fedavg": 0.950782, "local_mean": 0.575594, "pooled": 0.977725, "swapped": 0.977670},
}


@pytest.mark.parametrize("eta", [0.02, 0.06])
def test_construction_table_to_six_decimals(eta):
    scores = construction_scores(eta)
    for key, value in TABLE[eta].items():
        assert round(scores[key], 6) == value, key


def test_federated_gain_reverses_sign_between_the_two_step_sizes():
    low, high = construction_scores(0.02), construction_scores(0.06)
    assert round(low["fedavg"] - low["local_mean"], 6) == -0.029689
    assert round(high["fedavg"] - high["local_mean"], 6) == 0.375187


@pytest.mark.parametrize("eta, direct, mediated", [(0.02, 8.368607, 19.770051), (0.06, 26.682896, 3.410686)])
def test_clock_derivative_split(eta, direct, mediated):
    d, m = clock_derivatives(eta)
    assert round(d, 6) == direct and round(m, 6) == mediated


def test_clock_derivative_matches_finite_differences_of_the_clock():
    import math

    import numpy as np

    from eval.theory import fedavg_sources, s_factor

    h, w = np.array([1.0, 9.0]), np.array([0.5, 0.5])

    def clock(eta):
        return -sum(math.log(s_factor(eta, u, h, w, 4, 7.25, 2.0)) for u in fedavg_sources(eta, h=h, w=w, E=4, T=5, b=10.0, u0=0.0))

    eps = 1e-6
    numeric = (clock(0.02 + eps) - clock(0.02 - eps)) / (2 * eps)
    # A central difference is off by eps²/6·|C‴| (truncation) + 2·err(C)/(2·eps) (rounding).
    # C‴ from a 5-point stencil at step 1e-4 (its own O(step²) error: 0.2 % here), doubled
    # for safety and for C‴ varying over ±eps; err(C) ≤ 200 float64 roundings of |C| (5 sources,
    # each an erfc, powers and sums over 2 clients, and a log).
    step = 1e-4
    third = (clock(0.02 + 2 * step) - 2 * clock(0.02 + step) + 2 * clock(0.02 - step) - clock(0.02 - 2 * step)) / (2 * step**3)
    tol = 2 * eps**2 / 6 * abs(third) + 200 * U64 * abs(clock(0.02)) / eps
    assert sum(clock_derivatives(0.02)) == pytest.approx(numeric, abs=tol)


def test_safe_scaling_scores():
    assert [round(scaled_score(0.02, a), 6) for a in (1, 2, 3)] == [0.281532, 0.884641, 0.991698]
    # a = 1: the same recurrences written differently (1 − (1 − s) for s, b − (1 − (1 − r))(b − u)
    # for u): a few float64 roundings per round on O(1) quantities, and on u (≤ b = 10) which enters
    # s with gain ηλE·max x·φ(0) ≈ 0.2; over T = 5 rounds and S = 1 − (1 − v)² (factor 2): ≤ 100u.
    assert scaled_score(0.02, 1) == pytest.approx(construction_scores(0.02)["fedavg"], abs=100 * U64)
    assert 3 < safe_multiplier_bound(0.02) < 4


def test_unstable_step_size_is_refused():
    with pytest.raises(ValueError, match="stability condition"):
        construction_scores(0.2)


def test_cli_prints_the_numbers_and_writes_both_figures(tmp_path, capsys):
    assert main(["--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| 0.02 | 0.281532 | 0.311221 | 0.360625 | 0.360494 |" in out
    assert "direct = 26.682896, mediated = 3.410686" in out
    for name in ("sign-reversal.png", "clock-decomposition.png"):
        data = (tmp_path / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
