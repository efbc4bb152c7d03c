"""``seqstate-lm-eval``: lm-eval's own command line with the ``seqstate`` model registered."""

from __future__ import annotations

import sys
from collections.abc import Sequence

from lm_eval.__main__ import cli_evaluate

import seqstate.lm_eval.model  # noqa: F401  (registers --model seqstate)

__all__ = ["main", "with_device"]

OTHER_COMMANDS = ("ls", "validate")      # lm-eval's subcommands besides `run`


def main(argv: Sequence[str] | None = None) -> None:
    """Run lm-eval's command line (``lm-eval run ...``, ``lm-eval ls tasks``, ...) on ``argv``
    (default: this process's arguments).

    A ``run`` without ``--device`` (or ``--config``) gets ``--device cpu``: lm-eval's own
    default, ``cuda:0``, would otherwise reach the model even on a machine without a GPU.

    Examples
    --------
    >>> main(["run", "--model", "seqstate", "--model_args", "engine=hf",
    ...       "--tasks", "arc_easy"])                                  # doctest: +SKIP
    """
    saved = sys.argv
    sys.argv = [saved[0], *with_device(saved[1:] if argv is None else argv)]
    try:
        cli_evaluate()
    finally:
        sys.argv = saved


def with_device(argv: Sequence[str]) -> list[str]:
    """``argv`` with ``--device cpu`` added to a ``run`` that names no device (nor a config
    file, which may name one).

    Examples
    --------
    >>> with_device(["run", "--model", "seqstate"])
    ['run', '--model', 'seqstate', '--device', 'cpu']
    >>> with_device(["--model", "seqstate", "--device=cuda:0"])
    ['--model', 'seqstate', '--device=cuda:0']
    >>> with_device(["ls", "tasks"])
    ['ls', 'tasks']
    """
    # lm-eval's rule: arguments without a subcommand are a `run`
    run = bool(argv) and (argv[0] == "run" or (len(argv) > 1 and argv[0] not in OTHER_COMMANDS))
    named = any(a.split("=", 1)[0] in ("--device", "--config", "-C") for a in argv)
    return [*argv, "--device", "cpu"] if run and not named else list(argv)
