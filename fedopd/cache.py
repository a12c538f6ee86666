"""The interface path of the scoring cache's math (``fedopd.cache.coarsen``, ``fedopd.cache.kl``);
the code lives in :mod:`fedopd.distill.cache`."""

from fedopd.distill.cache import coarsen, kl

__all__ = ["coarsen", "kl"]
