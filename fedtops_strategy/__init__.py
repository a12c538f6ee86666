"""Server-side aggregation: FedTOPS, the fixed multiplier, FedAvg on LoRA factors, and the
paper's Local and Centralized references."""

from fedtops_strategy.factory import make_strategy
from fedtops_strategy.fedtops import FedTOPS
from fedtops_strategy.fixed import FixedMultiplier, LoRAFedAvg
from fedtops_strategy.references import Centralized, LocalTraining
from fedtops_strategy.selection import select_multiplier

__all__ = ["Centralized", "FedTOPS", "FixedMultiplier", "LoRAFedAvg", "LocalTraining", "make_strategy", "select_multiplier"]
