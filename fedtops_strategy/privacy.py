"""Central differential privacy of the released adapters and of FedTOPS's score channel.

The derivation (what one client's data can change, the noise, the composition) is in
docs/privacy.md. In short, per round t with m screened updates:

* **The update** (Flower's own wrappers): each client's LoRA-factor update θ_{t,i}^+ − θ_t is
  clipped to L2 norm C (on the server, or on the client by Flower's clipping mod), the m clipped
  updates are averaged with equal weights by Flower's ``FedAvg``, and Gaussian noise of std
  z·C/m is added to the mean (``DifferentialPrivacy{Server,Client}Side{Fixed,Adaptive}Clipping``).
  The wrapper wraps the *averaging step* of the chosen strategy, after reply screening: FedAvg
  moves to the noisy mean, fixed a moves a times along it, and FedTOPS scores and selects along it
  (its Δ_t is the noisy mean − θ_t). All of that is post-processing of one Gaussian release.
* **The scores** (FedTOPS, written here): each scored client's Ĵ_i(a) and K̂_i(a), for the k
  candidates, are clipped to [0, c_J] and [0, c_K] and Gaussian noise of std σ_s·√(2k)·c is
  added to each: one client's data moves its 2k values by at most one range each, an L2 distance
  of √(2k) in range units. The selection rule then runs unchanged on the noisy scores.
* **Accounting**: Flower's :class:`~flwr.supercore.privacy_accounting.RdpAccountant` (Google's
  ``dp-accounting``) composes one Gaussian event per release (the update: z; the scores: σ_s) with
  the add-or-remove-one relation and no subsampling amplification, and reports ε at δ_DP.

The noise is drawn from the operating system's entropy, never from the run's ``seed``: a seed in
``config.json`` would let anyone subtract it. DP runs are therefore not bit-for-bit reproducible.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp.strategy import (
    DifferentialPrivacyClientSideAdaptiveClipping,
    DifferentialPrivacyClientSideFixedClipping,
    DifferentialPrivacyServerSideAdaptiveClipping,
    DifferentialPrivacyServerSideFixedClipping,
    FedAvg,
)
from flwr.supercore.differential_privacy import KEY_CLIPPING_NORM, KEY_NORM_BIT
from flwr.supercore.privacy_accounting import (
    GaussianPrivacyEvent,
    NeighboringRelation,
    PrivacyConfig,
    SamplingMethod,
)
from flwr.supercore.privacy_accounting.rdp_accountant import RdpAccountant

from fedopd.core.errors import ConfigError
from fedopd.core.settings import PrivacySettings
from fedopd.models.lora import Named, from_record
from fedtops_strategy.bounds import update_norm

# The run folder's journal of every release, written before the release leaves the server.
JOURNAL = "privacy-ledger.jsonl"

# The train config key that tells the ClientApp's clipping mod which of Flower's mods to run
# (client_app/app.py); Flower's own KEY_CLIPPING_NORM carries C.
KEY_CLIPPING_MODE = "privacy-clipping"
FP32_EPS = float(np.finfo(np.float32).eps)


class _AdaptiveClipping:
    """Andrew et al.'s adaptive clipping ("Differentially Private Learning with Adaptive
    Clipping", 2021) on Flower 1.41's wrappers, with two of their steps corrected:

    * the direction: the paper moves C by exp(−η (b̄ − γ)) with b̄ the noisy share of updates
      *under* C and γ the target share under it. Flower's norm bit is 1 for a *clipped* update, and
      its wrappers put that share in the same formula, so C shrinks when most updates are clipped
      and grows when none is: away from the target, towards 0 or without bound;
    * the order: Flower moves C *before* it adds the noise, so the noise is scaled to the next
      round's C, not the C the updates were clipped to (when C shrinks, less noise than z·C/m).

    Here the wrapper's step is deferred until after the noise and applied with b̄ = 1 − the noisy
    clipped share."""

    def _geometric_update(self, clipped_fraction: float) -> None:
        self._pending_fraction = clipped_fraction

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):
        self._pending_fraction = None
        arrays, metrics = super().aggregate_train(server_round, replies)
        if self._pending_fraction is not None:
            unclipped = 1.0 - self._pending_fraction
            self.clipping_norm *= math.exp(-self.clip_norm_lr * (unclipped - self.target_clipped_quantile))
        return arrays, metrics


class ServerSideAdaptiveClipping(_AdaptiveClipping, DifferentialPrivacyServerSideAdaptiveClipping):
    pass


class ClientSideAdaptiveClipping(_AdaptiveClipping, DifferentialPrivacyClientSideAdaptiveClipping):
    pass


WRAPPERS = {
    ("fixed", "server"): DifferentialPrivacyServerSideFixedClipping,
    ("fixed", "client"): DifferentialPrivacyClientSideFixedClipping,
    ("adaptive", "server"): ServerSideAdaptiveClipping,
    ("adaptive", "client"): ClientSideAdaptiveClipping,
}


@contextlib.contextmanager
def fresh_numpy_entropy() -> Iterator[None]:
    """NumPy's global generator (which Flower's wrappers draw their noise from) seeded from the
    OS's entropy for the block, then put back as it was: no seed the server or a library set
    before can predict the noise, and nothing else's random stream moves."""
    state = np.random.get_state()
    np.random.seed()
    try:
        yield
    finally:
        np.random.set_state(state)


def score_noise_stds(num_candidates: int, score_noise: float, teacher_max: float, change_max: float) -> tuple[float, float]:
    """(std on each Ĵ_i(a), std on each K̂_i(a)): σ_s·√(2k)·c_J and σ_s·√(2k)·c_K.

    One client's data changes only its own 2k clipped values, each by at most its range: an L2
    change of √(2k) when every value is measured in its own range (docs/privacy.md)."""
    scale = score_noise * math.sqrt(2 * num_candidates)
    return scale * teacher_max, scale * change_max


def clip_scores(values: Sequence[float], upper: float) -> np.ndarray:
    """``values`` clipped to [0, upper]; a non-finite value (an infeasible candidate) becomes ``upper``."""
    out = np.array([upper if not math.isfinite(v) else v for v in values], dtype=np.float64)
    return np.clip(out, 0.0, upper)


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


def _combined(*multipliers: float) -> float:
    """The one Gaussian multiplier that several on the same data compose to: (Σ z_i^-2)^-1/2 (0 if any is 0)."""
    if any(z <= 0 for z in multipliers):
        return 0.0
    return sum(z**-2 for z in multipliers) ** -0.5


class PrivacyLedger:
    """The run's privacy spent: Flower's RDP accountant, one Gaussian event per release.

    Add-or-remove-one client (zero-out: a client's clipped update and scores replaced by zeros),
    no amplification by subsampling (docs/privacy.md says why). A release with noise multiplier 0
    is not private: ε is infinite from then on. With :attr:`journal` set (the run folder's
    :data:`JOURNAL`), every release is also appended there, and flushed to disk, before it leaves
    the server: a resume counts the releases of a round that was cut off before its record.
    """

    def __init__(self, delta: float, population: int) -> None:
        self.delta = float(delta)
        self.population = max(1, int(population))
        self.events: list[tuple[float, int]] = []  # (noise multiplier, clients) of every release
        self.accountant = self._accountant()
        self.journal: Path | None = None

    def _accountant(self) -> RdpAccountant:
        config = PrivacyConfig(
            target_delta=self.delta,
            population_size=self.population,
            neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
            sampling_method=SamplingMethod.NO_AMPLIFICATION,
        )
        accountant = RdpAccountant(config)
        for z, m in self.events:
            if z > 0:
                accountant.compose(GaussianPrivacyEvent(noise_multiplier=z, sample_size=m, population_size=self.population))
        return accountant

    def compose(self, noise_multiplier: float, sample_size: int, what: str = "") -> None:
        """Account one Gaussian release with ``noise_multiplier`` over ``sample_size`` clients
        (``what``: a label for the journal, e.g. ``round 3 update``)."""
        z, m = float(noise_multiplier), max(1, int(sample_size))
        if self.journal is not None:
            with open(self.journal, "a", encoding="utf-8") as f:
                f.write(json.dumps({"release": what, "noise-multiplier": z, "clients": m}) + "\n")
                f.flush()
                os.fsync(f.fileno())
        self.events.append((z, m))
        if m > self.population:  # more nodes than the run was sized for: the metadata's population grows
            self.population = m
            self.accountant = self._accountant()
        elif z > 0:
            self.accountant.compose(GaussianPrivacyEvent(noise_multiplier=z, sample_size=m, population_size=self.population))

    @property
    def releases(self) -> int:
        return len(self.events)

    @property
    def unbounded(self) -> bool:
        """Whether a release without noise happened (ε infinite)."""
        return any(z <= 0 for z, _ in self.events)

    @property
    def epsilon(self) -> float:
        """ε at :attr:`delta` after every release so far (inf: one was not private; 0: none yet)."""
        if self.unbounded:
            return math.inf
        if self.accountant.num_releases == 0:
            return 0.0
        return float(self.accountant.get_epsilon(self.delta))

    def summary(self) -> dict[str, Any]:
        """The cumulative fields of a round record's ``privacy`` (ε None when infinite)."""
        eps = self.epsilon
        return {"epsilon": eps if math.isfinite(eps) else None, "delta": self.delta, "releases": self.releases}


class UpdatePrivacy:
    """Flower's DP wrapper around the equal-weight FedAvg mean of the screened updates, with the
    run's :class:`PrivacyLedger` and the score channel's settings.

    :class:`~fedtops_strategy.screening.ReplyScreening` calls it: :meth:`train_config` when it
    configures a round, :meth:`reply_problem` on each train reply (client side: the norm the
    client was asked to clip to, and the norm bit of adaptive clipping), :meth:`release` to average.
    """

    def __init__(self, settings: PrivacySettings, num_sampled: int, population: int) -> None:
        if settings.clipping not in ("fixed", "adaptive") or (settings.clipping, settings.side) not in WRAPPERS:
            raise ValueError(f"privacy.clipping = {settings.clipping!r}, privacy.side = {settings.side!r}: no such DP wrapper")
        self.settings = settings
        self.client_side = settings.side == "client"
        # Server side, the app clips each update itself (clip_update: Flower's clipping divides by
        # the update's norm, so a zero update, θ_t sent back unchanged, raised ZeroDivisionError
        # and ended the run); the clipped updates then go through the client-side wrapper of the
        # same kind, which averages and adds the same noise z·C/m (adaptive: with the norm bits
        # the app computed). Client side, the clients' mod clipped them.
        wrapper = WRAPPERS[(settings.clipping, "client")]
        num_sampled = max(1, int(num_sampled))
        try:
            if settings.clipping == "fixed":
                self.wrapper = wrapper(FedAvg(), settings.noise_multiplier, settings.clip_norm, num_sampled)
            else:
                self.wrapper = wrapper(
                    FedAvg(),
                    settings.noise_multiplier,
                    num_sampled,
                    initial_clipping_norm=settings.clip_norm,
                    target_clipped_quantile=settings.target_quantile,
                    clip_norm_lr=settings.clip_norm_lr,
                    clipped_count_stddev=settings.clipped_count_stddev or None,
                )
        except ValueError as err:  # Flower's own checks, e.g. adaptive z >= 2 × the count's noise
            raise ConfigError(
                f"run config 'privacy.noise-multiplier' = {settings.noise_multiplier!r} with 'privacy.clipping' = "
                f"{settings.clipping!r} and {num_sampled} client(s) per round: {err}; allowed: adaptive clipping "
                f"needs 'privacy.clipped-count-stddev' > 'privacy.noise-multiplier' / 2"
            ) from None
        self.ledger = PrivacyLedger(settings.delta, population)
        self.clip_norm_used = self.clipping_norm  # the C of the round last configured

    def describe(self, scores: bool) -> str:
        """One line for the run's stream: the mechanism(s), their parameters and what they cost per round."""
        s = self.settings
        z_eff = _combined(s.noise_multiplier, s.score_noise) if scores else s.noise_multiplier
        parts = [
            f"differential privacy: {s.clipping} clipping on the {s.side} side, C = {s.clip_norm:g}, noise multiplier z = {s.noise_multiplier:g}"
        ]
        if scores:
            parts.append(
                f"FedTOPS scores clipped to [0, {s.teacher_score_max:g}] / [0, {s.change_score_max:g}] with noise multiplier {s.score_noise:g}"
            )
        per_round = "∞ (a release without noise)" if z_eff == 0 else f"one Gaussian of multiplier {z_eff:.4g} per round"
        parts.append(f"accounted at δ = {s.delta:g} as {per_round} (docs/privacy.md)")
        return "; ".join(parts)

    @property
    def clipping_norm(self) -> float:
        """C for the next round (adaptive: moved after every release)."""
        return float(self.wrapper.clipping_norm)

    @clipping_norm.setter
    def clipping_norm(self, value: float) -> None:
        self.wrapper.clipping_norm = float(value)

    def train_config(self, config: ConfigRecord) -> None:
        """What the train messages carry: client side, C and which of Flower's mods clips."""
        self.clip_norm_used = self.clipping_norm
        if self.client_side:
            config[KEY_CLIPPING_NORM] = self.clip_norm_used
            config[KEY_CLIPPING_MODE] = self.settings.clipping

    def reply_problem(self, metrics: Mapping[str, Any], theta: Named, arrays: Named) -> str | None:
        """Client side: why a screened reply cannot join the private mean (its update is longer
        than the C it was sent, beyond fp32 rounding; adaptive: no 0/1 norm bit), or None."""
        if not self.client_side:
            return None
        norm = update_norm(theta, arrays)
        theta_norm = math.sqrt(sum(float(np.sum(np.square(v, dtype=np.float64))) for v in theta.values()))
        # The client sends θ_t + u in fp32: re-forming u loses at most eps·|θ_t + u| per entry.
        allowed = self.clip_norm_used * (1 + 1e-5) + 2 * FP32_EPS * (theta_norm + self.clip_norm_used)
        if not norm <= allowed:
            return f"its update's norm {norm:.6g} exceeds the privacy clipping norm {self.clip_norm_used:.6g} it was sent (privacy.side = 'client': was it clipped?)"
        if self.settings.clipping == "adaptive" and metrics.get(KEY_NORM_BIT) not in (0, 1):
            return f"metric '{KEY_NORM_BIT}' is {metrics.get(KEY_NORM_BIT)!r}: adaptive clipping needs 0 or 1 from Flower's adaptiveclipping_mod"
        return None

    def view_metrics(self, metrics: Mapping[str, Any]) -> dict[str, Any]:
        """What a reply's aggregation view carries besides its weight (adaptive client side: the norm bit)."""
        if self.client_side and self.settings.clipping == "adaptive":
            return {KEY_NORM_BIT: int(metrics[KEY_NORM_BIT])}
        return {}

    def release(self, server_round: int, views: list[Message], theta: ArrayRecord) -> tuple[ArrayRecord | None, MetricRecord | None, dict[str, Any]]:
        """(the noisy equal-weight mean of ``views``, its metrics, the round record's ``privacy``).

        Flower's wrapper clips (server side), averages with FedAvg and adds N(0, (z·C/m)²) with m
        the number of views (the wrapper's ``num_sampled_clients`` is set to it: the mean divides
        by m, so the noise is calibrated to the updates it averages); the release is accounted."""
        m = len(views)
        if m == 0:
            return None, None, {}
        w = self.wrapper
        w.num_sampled_clients = m
        used = self.clip_norm_used if self.client_side else self.clipping_norm
        theta_named = from_record(theta)
        # What the server saw (server side: before clipping; client side: as clipped): to tune C.
        updates = [from_record(next(iter(v.content.array_records.values()))) for v in views]
        norms = [update_norm(theta_named, u) for u in updates]
        if not self.client_side:
            views = [self._clipped_view(v, theta_named, u, n, used) for v, u, n in zip(views, updates, norms)]
        with fresh_numpy_entropy():
            arrays, metrics = w.aggregate_train(server_round, views)
        record: dict[str, Any] = {"clip-norm": used, "update-norm-median": float(np.median(norms))}
        if arrays is None:
            return None, None, record
        z = self.settings.noise_multiplier  # adaptive: z covers the update and the count together (Andrew et al.)
        self.ledger.compose(z, m, f"round {server_round} update")
        record.update(
            {
                "noise-multiplier": z,
                "update-noise-std": float(w.noise_multiplier) * used / m,
                "clients": m,
                "next-clip-norm": self.clipping_norm,
            }
        )
        return arrays, metrics, record

    def _clipped_view(self, view: Message, theta: Named, arrays: Named, norm: float, clip_norm: float) -> Message:
        """Server side: ``view`` with its update clipped to ``clip_norm`` (:func:`clip_update`) and,
        for adaptive clipping, the norm bit (1: clipped) the client-side wrapper reads."""
        clipped_arrays, bit = clip_update(theta, arrays, clip_norm, norm)
        metrics = {k: v for k, v in next(iter(view.content.metric_records.values())).items()}
        if self.settings.clipping == "adaptive":
            metrics[KEY_NORM_BIT] = int(bit)
        content = RecordDict({"arrays": ArrayRecord({k: Array(v) for k, v in clipped_arrays.items()}), "metrics": MetricRecord(metrics)})
        return Message(content=content, dst_node_id=view.metadata.dst_node_id, message_type=view.metadata.message_type)

    def release_scores(
        self, rows: list[tuple[int, list[float], list[float]]], rng: np.random.Generator, server_round: int = 0
    ) -> tuple[list[tuple[int, list[float], list[float]]], dict[str, Any]]:
        """FedTOPS's score replies as released: each client's clipped, noised (Ĵ_i, K̂_i); accounted."""
        if not rows:
            return rows, {}
        s = self.settings
        out = [(node, *privatize_scores(j, k, s, rng)) for node, j, k in rows]
        self.ledger.compose(s.score_noise, len(rows), f"round {server_round} scores")
        std_j, std_k = score_noise_stds(len(rows[0][1]), s.score_noise, s.teacher_score_max, s.change_score_max)
        return out, {"score-noise-multiplier": s.score_noise, "score-noise-std": [std_j, std_k]}

    def replay(self, records: Iterable[Mapping[str, Any]], journal: Path | None = None) -> None:
        """Resume: account every release so far and restore C (adaptive) from the complete rounds'
        ``records``. The releases come from ``journal`` when it exists (it also holds those of a
        round cut off before its record, whose noisy values may have reached the clients), else
        from the records (a run folder written before the journal)."""
        records = list(records)
        from_journal = journal is not None and journal.is_file()
        if from_journal:
            for z, m in read_journal(journal):
                self.ledger.compose(z, m)
        else:  # a folder from before the journal: the records' releases start it
            self.ledger.journal = journal
        for record in records:
            p = record.get("privacy") or {}
            if not from_journal and "noise-multiplier" in p:
                self.ledger.compose(float(p["noise-multiplier"]), int(p.get("clients", 1)))
            if not from_journal and "score-noise-multiplier" in p:
                self.ledger.compose(float(p["score-noise-multiplier"]), len(record.get("scored-node-ids") or [1]))
            if p.get("next-clip-norm"):
                self.clipping_norm = float(p["next-clip-norm"])


def clip_update(theta: Named, arrays: Named, clip_norm: float, norm: float | None = None) -> tuple[Named, bool]:
    """(θ_t + min(1, C/‖u‖)·u with u = arrays − θ_t, whether it was clipped): Flower's flat clipping
    (``compute_clip_model_update``) in fp32, with a zero update (‖u‖ = 0) kept as it is: a client
    that returns θ_t unchanged sends a valid update, and Flower's C/‖u‖ divides by zero."""
    norm = update_norm(theta, arrays) if norm is None else norm
    if not norm > clip_norm:  # 0 included
        return {k: np.asarray(v, np.float32) for k, v in arrays.items()}, False
    scale = clip_norm / norm
    out = {}
    for k, t in theta.items():
        u = np.subtract(np.asarray(arrays[k], np.float32), np.asarray(t, np.float32))
        u *= scale
        out[k] = np.asarray(t, np.float32) + u
    return out, True


def read_journal(path: Path) -> list[tuple[float, int]]:
    """(noise multiplier, clients) of every release in a run folder's :data:`JOURNAL`. A last line
    cut off mid-write is left out (its release had not left the server); any other line that is
    not a release raises ValueError naming the file and line."""
    out = []
    lines = path.read_text(encoding="utf-8").split("\n")
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
            out.append((float(entry["noise-multiplier"]), int(entry["clients"])))
        except (ValueError, KeyError, TypeError) as err:
            if i == len(lines):  # no newline after it: the write was cut off
                break
            raise ValueError(f"{path}, line {i}: not a privacy release ({err})") from None
    return out
