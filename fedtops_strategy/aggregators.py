"""The average under fedavg, fixed and FedTOPS, by name (``strategy.aggregator``): Flower's own.

``fedavg`` is Flower's FedAvg mean (:class:`~fedtops_strategy.averaging.WeightedMean`): the
``num-examples``-weighted mean of the screened updates, the paper's Δ_t. The others are Flower's
robust strategies, whose ``aggregate_train`` is used as is on the screened replies:

* ``median``: :class:`flwr.serverapp.strategy.FedMedian`, the coordinate-wise median (weights unused);
* ``trimmed-mean``: :class:`~flwr.serverapp.strategy.FedTrimmedAvg`, the coordinate-wise mean
  after cutting ⌊β n⌋ values at each end (β = ``strategy.trim-fraction``; weights unused);
* ``krum``: :class:`~flwr.serverapp.strategy.Krum`, the one update closest to its n − f − 2
  nearest neighbours (f = ``strategy.num-malicious``);
* ``multikrum``: :class:`~flwr.serverapp.strategy.MultiKrum`, the weighted mean of the n − f
  best-scored updates.

What the paper's quantities then mean is in docs/robustness.md: Δ_t is the aggregate minus θ_t,
not a weighted mean of updates, and the aggregation-error diagnostic is not recorded.
"""

from __future__ import annotations

from collections.abc import Callable

from flwr.serverapp.strategy import FedAvg, FedMedian, FedTrimmedAvg, Krum, MultiKrum

from fedopd.core.settings import StrategySettings

# name -> a Flower strategy whose aggregate_train forms the average (None: Flower's FedAvg mean, averaging.WeightedMean)
AGGREGATORS: dict[str, Callable[[StrategySettings], FedAvg] | None] = {
    "fedavg": None,
    "median": lambda s: FedMedian(),
    "trimmed-mean": lambda s: FedTrimmedAvg(beta=s.trim_fraction),
    "krum": lambda s: Krum(num_malicious_nodes=s.num_malicious),
    "multikrum": lambda s: MultiKrum(num_malicious_nodes=s.num_malicious, num_nodes_to_select=1),
}


def make_aggregator(settings: StrategySettings) -> FedAvg | None:
    """The Flower strategy that averages for ``strategy.aggregator`` (None: FedAvg's own mean)."""
    if settings.aggregator not in AGGREGATORS:
        raise ValueError(f"strategy.aggregator = {settings.aggregator!r}; allowed: {', '.join(repr(n) for n in AGGREGATORS)}")
    build = AGGREGATORS[settings.aggregator]
    return None if build is None else build(settings)
