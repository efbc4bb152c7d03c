"""Samplers: frozen parameter objects and the pure functions they use."""

from seqstate.sampling.params import (BeamSearch, Greedy, Multinomial, Sampler, beam_search,
                                      greedy, multinomial)

__all__ = ["Sampler", "Greedy", "Multinomial", "BeamSearch", "greedy", "multinomial", "beam_search"]
