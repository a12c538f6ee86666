"""Server-side aggregation: FedTOPS, the fixed multiplier and FedAvg on LoRA factors."""

from fedtops_strategy.factory import make_strategy
from fedtops_strategy.fedtops import FedTOPS
from fedtops_strategy.fixed import FixedMultiplier, LoRAFedAvg
from fedtops_strategy.selection import select_multiplier

__all__ = ["FedTOPS", "FixedMultiplier", "LoRAFedAvg", "make_strategy", "select_multiplier"]
