"""Progress bars (tqdm) for long calls, beam searches and ``run_batch``.

``progress=None`` (the default everywhere) shows a bar only when standard error is a terminal
and ``SEQSTATE_PROGRESS`` is not ``0``, and, for a single call, only once it has run
``DELAY_SECONDS``; ``progress=True`` always shows one at once, ``False`` never.  Calls made
inside ``run_batch`` show none of their own: its bar counts inputs.
"""

from __future__ import annotations

import contextlib
import contextvars
import os
import sys
from collections.abc import Iterator
from typing import Any

__all__ = ["progress_bar", "quiet_calls", "DELAY_SECONDS"]

DELAY_SECONDS = 2.0
_QUIET: contextvars.ContextVar[bool] = contextvars.ContextVar("seqstate_quiet_calls", default=False)


@contextlib.contextmanager
def progress_bar(progress: bool | None, total: int, desc: str, unit: str,
                 call: bool = True) -> Iterator[Any]:
    """A tqdm bar for the block, closed when it ends; None when none should show (see the
    module docstring)."""
    delay = 0.0
    if progress is None:
        if call and _QUIET.get():
            progress = False
        else:
            progress = sys.stderr.isatty() and os.environ.get("SEQSTATE_PROGRESS", "1") != "0"
            delay = DELAY_SECONDS if call else 0.0
    if not progress or total <= 0:
        yield None
        return
    from tqdm.auto import tqdm

    with tqdm(total=total, desc=desc, unit=unit, delay=delay, leave=not call) as bar:
        yield bar


@contextlib.contextmanager
def quiet_calls() -> Iterator[None]:
    """Within this block (one thread), calls with ``progress=None`` show no bar."""
    token = _QUIET.set(True)
    try:
        yield
    finally:
        _QUIET.reset(token)
