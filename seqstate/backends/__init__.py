"""Engines behind the generators, each one folder of one shape, all speaking the protocol in
`seqstate.backends.base` (a stepping backend or a request backend) and registered once in
`seqstate.backends.registry`.
"""

from seqstate.backends.base import Backend, Batch, Capabilities, Handle

__all__ = ["Backend", "Batch", "Capabilities", "Handle"]
