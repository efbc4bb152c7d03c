"""Engines behind the generators, each one folder of one shape, all speaking the protocol in
`seqstate.backends.base` (a stepping backend or a request backend) and registered once in
`seqstate.backends.registry`.
"""

from seqstate.backends.base import (Backend, Batch, Capabilities, Handle, RequestBackend,
                                    StepBackend)

__all__ = ["Backend", "StepBackend", "RequestBackend", "Batch", "Capabilities", "Handle"]
