"""``seqstate-lm-eval``: lm-eval's own command line with the ``seqstate`` model registered."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from lm_eval.__main__ import cli_evaluate

import seqstate.lm_eval.model  # noqa: F401  (registers --model seqstate)

__all__ = ["main"]


def main(argv: Sequence[str] | None = None) -> None:
    """Run lm-eval's command line (``lm-eval run ...``, ``lm-eval ls tasks``, ...) on ``argv``
    (default: this process's arguments).

    Examples
    --------
    >>> main(["run", "--model", "seqstate", "--model_args", "engine=hf",
    ...       "--tasks", "arc_easy"])                                  # doctest: +SKIP
    """
    if argv is None:
        cli_evaluate()
        return
    saved = sys.argv
    sys.argv = [saved[0], *argv]          # lm-eval's parser reads (and edits) sys.argv
    try:
        cli_evaluate()
    finally:
        sys.argv = saved
