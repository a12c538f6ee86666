"""What each strategy name supports, declared without Flower: ``fedopd.config`` validates
``strategy.name`` and the keys that act on it from this table, so the run config (and everything
that reads it, the engine and preflight included) imports on a host without Flower, such as a GPU
image that runs only the client round (``benchmarks/gpu_check.py``).

It also holds what needs no Flower to decide: how many clients a round asks
(:func:`clients_per_round`) and whether a robust aggregator can keep its breakdown point with them
(:func:`aggregator_problem`).

How each strategy is built is Flower's side: :mod:`fedtops_strategy.factory` holds the builders
under the same names, and its ``register_strategy`` adds to both tables.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Capabilities:
    """What a registered strategy supports (the defaults: an averaging strategy like FedAvg).

    averages: it forms an average of client updates (``strategy.aggregator``, ``clip-norm``,
        ``max-weight`` and ``privacy.*`` act on it);
    score_phase: it has FedTOPS's score phase (its ``configure_score`` asks the clients; the
        ``strategy.max-vetoes``/``score-aggregate`` and ``privacy.score-*`` keys act on its score
        replies); ``make_strategy`` refuses a builder whose strategy says otherwise
        (``ServerStrategy.score_phase``);
    private: ``privacy.*`` can protect everything it releases (a variant whose score replies carry
        more than Ĵ and K̂, unprotected, is not);
    per_client_adapters: each client keeps its own adapter and there is no global one (Local);
    scoring_cache: where its clients take the scoring cache from (``round``; ``untrained``: prompts
        outside the round's batch, which the ServerApp checks the data for).
    server_keys: the ``strategy.*`` keys of a server optimizer that act on it (any other strategy
        refuses them set);
    server_state: it carries optimizer state across rounds (momentum, moment estimates) that lives
        only in the ServerApp's memory: ``resume-from`` is refused;
    update_norms: its step reads every client's update, not only their average (FedExP's
        Σ w_i‖Δ_i‖²): a robust aggregator would not bound what one client does to it.
    """

    averages: bool = True
    score_phase: bool = False
    private: bool = True
    per_client_adapters: bool = False
    scoring_cache: str = "round"
    server_keys: tuple[str, ...] = ()
    server_state: bool = False
    update_norms: bool = False


# The built-in strategies, in the order the CLI and the docs list them.
CAPABILITIES: dict[str, Capabilities] = {
    "fedavg": Capabilities(),
    "fixed": Capabilities(),
    "fedtops": Capabilities(score_phase=True),
    # the standard errors of Ĵ_i travel unprotected: no privacy for this variant
    "fedtops-se": Capabilities(score_phase=True, private=False),
    "fedtops-heldout-cache": Capabilities(score_phase=True, scoring_cache="untrained"),
    # Server optimizers on the average (docs/strategies.md): post-processing of it, so they compose
    # with the private mean; FedExP reads each update's norm, which privacy does not release.
    "fedexp": Capabilities(private=False, update_norms=True, server_keys=("strategy.fedexp-epsilon", "strategy.fedexp-average")),
    "fedavgm": Capabilities(server_state=True, server_keys=("strategy.server-lr", "strategy.server-momentum")),
    "fedadam": Capabilities(server_state=True, server_keys=("strategy.server-lr", "strategy.beta1", "strategy.beta2", "strategy.tau")),
    "fedyogi": Capabilities(server_state=True, server_keys=("strategy.server-lr", "strategy.beta1", "strategy.beta2", "strategy.tau")),
    "fedadagrad": Capabilities(server_state=True, server_keys=("strategy.server-lr", "strategy.tau")),
    "local": Capabilities(averages=False, private=False, per_client_adapters=True),
    "centralized": Capabilities(averages=False, private=False),
}


def capabilities(name: str) -> Capabilities:
    """What the strategy registered as ``name`` supports (a name registered without: the defaults)."""
    return CAPABILITIES.get(name, Capabilities())


def clients_per_round(num_clients: int, fraction_train: float, min_train_clients: int) -> int:
    """The clients a round asks when ``num_clients`` are connected: Flower's FedAvg sample size,
    max(1, ⌊fraction_train · num_clients⌋, min(min_train_clients, num_clients)) (also the private
    mean's fixed denominator n)."""
    return max(1, int(fraction_train * num_clients), min(min_train_clients, num_clients))


def robust_tolerance(rule: str, planned: int, trim_fraction: float = 0.2, num_malicious: int = 0) -> tuple[int, int]:
    """(f, n_min): the arbitrary updates (or score rows) ``rule`` is set up to tolerate with
    ``planned`` per round, and the fewest a round needs to keep tolerating f. ``median``:
    f = ⌊(planned − 1)/2⌋; ``trimmed-mean``: f = ⌊β·planned⌋, cut at each end whatever a round
    holds; both need 2f + 1 (f arbitrary values stay a minority, or are all cut). ``krum``,
    ``multikrum``: f = ``num_malicious``, n ≥ 2f + 3 (Blanchard et al., 2017). A round with fewer
    than n_min loses its protection: it holds (the average) or caps a at 1 (Ĵ)."""
    if rule == "median":
        f = max(0, (planned - 1) // 2)
        return f, 2 * f + 1
    if rule == "trimmed-mean":
        f = int(trim_fraction * planned)
        return f, 2 * f + 1
    if rule in ("krum", "multikrum"):
        return num_malicious, 2 * num_malicious + 3
    raise ValueError(f"robust_tolerance: {rule!r} is not a robust rule")


def aggregator_problem(aggregator: str, per_round: int, num_malicious: int) -> tuple[str, str] | None:
    """(the key at fault, why and what is allowed) when ``strategy.aggregator`` cannot keep the
    breakdown point it is chosen for with ``per_round`` updates per round; None when it can.

    - ``median``: the coordinate-wise median stays within the honest values while fewer than half
      the updates are arbitrary; of 2 updates it is their mean, so it needs at least 3.
    - ``krum``, ``multikrum``: Krum tolerates f arbitrary updates of n when n ≥ 2f + 3 (Blanchard
      et al., "Machine Learning with Adversaries: Byzantine Tolerant Gradient Descent", NeurIPS
      2017: 2f + 2 < n). ``multikrum`` averages the n − f best-scored updates, so with f = 0 it is
      the mean of them all.
    ``trimmed-mean``'s rule (it must cut at least one update at each end) lives with
    ``strategy.trim-fraction`` in :mod:`fedopd.config.parse`.
    """
    if aggregator == "median" and per_round < 3:
        return (
            "strategy.aggregator",
            f"'median' of {per_round} update(s) per round is their mean, which one client moves at will; allowed: 'fedavg', or at least 3 clients per round",
        )
    if aggregator == "multikrum" and num_malicious == 0:
        return (
            "strategy.num-malicious",
            "'multikrum' with f = 0 averages all n updates (the plain mean); allowed: f >= 1 with n >= 2f + 3 clients per round, or 'strategy.aggregator' = 'fedavg'",
        )
    if aggregator in ("krum", "multikrum") and per_round < 2 * num_malicious + 3:
        most, least = (per_round - 3) // 2, 1 if aggregator == "multikrum" else 0
        return (
            "strategy.num-malicious",
            f"{aggregator!r} tolerates f arbitrary updates of n only when n >= 2f + 3 (Blanchard et al., 2017), and a round "
            f"averages {per_round}; allowed: "
            + (f"at most {most}, or " if most >= least else "")
            + f"at least {2 * num_malicious + 3} clients per round",
        )
    return None
