"""Engines behind the generators, each one folder of one shape, all speaking the protocol in
`seqstate.backends.base` (a stepping backend or a request backend) and registered once in
`seqstate.backends.registry`.

An engine folder's ``model``, ``loader``, ``server`` and ``serve`` modules build models, so
they sit in the models layer, above `seqstate.backends` and `seqstate.engine` (a model holds
its backend and its runner): the two arrows that point up from this folder.  The rest of the
folder, the backend, never imports them (tests/test_imports.py states the rule).
"""

from seqstate.backends.base import (Backend, Batch, Capabilities, Handle, RequestBackend,
                                    StepBackend)

__all__ = ["Backend", "StepBackend", "RequestBackend", "Batch", "Capabilities", "Handle"]
