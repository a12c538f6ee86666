"""Central differential privacy of the released adapters and of FedTOPS's score channel.

The relation, the mechanism and the derivation are in docs/privacy.md. In short:

* **Relation: add-or-remove-one client.** Two federations are neighbours when one has one client
  more, whose data can be anything. Who is asked in each round (the node ids, drawn from the
  run's seed and the connected nodes) is the same in both and is not protected; what a client
  contributes, including whether it contributes at all, is.
* **The update** (the same mechanism whichever side clips): each client's LoRA-factor update
  u_i = θ_{t,i}^+ − θ_t is clipped to L2 norm C (:func:`clipped_increment`, on the server, in
  float64; with ``privacy.side = 'client'`` first on the client, :func:`clip_update`), and the server
  releases θ̃ = θ_t + (1/n)·Σ_i ū_i + N(0, (z·C/n)² I) with **n fixed before the run**
  (:func:`private_denominator`: the clients a round asks when ``num-clients`` are connected). A
  client that is not averaged (it failed, timed out, was refused at the boundary) adds a zero
  update: neither the denominator nor the noise depends on who replied. Removing one client moves
  the sum by at most C: a Gaussian mechanism of multiplier z (:func:`noisy_mean`).
* **Adaptive clipping** (Andrew et al., "Differentially Private Learning with Adaptive
  Clipping", 2021; TensorFlow Privacy's quantile estimator): the count of unclipped updates is
  centred, Σ_i (b_i − ½), so that one client moves it by ½, and released with noise σ_b over the
  same fixed n (:func:`noisy_unclipped_share`, clamped to [0, 1]). It is its own Gaussian release
  of multiplier 2σ_b; the update's multiplier is z_Δ = (z⁻² − (2σ_b)⁻²)^−½ so that the two compose
  to exactly z (:func:`adaptive_multipliers`). C then moves by exp(−η(b̄ − γ)) after the noise.
* **The scores** (FedTOPS): one row (Ĵ_i(a), K̂_i(a) for the k candidates) per client asked in
  the round; a missing or invalid row is replaced by a fixed public row (:func:`public_score_row`);
  each row is clipped to [0, c_J] / [0, c_K] and released with Gaussian noise
  σ_s·√(2k)·c_J / σ_s·√(2k)·c_K: a Gaussian mechanism of multiplier σ_s.
* **Accounting** (:class:`PrivacyLedger`): every release is one Gaussian event of its multiplier
  under add-or-remove-one, without amplification by sampling; ε at δ_DP from Google's
  ``dp-accounting``, both RDP and PLD, and the tighter of the two (both are valid upper bounds) is
  the run's ε and what ``privacy.max-epsilon`` is checked against before each round.

The noise is drawn from a NumPy generator seeded from the operating system's entropy, never from
the run's ``seed``: a seed in ``config.json`` would let anyone subtract it. DP runs are therefore
not bit-for-bit reproducible.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import ConfigRecord
from flwr.supercore.differential_privacy import KEY_CLIPPING_NORM, KEY_NORM_BIT

from fedopd.core.errors import ConfigError
from fedopd.core.settings import PrivacySettings
from fedopd.core.strategies import clients_per_round
from fedopd.models.lora import Named
from fedtops_strategy.bounds import update_norm

# The run folder's journal of every release, written before the release leaves the server.
JOURNAL = "privacy-ledger.jsonl"

# The train config key that tells the ClientApp's clipping mod to clip and which kind
# (client_app/app.py); Flower's own KEY_CLIPPING_NORM carries C, and KEY_NORM_BIT (1: clipped)
# carries adaptive clipping's bit back.
KEY_CLIPPING_MODE = "privacy-clipping"
FP32_EPS = float(np.finfo(np.float32).eps)

# dp-accounting's PLD grid: 1e-3 nats, coarser for large ε so that its size stays bounded (the
# pessimistic PLD stays an upper bound at any spacing; at ε·1e-4 it is within 0.01 % of ε).
PLD_INTERVAL = 1e-3
PLD_RELATIVE_INTERVAL = 1e-4


class PrivacyBudgetSpent(RuntimeError):
    """A release would take ε beyond ``privacy.max-epsilon``; the message says which and by how much."""


# ---------------------------------------------------------------------------------------------
# The mechanism: small pure functions
# ---------------------------------------------------------------------------------------------


def private_denominator(num_clients: int, fraction_train: float, min_train_clients: int) -> int:
    """n, the fixed public denominator of the private mean: the clients a round asks when the
    declared ``num_clients`` are connected (Flower's FedAvg sample size,
    :func:`fedopd.core.strategies.clients_per_round`; never a count of who connected or replied)."""
    return clients_per_round(num_clients, fraction_train, min_train_clients)


def clip_update(theta: Named, arrays: Named, clip_norm: float, norm: float | None = None) -> tuple[Named, bool]:
    """(θ_t + min(1, C/‖u‖)·u with u = arrays − θ_t, whether it was clipped), in fp32: what a
    client sends (the ClientApp's mod; the server clips again, :func:`clipped_increment`). A zero
    update (‖u‖ = 0) is kept as it is: a client that returns θ_t unchanged sends a valid update
    (Flower's ``compute_clip_model_update`` divides by ‖u‖, flwrlabs/flower#7631)."""
    norm = update_norm(theta, arrays) if norm is None else norm
    if not norm > clip_norm:  # 0 included
        return {k: np.asarray(v, np.float32) for k, v in arrays.items()}, False
    scale = clip_norm / norm
    out = {}
    for k, t in theta.items():
        t64 = np.asarray(t, np.float64)
        out[k] = (t64 + (np.asarray(arrays[k], np.float64) - t64) * scale).astype(np.float32)
    return out, True


def clipped_increment(theta: Named, arrays: Named, clip_norm: float, norm: float | None = None) -> tuple[dict[str, np.ndarray], bool]:
    """(ū = u·min(1, C/‖u‖) with u = arrays − θ_t, in float64, whether it was clipped): the
    server's clip. Kept in float64 until the noise is added, so that ‖ū‖ ≤ C up to float64
    rounding: re-forming ū from an fp32 θ_t + ū would round each entry by up to half an fp32 ulp of
    θ_t, which a client can align with its update (with C ≲ 1e-5·‖θ_t‖ that doubled the
    sensitivity). A zero update stays 0."""
    u = {k: np.asarray(arrays[k], np.float64) - np.asarray(t, np.float64) for k, t in theta.items()}
    norm = math.sqrt(sum(float(np.sum(v * v)) for v in u.values())) if norm is None else norm
    if not norm > clip_norm:  # 0 included
        return u, False
    scale = clip_norm / norm
    return {k: v * scale for k, v in u.items()}, True


def noisy_mean(theta: Named, increments: Sequence[Mapping[str, np.ndarray]], denominator: int, std: float, rng: np.random.Generator) -> Named:
    """θ_t + (1/n)·Σ_i ū_i + N(0, std² I), in float64, returned as fp32 arrays (rounding the
    released value is post-processing).

    ``increments`` holds the clipped ū_i (float64) of the updates averaged (at most n; the
    others add 0); ``denominator`` is n, ``std`` the noise's standard deviation (z·C/n)."""
    out = {}
    for k, t in theta.items():
        t64 = np.asarray(t, np.float64)
        total = np.zeros_like(t64)
        for u in increments:
            total += u[k]
        noise = rng.normal(0.0, std, size=t64.shape) if std > 0 else 0.0
        out[k] = (t64 + total / denominator + noise).astype(np.float32)
    return out


def noisy_unclipped_share(unclipped: Sequence[bool], denominator: int, count_std: float, rng: np.random.Generator) -> float:
    """b̄ = ½ + (Σ_i (b_i − ½) + N(0, σ_b²)) / n, clamped to [0, 1]: the noisy share of updates
    under C (b_i = 1: not clipped). Centred, one client moves the sum by ½ whether it is added
    or removed; a client not averaged adds 0 (TensorFlow Privacy's quantile estimator)."""
    centred = sum(1.0 if b else 0.0 for b in unclipped) - 0.5 * len(unclipped)
    noise = float(rng.normal(0.0, count_std)) if count_std > 0 else 0.0
    return min(1.0, max(0.0, 0.5 + (centred + noise) / denominator))


def next_clip_norm(clip_norm: float, unclipped_share: float, target: float, lr: float) -> float:
    """C·exp(−η(b̄ − γ)) (Andrew et al.): C grows when fewer than the target share γ fall under it."""
    return clip_norm * math.exp(-lr * (unclipped_share - target))


def count_stddev(settings: PrivacySettings, denominator: int) -> float:
    """σ_b, the noise on adaptive clipping's centred count: ``privacy.clipped-count-stddev``, or
    n/20 when 0 (Andrew et al.'s choice, Flower's default)."""
    return settings.clipped_count_stddev or denominator / 20


def adaptive_multipliers(z: float, count_std: float) -> tuple[float, float]:
    """(z_Δ, z_b): the multipliers of the update and of the centred count (sensitivity ½, noise
    σ_b: z_b = 2σ_b), with z_Δ⁻² + z_b⁻² = z⁻², so that the round's two releases are exactly one
    Gaussian of multiplier z. Needs z < 2σ_b (ValueError otherwise); z = 0: no noise on either."""
    if z <= 0:
        return 0.0, 0.0
    z_count = 2.0 * count_std
    if not z < z_count:
        raise ValueError(f"noise multiplier z = {z:g} needs the count's noise σ_b > z/2 = {z / 2:g}, got σ_b = {count_std:g}")
    return (z**-2 - z_count**-2) ** -0.5, z_count


def score_noise_stds(num_candidates: int, score_noise: float, teacher_max: float, change_max: float) -> tuple[float, float]:
    """(std on each Ĵ_i(a), std on each K̂_i(a)): σ_s·√(2k)·c_J and σ_s·√(2k)·c_K.

    One client's data changes only its own row of 2k clipped values, each by at most its range:
    an L2 change of √(2k) when every value is measured in its own range (docs/privacy.md)."""
    scale = score_noise * math.sqrt(2 * num_candidates)
    return scale * teacher_max, scale * change_max


def clip_scores(values: Sequence[float], upper: float) -> np.ndarray:
    """``values`` clipped to [0, upper]; a non-finite value (an infeasible candidate) becomes ``upper``."""
    out = np.array([upper if not math.isfinite(v) else v for v in values], dtype=np.float64)
    return np.clip(out, 0.0, upper)


def public_score_row(candidates: Sequence[float], change_max: float) -> tuple[list[float], list[float]]:
    """The row released for a client asked in the round whose valid scores did not arrive: Ĵ = 0
    at every candidate (a constant moves the mean Ĵ of every candidate alike) and K̂ = 0 for
    a ≤ 1, c_K above (its trust constraint is unknown: feasible up to FedAvg's step, the cap
    the SPEC sets without privacy). It is public and fixed, so it says nothing of that client."""
    return [0.0] * len(candidates), [0.0 if a <= 1.0 else change_max for a in candidates]


def privatize_scores(
    teacher: Sequence[float], change: Sequence[float], settings: PrivacySettings, rng: np.random.Generator
) -> tuple[list[float], list[float]]:
    """One client's (Ĵ_i, K̂_i) as released: clipped to their ranges, plus Gaussian noise of
    :func:`score_noise_stds` (none when ``privacy.score-noise`` = 0)."""
    std_j, std_k = score_noise_stds(len(teacher), settings.score_noise, settings.teacher_score_max, settings.change_score_max)
    j = clip_scores(teacher, settings.teacher_score_max)
    k = clip_scores(change, settings.change_score_max)
    if settings.score_noise > 0:
        j = j + rng.normal(0.0, std_j, size=j.shape)
        k = k + rng.normal(0.0, std_k, size=k.shape)
    return j.tolist(), k.tolist()


def combined_multiplier(multipliers: Iterable[float]) -> float:
    """The one Gaussian multiplier that Gaussian releases on the same data compose to,
    (Σ z_i⁻²)^−½: exact, since their privacy-loss distributions are Gaussian (0 if any is 0)."""
    zs = list(multipliers)
    if any(z <= 0 for z in zs):
        return 0.0
    return sum(z**-2 for z in zs) ** -0.5 if zs else math.inf


def gaussian_epsilons(multiplier: float, delta: float) -> dict[str, float]:
    """ε at ``delta`` of one Gaussian mechanism of ``multiplier`` under add-or-remove-one, from
    dp-accounting's RDP accountant and its PLD accountant (``rdp``, ``pld``): inf for 0, 0 for inf."""
    if multiplier <= 0:
        return {"rdp": math.inf, "pld": math.inf}
    if math.isinf(multiplier):
        return {"rdp": 0.0, "pld": 0.0}
    import dp_accounting
    from dp_accounting.pld import pld_privacy_accountant
    from dp_accounting.rdp import rdp_privacy_accountant

    relation = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
    event = dp_accounting.GaussianDpEvent(multiplier)
    rdp = rdp_privacy_accountant.RdpAccountant(neighboring_relation=relation)
    rdp.compose(event)
    eps_rdp = float(rdp.get_epsilon(delta))
    interval = max(PLD_INTERVAL, eps_rdp * PLD_RELATIVE_INTERVAL)
    pld = pld_privacy_accountant.PLDAccountant(relation, value_discretization_interval=interval)
    pld.compose(event)
    return {"rdp": eps_rdp, "pld": float(pld.get_epsilon(delta))}


# ---------------------------------------------------------------------------------------------
# The account
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Release:
    """One Gaussian release: what it was (``round 3 update``) and its noise multiplier."""

    what: str
    noise_multiplier: float


class PrivacyLedger:
    """The run's privacy spent: one Gaussian event per release, add-or-remove-one, no
    amplification by sampling (docs/privacy.md says why).

    ε is the tighter of dp-accounting's RDP and PLD bounds for the composition (the releases are
    Gaussian, so they compose exactly to one of :func:`combined_multiplier`). A release with
    multiplier 0 is not private: ε is infinite from then on. With :attr:`journal` set (the run
    folder's :data:`JOURNAL`), every release is appended there, and flushed to disk, before it
    leaves the server. With ``max_epsilon`` > 0, a release that would take ε beyond it raises
    :class:`PrivacyBudgetSpent` and is neither journalled nor composed.
    """

    def __init__(self, delta: float, max_epsilon: float = 0.0) -> None:
        self.delta = float(delta)
        self.max_epsilon = float(max_epsilon)
        self.events: list[Release] = []
        self.journal: Path | None = None
        self._cache: dict[float, dict[str, float]] = {}

    def epsilons(self, extra: Sequence[float] = ()) -> dict[str, float]:
        """{"rdp", "pld", "epsilon" (the smaller)} after every release so far and ``extra``
        multipliers more (0 releases: all 0; one without noise: all inf)."""
        zs = [e.noise_multiplier for e in self.events] + [float(z) for z in extra]
        if not zs:
            return {"rdp": 0.0, "pld": 0.0, "epsilon": 0.0}
        z = combined_multiplier(zs)
        if z not in self._cache:
            self._cache[z] = gaussian_epsilons(z, self.delta)
        eps = self._cache[z]
        return {**eps, "epsilon": min(eps["rdp"], eps["pld"])}

    @property
    def epsilon(self) -> float:
        """ε at :attr:`delta` after every release so far (inf: one was not private; 0: none yet)."""
        return self.epsilons()["epsilon"]

    def over_budget(self, extra: Sequence[float]) -> str | None:
        """Why releasing ``extra`` multipliers now would exceed ``privacy.max-epsilon``, or None."""
        if not self.max_epsilon:
            return None
        after = self.epsilons(extra)["epsilon"]
        if after <= self.max_epsilon:
            return None
        return (
            f"privacy.max-epsilon = {self.max_epsilon:g}: {len(extra)} more release(s) would take ε at δ = {self.delta:g} "
            f"from {self.epsilon:.4g} to {after:.4g}"
        )

    def compose(self, noise_multiplier: float, what: str = "") -> None:
        """Account one Gaussian release of ``noise_multiplier`` (``what``: the journal's label),
        journalled before it leaves; refused with :class:`PrivacyBudgetSpent` beyond the budget."""
        z = float(noise_multiplier)
        why = self.over_budget([z])
        if why is not None:
            raise PrivacyBudgetSpent(f"{what or 'a release'} refused: {why}")
        if self.journal is not None:
            with open(self.journal, "a", encoding="utf-8") as f:
                f.write(json.dumps({"release": what, "noise-multiplier": z}) + "\n")
                f.flush()
                os.fsync(f.fileno())
        self.events.append(Release(what, z))

    @property
    def releases(self) -> int:
        return len(self.events)

    def summary(self) -> dict[str, Any]:
        """The cumulative fields of a round record's ``privacy`` (an infinite ε as None)."""
        eps = self.epsilons()
        out = {k: (v if math.isfinite(v) else None) for k, v in eps.items()}
        return {"epsilon": out["epsilon"], "epsilon-rdp": out["rdp"], "epsilon-pld": out["pld"], "delta": self.delta, "releases": self.releases}


# ---------------------------------------------------------------------------------------------
# The server's side of it
# ---------------------------------------------------------------------------------------------


class UpdatePrivacy:
    """The private mean of a round's updates, FedTOPS's score channel and the run's ledger.

    :class:`~fedtops_strategy.averaging.PrivateMean` calls :meth:`train_config` when a round is
    configured, :meth:`reply_problem` on each checked train reply, :meth:`release` to average;
    FedTOPS calls :meth:`release_scores`; the ServerApp :meth:`budget_stop` before each round.

    Parameters
    ----------
    settings : PrivacySettings
        ``privacy.*``.
    denominator : int
        n (:func:`private_denominator`), fixed for the run.
    """

    def __init__(self, settings: PrivacySettings, denominator: int) -> None:
        if settings.clipping not in ("fixed", "adaptive") or settings.side not in ("server", "client"):
            raise ValueError(f"privacy.clipping = {settings.clipping!r}, privacy.side = {settings.side!r}: no such mechanism")
        self.settings = settings
        self.client_side = settings.side == "client"
        self.adaptive = settings.clipping == "adaptive"
        self.denominator = int(denominator)
        if self.denominator < 1:
            raise ValueError(f"the private mean's denominator must be >= 1, got {denominator}")
        z = settings.noise_multiplier
        self.count_std = count_stddev(settings, self.denominator) if self.adaptive else 0.0
        if self.adaptive:
            try:
                self.update_multiplier, self.count_multiplier = adaptive_multipliers(z, self.count_std)
            except ValueError as err:
                raise ConfigError(
                    f"run config 'privacy.noise-multiplier' = {z!r} with 'privacy.clipping' = 'adaptive' and {self.denominator} "
                    f"client(s) per round: {err}; allowed: 'privacy.clipped-count-stddev' > 'privacy.noise-multiplier' / 2 "
                    f"(0 means n/20 = {self.denominator / 20:g})"
                ) from None
        else:
            self.update_multiplier, self.count_multiplier = z, 0.0
        self.ledger = PrivacyLedger(settings.delta, settings.max_epsilon)
        self.clipping_norm = float(settings.clip_norm)  # C for the next round (adaptive: moved after every release)
        self.clip_norm_used = self.clipping_norm  # the C of the round last configured

    # -- what a round releases -------------------------------------------------------------------
    def round_multipliers(self, scores: bool) -> list[float]:
        """The multipliers of one round's releases: the update (adaptive: and the count), and the
        scores when the strategy has a score phase. All public: they fix ε's course in advance."""
        out = [self.update_multiplier] + ([self.count_multiplier] if self.adaptive else [])
        return out + ([self.settings.score_noise] if scores else [])

    def budget_stop(self, server_round: int, scores: bool) -> str | None:
        """Why round ``server_round`` must not start (its releases would exceed ``privacy.max-epsilon``), or None."""
        why = self.ledger.over_budget(self.round_multipliers(scores))
        return None if why is None else f"round {server_round} not started: {why}"

    def rounds_within_budget(self, scores: bool, rounds: int) -> int:
        """How many more rounds (at most ``rounds``) fit in ``privacy.max-epsilon`` (``rounds``: no budget)."""
        if not self.settings.max_epsilon:
            return rounds
        per_round = self.round_multipliers(scores)
        lo, hi = 0, rounds  # the largest k with ε(k rounds more) <= max: ε grows with k
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.ledger.over_budget(per_round * mid) is None:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def describe(self, scores: bool) -> str:
        """One line for the run's stream: the mechanism(s), their parameters and what they cost per round."""
        s = self.settings
        parts = [
            f"differential privacy (add-or-remove-one client): {s.clipping} clipping on the {s.side} side, C = {s.clip_norm:g}, "
            f"noise multiplier z = {s.noise_multiplier:g} on the sum of the clipped updates over n = {self.denominator} (fixed)"
        ]
        if self.adaptive:
            parts.append(
                f"the centred count with noise σ_b = {self.count_std:g} (z_Δ = {self.update_multiplier:.4g}, z_b = {self.count_multiplier:.4g})"
            )
        if scores:
            parts.append(
                f"FedTOPS scores clipped to [0, {s.teacher_score_max:g}] / [0, {s.change_score_max:g}] with noise multiplier {s.score_noise:g}"
            )
        z_eff = combined_multiplier(self.round_multipliers(scores))
        per_round = "∞ (a release without noise)" if z_eff == 0 else f"one Gaussian of multiplier {z_eff:.4g} per round"
        budget = f", stopping before ε > {s.max_epsilon:g}" if s.max_epsilon else ""
        parts.append(f"accounted at δ = {s.delta:g} as {per_round}{budget} (docs/privacy.md)")
        return "; ".join(parts)

    # -- the train phase -------------------------------------------------------------------------
    def train_config(self, config: ConfigRecord) -> None:
        """What the train messages carry: client side, C and which clipping the ClientApp's mod does."""
        self.clip_norm_used = self.clipping_norm
        if self.client_side:
            config[KEY_CLIPPING_NORM] = self.clip_norm_used
            config[KEY_CLIPPING_MODE] = self.settings.clipping

    def _rounding(self, theta: Named) -> float:
        """How far an update the client clipped to C can be from norm C once the server re-forms
        it from fp32 θ_t + ū: rounding θ_t + ū and the difference, each ≤ ε/2 per entry, and the
        scaling ≤ ε/2 (docs/privacy.md). Twice that, as a bound that needs no tuning."""
        theta_norm = math.sqrt(sum(float(np.sum(np.square(v, dtype=np.float64))) for v in theta.values()))
        return 2 * FP32_EPS * (theta_norm + 2 * self.clip_norm_used)

    def reply_problem(self, metrics: Mapping[str, Any], theta: Named, arrays: Named) -> str | None:
        """Client-side adaptive clipping: why a reply's norm bit cannot be believed (not 0 or 1; 1,
        clipped, for an update whose norm is below C; 0 for one above C, beyond fp32 rounding), or
        None. A refused reply adds a zero update, like any client that is not averaged."""
        if not (self.client_side and self.adaptive):
            return None
        bit = metrics.get(KEY_NORM_BIT)
        if isinstance(bit, bool) or bit not in (0, 1):
            return f"metric '{KEY_NORM_BIT}' is {bit!r}: client-side adaptive clipping needs 0 or 1 (1: the update was clipped to C)"
        norm, c, tol = update_norm(theta, arrays), self.clip_norm_used, self._rounding(theta)
        if bit == 1 and norm < c - tol:
            return f"its norm bit says its update was clipped to C = {c:.6g}, but the update's norm is {norm:.6g}"
        if bit == 0 and norm > c + tol:
            return f"its norm bit says its update was not clipped, but its norm {norm:.6g} exceeds C = {c:.6g}"
        return None

    def view_metrics(self, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """What a reply's update carries to the average besides its arrays (adaptive client side: the norm bit)."""
        if self.client_side and self.adaptive:
            return {KEY_NORM_BIT: int(metrics[KEY_NORM_BIT])}
        return {}

    def release(
        self, server_round: int, updates: Sequence[Named], bits: Sequence[int | None], theta: Named, rng: np.random.Generator | None = None
    ) -> tuple[Named, dict[str, Any], dict[str, Any]]:
        """(the released adapter θ̃, the round record's ``privacy`` (publishable), its
        ``privacy-diagnostics`` (not private)).

        ``updates`` are the checked replies θ_{t,i}^+ that are averaged, at most n; ``bits`` their
        client-side norm bits (adaptive client side; else None). Each update is clipped at the
        round's C (client side: again); the noisy mean over the fixed n is released, even when
        no update arrived (then it is θ_t plus noise: not releasing would say that none did)."""
        if len(updates) > self.denominator:
            raise ValueError(f"{len(updates)} updates for a private mean over n = {self.denominator}")
        rng = np.random.default_rng() if rng is None else rng  # the OS's entropy
        c = self.clip_norm_used
        norms = [update_norm(theta, u) for u in updates]
        clipped, unclipped = [], []
        for u, n, bit in zip(updates, norms, bits):
            increment, was_clipped = clipped_increment(theta, u, c, n)
            clipped.append(increment)
            # client side, the client's bit (checked in reply_problem); the server's re-clip is
            # fp32 rounding at most
            unclipped.append(not (bit == 1 if (self.client_side and self.adaptive) else was_clipped))
        update_std = self.update_multiplier * c / self.denominator
        self.ledger.compose(self.update_multiplier, f"round {server_round} update")
        mean = noisy_mean(theta, clipped, self.denominator, update_std, rng)
        public: dict[str, Any] = {
            "denominator": self.denominator,
            "clip-norm": c,
            "noise-multiplier": self.settings.noise_multiplier,
            "update-noise-multiplier": self.update_multiplier,
            "update-noise-std": update_std,
        }
        if self.adaptive:
            self.ledger.compose(self.count_multiplier, f"round {server_round} clipped count")
            share = noisy_unclipped_share(unclipped, self.denominator, self.count_std, rng)
            self.clipping_norm = next_clip_norm(c, share, self.settings.target_quantile, self.settings.clip_norm_lr)
            public.update({"count-noise-std": self.count_std, "unclipped-share": share, "next-clip-norm": self.clipping_norm})
        diagnostics = {
            "updates-averaged": len(updates),
            "updates-clipped": sum(1 for u in unclipped if not u),
            "update-norm-median": float(np.median(norms)) if norms else None,
        }
        return mean, public, diagnostics

    # -- the score phase -------------------------------------------------------------------------
    def release_scores(
        self,
        rows: Mapping[int, tuple[Sequence[float], Sequence[float]]],
        asked: Sequence[int],
        candidates: Sequence[float],
        server_round: int = 0,
        rng: np.random.Generator | None = None,
    ) -> tuple[list[tuple[int, list[float], list[float]]], dict[str, Any], list[int]]:
        """(one released row per node in ``asked``, in that order; the record's ``privacy`` fields
        for the scores; the nodes whose row was the public one).

        ``rows`` maps a node to its valid (Ĵ_i, K̂_i); a node of ``asked`` without one gets
        :func:`public_score_row`. Every row is clipped and noised alike, so neither the number of
        rows nor their noise depends on who answered."""
        rng = np.random.default_rng() if rng is None else rng
        s = self.settings
        public = public_score_row(candidates, s.change_score_max)
        filled = [n for n in asked if n not in rows]
        self.ledger.compose(s.score_noise, f"round {server_round} scores")
        out = [(n, *privatize_scores(*(rows[n] if n in rows else public), s, rng)) for n in asked]
        std_j, std_k = score_noise_stds(len(candidates), s.score_noise, s.teacher_score_max, s.change_score_max)
        return out, {"score-noise-multiplier": s.score_noise, "score-noise-std": [std_j, std_k], "score-rows": len(out)}, filled

    # -- resume ----------------------------------------------------------------------------------
    def replay(self, records: Iterable[Mapping[str, Any]], journal: Path) -> None:
        """Resume: account every release in ``journal`` (it also holds those of a round cut off
        before its record, whose noisy values may have reached the clients) and restore C
        (adaptive) from the complete rounds' ``records``. A journal that is missing, unreadable
        or shorter than the records say raises ValueError: the account would be too small."""
        if not journal.is_file():
            raise ValueError(f"{journal} is missing: the releases made so far cannot be accounted")
        entries = read_journal(journal)
        records = list(records)
        recorded = max((int((r.get("privacy") or {}).get("releases", 0)) for r in records), default=0)
        if len(entries) < recorded:
            raise ValueError(f"{journal} holds {len(entries)} release(s), but the round records count {recorded}: it was cut or replaced")
        end_journal_lines(journal)  # the releases from here on, each on a line of its own
        for what, z in entries:
            self.ledger.events.append(Release(what, z))  # already journalled, and spent whatever the budget now says
        for record in records:
            p = record.get("privacy") or {}
            if p.get("next-clip-norm"):
                self.clipping_norm = float(p["next-clip-norm"])


def _release_line(line: str) -> tuple[str, float]:
    """(label, noise multiplier) of one journal line; ValueError (or KeyError, TypeError,
    AttributeError) when it is not a release."""
    entry = json.loads(line)
    z = float(entry["noise-multiplier"])
    if not z >= 0:
        raise ValueError(f"noise multiplier {z}")
    return str(entry.get("release", "")), z


def read_journal(path: Path) -> list[tuple[str, float]]:
    """(label, noise multiplier) of every release in a run folder's :data:`JOURNAL`. A last line
    cut off mid-write is left out (its release had not left the server); any other line that is
    not a release raises ValueError naming the file and line."""
    out = []
    lines = path.read_bytes().decode("utf-8").split("\n")  # at "\n" only, as end_journal_lines splits
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            out.append(_release_line(line))
        except (ValueError, KeyError, TypeError, AttributeError) as err:
            if i == len(lines):  # no newline after it: the write was cut off
                break
            raise ValueError(f"{path}, line {i}: not a privacy release ({err})") from None
    return out


def end_journal_lines(path: Path) -> None:
    """Make a journal whose last write was cut off end with a whole line, so that the releases a
    resume appends start on lines of their own: a cut-off tail that :func:`read_journal` leaves
    out (its release never left the server) is removed; one it counts (only the newline was
    lost) gets its newline. Appending to the cut-off line would have made it, and the release
    appended, one unreadable line, and the next resume would be refused."""
    data = path.read_bytes()
    if not data or data.endswith(b"\n"):
        return
    cut = data.rfind(b"\n") + 1
    try:
        _release_line(data[cut:].decode("utf-8"))
    except (ValueError, KeyError, TypeError, AttributeError):  # UnicodeDecodeError is a ValueError
        with open(path, "r+b") as f:
            f.truncate(cut)
            f.flush()
            os.fsync(f.fileno())
        return
    with open(path, "ab") as f:
        f.write(b"\n")
        f.flush()
        os.fsync(f.fileno())
