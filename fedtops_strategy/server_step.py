"""Server optimizers: a rule that turns the round's average into θ_{t+1} with state of its own,
on the LoRA factors like FedAvg.

The round's phases are every strategy's (:mod:`fedtops_strategy.base`): the boundary, the bounds
and the average (the weighted mean, a robust one or the private mean) give Δ_t = average − θ_t.
Only the step differs. :class:`FlowerOptimizerStep` hands that average to one of Flower's own
server optimizers (``FedAvgM``, ``FedAdam``, ``FedYogi``, ``FedAdagrad``) as the one reply of
weight 1, whose FedAvg mean is the average itself, with θ_t as the arrays Flower's strategy sent:
Flower's update rule then runs unchanged, and so does its state (momentum, m_t, v_t), which reads
only the average (post-processing of the private mean). A round that holds, or whose step is not
finite, leaves that state as it was.

The step of these rules is not a multiple of Δ_t: the round record's ``multiplier`` is the
effective one, ‖θ_{t+1} − θ_t‖ / ‖Δ_t‖, with ``step-cosine`` (:func:`step_geometry`) beside it.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from logging import WARNING
from typing import Any

import numpy as np
from flwr.common.logger import log

from fedopd.models.lora import Named, from_record
from fedtops_strategy.averaging import Update, as_message
from fedtops_strategy.base import ServerStrategy, quiet_flower
from fedtops_strategy.bounds import all_finite, update_norm
from fedtops_strategy.round import Step, TrainAggregate, aggregation_errors, apply_step, step_geometry


class FlowerOptimizerStep(ServerStrategy):
    """A Flower server optimizer (``self.optimizer``) as the step after the average.

    A subclass sets :attr:`strategy_name` and passes ``optimizer``, which builds its Flower strategy
    (with ``fraction_evaluate = 0``: it is asked to aggregate, never to sample); :attr:`STATE` names
    the optimizer's attributes that carry across rounds."""

    STATE: tuple[str, ...] = ()

    def __init__(self, optimizer: Callable[[], Any], **kwargs) -> None:
        super().__init__(**kwargs)
        with quiet_flower():  # fraction_evaluate = 0 is the design here: no warning
            self.optimizer = optimizer()

    def optimizer_step(self, server_round: int, theta: Named, mean: Named) -> Named:
        """θ_{t+1} from Flower's ``aggregate_train`` on the average as one reply of weight 1,
        around θ_t (what its ``configure_train`` would have kept). ``server_round`` is Flower's:
        FedAdam's bias correction counts rounds, held ones included, as Flower's own loop does."""
        self.optimizer.current_arrays = self.current_arrays(theta)
        with quiet_flower():  # its "Received 1 results" line would contradict the round's real count
            arrays, _ = self.optimizer.aggregate_train(server_round, [as_message(Update(0, mean, 1.0))])
        return {k: np.asarray(v, dtype=np.float32) for k, v in from_record(arrays).items()}

    def current_arrays(self, theta: Named):
        """θ_t in the form the optimizer keeps it (FedOpt: a dict of arrays)."""
        return {k: np.asarray(v) for k, v in theta.items()}

    def state_finite(self) -> bool:
        """Whether every array of the optimizer's state (:attr:`STATE`) is finite (an overflowed v_t
        would freeze its coordinates for good)."""
        for name in self.STATE:
            value = getattr(self.optimizer, name)
            arrays = value.values() if isinstance(value, dict) else (value or [])
            if not all(np.all(np.isfinite(np.asarray(a))) for a in arrays):
                return False
        return True

    def step(self, train: TrainAggregate, scores) -> Step:
        if train.mean is None:  # nothing averaged: the round holds, the optimizer's state untouched
            return apply_step(train, 0.0)
        saved = {name: copy.deepcopy(getattr(self.optimizer, name)) for name in self.STATE}
        new = self.optimizer_step(train.server_round, train.theta, train.mean)
        if not (all_finite(new) and self.state_finite()):
            for name, value in saved.items():
                setattr(self.optimizer, name, value)
            log(WARNING, "round %d holds: the %s step is not finite (θ_t kept, its state as before)", train.server_round, self.strategy_name)
            return Step(train.theta, 0.0, {"hold-reason": f"the {self.strategy_name} step is not finite", **aggregation_errors(train, 0.0)})
        geometry = step_geometry(train.theta, new, train.delta)
        # the mean factors' error is this round's; the applied one assumes a step along Δ_t, which this is not.
        # step-norm: how far θ moved, also where Δ_t = 0 and momentum still moves it (no multiplier then)
        details = {**aggregation_errors(train, 1.0), "aggregation-error-applied": None, "step-norm": update_norm(train.theta, new)}
        return Step(new, geometry["effective-multiplier"], details)


class FlowerFedOptStep(FlowerOptimizerStep):
    """One of Flower's FedOpt rules (FedAdam, FedYogi, FedAdagrad: :attr:`FLOWER`) with η and τ,
    and β₁, β₂ where the rule has them (FedAdagrad has none)."""

    FLOWER: type
    STATE = ("m_t", "v_t")

    def __init__(self, server_lr: float, tau: float, beta1: float | None = None, beta2: float | None = None, **kwargs) -> None:
        betas = {} if beta1 is None else {"beta_1": beta1, "beta_2": beta2}
        super().__init__(lambda: self.FLOWER(fraction_evaluate=0.0, eta=server_lr, tau=tau, **betas), **kwargs)
