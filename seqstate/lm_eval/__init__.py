"""lm-evaluation-harness on seqstate: the ``seqstate`` model (`SeqStateLM`) and a command line.

Importing this package registers ``seqstate`` in lm-eval's model registry, so
``lm_eval.simple_evaluate(model="seqstate", ...)`` and
``lm_eval.simple_evaluate(model=SeqStateLM(model=m), ...)`` work.  lm-eval's own ``lm-eval``
command has no plugin discovery: run ``seqstate-lm-eval`` (or ``python -m seqstate.lm_eval``)
instead, with the same arguments, for example
``seqstate-lm-eval --model seqstate --model_args engine=hf --tasks arc_easy``.

Needs the extra: ``pip install "seqstate[lm-eval]"``.
"""

from seqstate.lm_eval.cli import main
from seqstate.lm_eval.model import SeqStateLM

__all__ = ["SeqStateLM", "main"]
