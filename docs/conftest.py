"""How the docs' code blocks run as tests (pytest-markdown-docs, in ``make test``).

A ``{.python continuation}`` block is its page's earlier blocks followed by its own code, and
pytest-markdown-docs runs all of it again for each such block: the first block of a page of n
ran n times.  This runner keeps the namespace that the block run just before left behind, and
where the current block's source is that block's source plus more, it runs only the new code
in that namespace.  That is what a reader does, and what the re-run computed anyway (the same
code, in order, in one namespace).  A block run alone, after a failure, or with fixtures runs
its whole source in a fresh namespace, as the plugin does.
"""

from __future__ import annotations

import dataclasses

from pytest_markdown_docs._runners import DefaultRunner, register_runner


@register_runner(default=True)
class ContinuingRunner(DefaultRunner):
    """Runs a continuation block's new code in the namespace its previous block left."""

    last: tuple[str, dict] | None = None          # (the source run last, its namespace)

    def runtest(self, test, args, *, asyncio_runner=None):
        full = test.source
        last, ContinuingRunner.last = ContinuingRunner.last, None   # a failure keeps nothing
        if (last is not None and not test.fixture_names and len(full) > len(last[0])
                and full.startswith(last[0])):
            done, args = last
            # the code already run becomes blank lines: tracebacks keep the page's line numbers
            test = dataclasses.replace(test, source="\n" * done.count("\n") + full[len(done):])
        super().runtest(test, args, asyncio_runner=asyncio_runner)
        if not test.fixture_names:
            ContinuingRunner.last = (full, args)
