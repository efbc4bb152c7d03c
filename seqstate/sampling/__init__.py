"""Samplers: frozen parameter objects and the pure functions they use."""

from seqstate.sampling.params import Greedy, Multinomial, Sampler, greedy, multinomial

__all__ = ["Sampler", "Greedy", "Multinomial", "greedy", "multinomial"]
