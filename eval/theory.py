"""The paper's solvable two-stage Gaussian construction (App. "A solvable on-policy construction").

A prerequisite ability u controls access to the teaching states where a downstream ability v is
learned. Client i (feature x_i, h_i = x_i²) sees the second teaching state with probability
ρ_i(u) = Φ(x_i(u − c)), and its frozen-source loss is h_i(u − b)²/2 + λρ_i(φ_u)(v − 1)²/2.
With E exact local gradient steps of size η per round, every process has closed-form iterates:

* FedAvg:   b − u_{t+1} = r_η (b − u_t),        1 − v_{t+1} = s_η(u_t)(1 − v_t)
* Pooled:   r_η^P = (1 − η h̄)^E,                s_η^P(u) = (1 − ηλρ̄(u))^E
* Local:    each client alone, with its own source
* Swapped:  FedAvg's learner with the pooled process's source schedule u_t^P

with r_η = Σ_i w_i (1 − η h_i)^E and s_η(u) = Σ_i w_i (1 − ηλρ_i(u))^E. Scores are
S(v) = 1 − (1 − v)² on a common downstream teaching state.

``python -m eval.theory`` prints the construction table, the clock derivatives and the
safe-scaling scores, and writes the two figures (``--out``, default ``theory-figures/``).
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np

PAPER_ETAS = (0.02, 0.06)


def score(v: float) -> float:
    """S(v) = 1 − (1 − v)²."""
    return 1.0 - (1.0 - v) ** 2


def _arrays(h, w):
    h = np.asarray(h, dtype=np.float64)
    w = np.asarray(w, dtype=np.float64)
    if h.shape != w.shape or np.any(h <= 0) or not math.isclose(w.sum(), 1.0):
        raise ValueError(f"need positive h and weights summing to 1 of the same length, got h={h}, w={w}")
    return h, w


def normal_cdf(z: np.ndarray) -> np.ndarray:
    """Φ(z), elementwise."""
    return np.array([0.5 * math.erfc(-float(x) / math.sqrt(2.0)) for x in np.ravel(z)]).reshape(np.shape(z))


def normal_pdf(z: np.ndarray) -> np.ndarray:
    """φ(z), elementwise."""
    return np.exp(-0.5 * np.asarray(z, dtype=np.float64) ** 2) / math.sqrt(2.0 * math.pi)


def access(u: float, h: np.ndarray, c: float) -> np.ndarray:
    """ρ_i(u) = Φ(x_i (u − c)) with x_i = √h_i."""
    return normal_cdf(np.sqrt(h) * (u - c))


def _check_stable(eta: float, h: np.ndarray, lam: float) -> None:
    if not 0 < eta * max(h.max(), lam) < 1:
        raise ValueError(f"eta = {eta} violates the stability condition 0 < eta * max(h, lambda) < 1")


def r_factor(eta: float, h: np.ndarray, w: np.ndarray, E: int) -> float:
    return float(np.sum(w * (1 - eta * h) ** E))


def s_factor(eta: float, u: float, h: np.ndarray, w: np.ndarray, E: int, c: float, lam: float) -> float:
    return float(np.sum(w * (1 - eta * lam * access(u, h, c)) ** E))


def fedavg_sources(eta, *, h, w, E, T, b, u0) -> list[float]:
    """u_0^F … u_{T-1}^F: the sources FedAvg generates from."""
    r = r_factor(eta, h, w, E)
    return [b - (b - u0) * r**t for t in range(T)]


def pooled_sources(eta, *, h, w, E, T, b, u0) -> list[float]:
    rp = (1 - eta * float(np.sum(w * h))) ** E
    return [b - (b - u0) * rp**t for t in range(T)]


@dataclass(frozen=True)
class Construction:
    """The construction's parameters; defaults are the paper's numerical illustration."""

    h: Sequence[float] = (1, 9)  # client curvatures h_i = x_i²
    w: Sequence[float] = (0.5, 0.5)  # client weights
    E: int = 4  # local steps per round
    T: int = 5  # rounds
    b: float = 10.0  # prerequisite optimum
    c: float = 7.25  # access threshold
    lam: float = 2.0  # downstream precision λ
    u0: float = 0.0
    v0: float = 0.0


def construction_scores(eta: float, **params) -> dict[str, float]:
    """S(v_T) of FedAvg, the Local mean Σ_i w_i S(v_{i,T}^L), Pooled and source-swapped FedAvg.

    ``params`` override the fields of :class:`Construction`.
    """
    p = Construction(**params)
    h, w, E, T, b, c, lam, u0, v0 = _arrays(p.h, p.w) + (p.E, p.T, p.b, p.c, p.lam, p.u0, p.v0)
    _check_stable(eta, h, lam)
    kw = dict(h=h, w=w, E=E, T=T, b=b, u0=u0)
    u_fed, u_pool = fedavg_sources(eta, **kw), pooled_sources(eta, **kw)

    fed = (1 - v0) * math.prod(s_factor(eta, u, h, w, E, c, lam) for u in u_fed)
    swap = (1 - v0) * math.prod(s_factor(eta, u, h, w, E, c, lam) for u in u_pool)
    rho_bar = lambda u: float(np.sum(w * access(u, h, c)))  # noqa: E731
    pooled = (1 - v0) * math.prod((1 - eta * lam * rho_bar(u)) ** E for u in u_pool)

    local = 0.0
    for hi, wi in zip(h, w):
        ui = [b - (b - u0) * (1 - eta * hi) ** (E * t) for t in range(T)]
        resid = (1 - v0) * math.prod((1 - eta * lam * float(access(u, np.array([hi]), c)[0])) ** E for u in ui)
        local += wi * score(1 - resid)

    return {"fedavg": score(1 - fed), "local_mean": float(local), "pooled": score(1 - pooled), "swapped": score(1 - swap)}


def clock_derivatives(eta: float, **params) -> tuple[float, float]:
    """(direct, mediated) parts of dC_T/dη, the supervision clock's derivative (paper eq. clock).

    direct   = −Σ_t ∂_η log s_η(u) at u = u_t^F (learning on the same prefixes);
    mediated = Σ_t κ_η(u_t^F) du_t^F/dη with κ_η(u) = −∂_u log s_η(u) (accessing other supervision).
    """
    p = Construction(**params)
    h, w, E, T, b, c, lam, u0 = _arrays(p.h, p.w) + (p.E, p.T, p.b, p.c, p.lam, p.u0)
    _check_stable(eta, h, lam)
    x = np.sqrt(h)
    r = r_factor(eta, h, w, E)
    dr = -E * float(np.sum(w * h * (1 - eta * h) ** (E - 1)))
    direct = mediated = 0.0
    for t, u in enumerate(fedavg_sources(eta, h=h, w=w, E=E, T=T, b=b, u0=u0)):
        rho = access(u, h, c)
        s = float(np.sum(w * (1 - eta * lam * rho) ** E))
        direct += E * lam * float(np.sum(w * rho * (1 - eta * lam * rho) ** (E - 1))) / s
        drho = x * normal_pdf(x * (u - c))
        kappa = E * eta * lam * float(np.sum(w * (1 - eta * lam * rho) ** (E - 1) * drho)) / s
        du = -(b - u0) * t * r ** (t - 1) * dr if t > 0 else 0.0
        mediated += kappa * du
    return direct, mediated


def scaled_score(eta: float, a: float, **params) -> float:
    """S(v_T) when every round's FedAvg increment is scaled by a (paper Prop. "safe amplitude")."""
    p = Construction(**params)
    h, w, E, T, b, c, lam, u0, v0 = _arrays(p.h, p.w) + (p.E, p.T, p.b, p.c, p.lam, p.u0, p.v0)
    _check_stable(eta, h, lam)
    r = r_factor(eta, h, w, E)
    u, resid = u0, 1 - v0
    for _ in range(T):
        s = s_factor(eta, u, h, w, E, c, lam)
        u = b - (1 - a * (1 - r)) * (b - u)
        resid *= 1 - a * (1 - s)
    return score(1 - resid)


def safe_multiplier_bound(eta: float, **params) -> float:
    """a_max = min{1/(1 − r_η), 1/(1 − (1 − ηλ)^E)}: scaling by a ∈ [1, a_max] never overshoots."""
    p = Construction(**params)
    h, w = _arrays(p.h, p.w)
    return min(1 / (1 - r_factor(eta, h, w, p.E)), 1 / (1 - (1 - eta * p.lam) ** p.E))


# ---------------------------------------------------------------------------------------------
# Table and figures
# ---------------------------------------------------------------------------------------------


def construction_table(etas: Sequence[float] = PAPER_ETAS) -> str:
    lines = ["| eta | FedAvg | Local mean | Pooled | Source-swapped FedAvg |", "|---:|---:|---:|---:|---:|"]
    for eta in etas:
        s = construction_scores(eta)
        lines.append(f"| {eta:g} | {s['fedavg']:.6f} | {s['local_mean']:.6f} | {s['pooled']:.6f} | {s['swapped']:.6f} |")
    return "\n".join(lines)


def max_stable_eta(h=(1, 9), lam: float = 2.0) -> float:
    return 1.0 / max(max(h), lam)


def plot_sign_reversal(path: Path, marks: Sequence[float] = PAPER_ETAS) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    etas = np.linspace(0.002, max_stable_eta() * 0.999, 300)
    curves = {k: [] for k in ("fedavg", "local_mean", "pooled", "swapped")}
    for eta in etas:
        for k, v in construction_scores(float(eta)).items():
            curves[k].append(v)
    labels = {"fedavg": "FedAvg", "local_mean": "Local mean", "pooled": "Pooled", "swapped": "Source-swapped FedAvg"}
    styles = {"fedavg": "-", "local_mean": "--", "swapped": "-."}
    fig, ax = plt.subplots(figsize=(6, 4))
    for k, ys in curves.items():
        # Pooled and source-swapped nearly coincide: draw pooled wide and light underneath.
        wide = dict(lw=5, alpha=0.35, zorder=1) if k == "pooled" else dict(zorder=2)
        ax.plot(etas, ys, "-" if k == "pooled" else styles[k], label=labels[k], **wide)
    for eta in marks:
        ax.axvline(eta, color="grey", lw=0.8, alpha=0.7)
        ax.text(eta, 0.02, f" η={eta:g}", rotation=90, va="bottom", color="grey")
    ax.set_xlabel("step size η")
    ax.set_ylabel("score S(v_T)")
    ax.set_title("Sign reversal with stable updates (exact recurrences)")
    ax.set_ylim(0, 1.02)
    ax.legend(loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=150)
    plt.close(fig)
    return path


def plot_clock(path: Path, marks: Sequence[float] = PAPER_ETAS) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    etas = np.linspace(0.002, max_stable_eta() * 0.999, 300)
    parts = np.array([clock_derivatives(float(eta)) for eta in etas])
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(etas, parts[:, 0], label="direct: learning on the same prefixes")
    ax.plot(etas, parts[:, 1], "--", label="mediated: accessing different supervision")
    for eta in marks:
        ax.axvline(eta, color="grey", lw=0.8, alpha=0.7)
    ax.set_xlabel("step size η")
    ax.set_ylabel("dC_T/dη contribution")
    ax.set_title("Two contributions to step-size sensitivity")
    ax.legend()
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=150)
    plt.close(fig)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="The paper's solvable construction: table, derivatives, figures.")
    parser.add_argument("--out", type=Path, default=Path("theory-figures"), help="folder for the PNG figures")
    args = parser.parse_args(argv)

    print("Construction scores S(v_T) (paper Table 'construction'):\n")
    print(construction_table())
    for eta in PAPER_ETAS:
        s = construction_scores(eta)
        print(f"\nη = {eta:g}: federated gain over Local mean = {s['fedavg'] - s['local_mean']:+.6f}")
        d, m = clock_derivatives(eta)
        print(f"η = {eta:g}: clock derivative direct = {d:.6f}, mediated = {m:.6f}")
    eta = PAPER_ETAS[0]
    scaled = ", ".join(f"a={a:g}: {scaled_score(eta, a):.6f}" for a in (1, 2, 3))
    print(f"\nSafe scaling at η = {eta:g} (a_max = {safe_multiplier_bound(eta):.4f}): {scaled}")
    a = plot_sign_reversal(args.out / "sign-reversal.png")
    b = plot_clock(args.out / "clock-decomposition.png")
    print(f"\nFigures: {a}, {b}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
