"""FedExP: the server step from the clients' update norms (Jhunjhunwala, Wang and Joshi, "FedExP:
Speeding Up Federated Averaging via Extrapolation", ICLR 2023), on the LoRA factors:

    η_g = max(1, Σ_i w_i ‖Δ_i‖² / (2 (‖Δ̄‖² + ε))),   θ_{t+1} = θ_t + η_g Δ̄,

Δ_i = θ_{t,i}^+ − θ_t the updates that were averaged (after ``strategy.clip-norm`` /
``max-weight``), w_i their weights in the average normalized to sum 1 (the paper writes the
uniform 1/M; the authors' code weighs by data size, as here), Δ̄ = Σ w_i Δ_i. ``strategy.fedexp-epsilon`` ε.
The authors' code adds S·ε instead of ε (S the clients sampled per round) and decays ε by 0.998²
a round; neither is done here.

``strategy.fedexp-average``: what is evaluated and saved as ``round-NNN/evaluated`` is
(θ_t + θ_{t+1}) / 2, the average of the last two iterates that the paper reports (the iterates
oscillate); training continues from θ_{t+1}, as in the authors' code. Flower has no FedExP
strategy in its package (its baseline is a separate project).

The step reads each update's norm, which the private mean does not release and a robust
aggregator does not bound: FedExP takes the plain mean only (``fedopd.config.server_rules``).
"""

from __future__ import annotations

import numpy as np
from flwr.app import Array, ArrayRecord

from fedopd.models.lora import Named, from_record
from fedtops_strategy.base import ServerStrategy
from fedtops_strategy.bounds import update_norm
from fedtops_strategy.round import Step, TrainAggregate, apply_step

NOTE = "fedexp"  # the round record's field: Σ w_i‖Δ_i‖², ‖Δ̄‖², η_g


def weighted_mean(values: list[float], weights: list[float]) -> float:
    """Σ w_i x_i with the weights normalized to sum 1."""
    return sum(w * x for w, x in zip(weights, values)) / float(sum(weights))


def fedexp_step_size(spread: float, mean_norm_sq: float, epsilon: float) -> float:
    """η_g = max(1, spread / (2(‖Δ̄‖² + ε))), ``spread`` = Σ w_i‖Δ_i‖² (normalized weights)."""
    return max(1.0, spread / (2.0 * (mean_norm_sq + epsilon)))


class FedExP(ServerStrategy):
    strategy_name = "fedexp"

    def __init__(self, epsilon: float = 1e-3, average_last_two: bool = False, **kwargs) -> None:
        if not epsilon > 0:
            raise ValueError(f"FedExP's ε must be > 0, got {epsilon!r}")
        super().__init__(**kwargs)
        self.epsilon = float(epsilon)
        self.average_last_two = bool(average_last_two)
        self.previous: Named | None = None  # cross-round: θ_t of the last step (the average's other iterate)

    def bounded_updates(self, sent, kept):
        """The averaged updates, and their weighted mean squared norm Σ w_i‖Δ_i‖² in the record."""
        updates, notes = super().bounded_updates(sent, kept)
        if updates:
            norms = [update_norm(sent.theta, u.arrays) ** 2 for u in updates]
            notes[NOTE] = {"node-ids": [u.node_id for u in updates], "update-norm-sq": norms, "weights": [float(u.weight) for u in updates]}
        return updates, notes

    def step(self, train: TrainAggregate, scores) -> Step:
        self.previous = train.theta
        seen = train.notes.get(NOTE)
        if train.mean is None or seen is None:
            return apply_step(train, 0.0)
        mean_sq = update_norm(train.theta, train.mean) ** 2
        spread = weighted_mean(seen["update-norm-sq"], seen["weights"])
        eta = fedexp_step_size(spread, mean_sq, self.epsilon)
        return apply_step(train, eta, {NOTE: {"mean-update-norm-sq": spread, "average-norm-sq": mean_sq, "eta-g": eta}})

    def evaluated_arrays(self, global_arrays: ArrayRecord) -> ArrayRecord | None:
        """(θ_t + θ_{t+1}) / 2 with ``average_last_two`` once a step was taken; None: θ_{t+1} itself."""
        if not self.average_last_two or self.previous is None:
            return None
        current = from_record(global_arrays)
        return ArrayRecord(
            {k: Array(((np.asarray(v, dtype=np.float32) + self.previous[k]) / np.float32(2)).astype(np.float32)) for k, v in current.items()}
        )
