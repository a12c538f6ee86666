"""Server-side aggregation: FedTOPS, the fixed multiplier, FedAvg on LoRA factors, and the
paper's Local and Centralized references."""

from fedtops_strategy.factory import STRATEGIES, make_strategy, register_strategy
from fedtops_strategy.fedtops import FedTOPS
from fedtops_strategy.fixed import FixedMultiplier, LoRAFedAvg
from fedtops_strategy.references import Centralized, LocalTraining
from fedtops_strategy.selection import select_multiplier

__all__ = [
    "STRATEGIES",
    "Centralized",
    "FedTOPS",
    "FixedMultiplier",
    "LoRAFedAvg",
    "LocalTraining",
    "make_strategy",
    "register_strategy",
    "select_multiplier",
]
