"""The interface path of the OPD loss (``fedopd.opd.reverse_kl``); the code lives in :mod:`fedopd.distill.opd`."""

from fedopd.distill.opd import reverse_kl

__all__ = ["reverse_kl"]
