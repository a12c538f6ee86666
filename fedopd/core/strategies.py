"""What each strategy name supports, declared without Flower: ``fedopd.config`` validates
``strategy.name`` and the keys that act on it from this table, so the run config (and everything
that reads it, the engine and preflight included) imports on a host without Flower, such as a GPU
image that runs only the client round (``benchmarks/gpu_check.py``).

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
    score_phase: it has FedTOPS's score phase (``configure_score``/``aggregate_score``; the
        ``strategy.max-vetoes``/``score-aggregate`` keys act on its score replies);
    private: ``privacy.*`` can protect everything it releases (a variant whose score replies carry
        more than Ĵ and K̂, unprotected, is not);
    per_client_adapters: each client keeps its own adapter and there is no global one (Local);
    scoring_cache: where its clients take the scoring cache from (``round``; ``untrained``: prompts
        outside the round's batch, which the ServerApp checks the data for).
    """

    averages: bool = True
    score_phase: bool = False
    private: bool = True
    per_client_adapters: bool = False
    scoring_cache: str = "round"


# The built-in strategies, in the order the CLI and the docs list them.
CAPABILITIES: dict[str, Capabilities] = {
    "fedavg": Capabilities(),
    "fixed": Capabilities(),
    "fedtops": Capabilities(score_phase=True),
    # the standard errors of Ĵ_i travel unprotected: no privacy for this variant
    "fedtops-se": Capabilities(score_phase=True, private=False),
    "fedtops-heldout-cache": Capabilities(score_phase=True, scoring_cache="untrained"),
    "local": Capabilities(averages=False, private=False, per_client_adapters=True),
    "centralized": Capabilities(averages=False, private=False),
}


def capabilities(name: str) -> Capabilities:
    """What the strategy registered as ``name`` supports (a name registered without: the defaults)."""
    return CAPABILITIES.get(name, Capabilities())
