"""mkdocs hook: pictures drawn from a page's own code when the site is built.

A page marks a picture with ``<!-- drawn: NAME -->``; the hook runs the page's Python code
blocks in order (as ``make test`` does) and puts ``NAME``'s HTML there (its ``_repr_html_``,
e.g. a state's token view or ``ss.viz.tree``'s SVG; a matplotlib figure: its PNG).  The
picture is what the code on the page draws today, so it cannot drift from it.  What the code
prints is the reader's output, not the build's: it is left out of the build's log.
"""

from __future__ import annotations

import base64
import contextlib
import io
import re

MARKER = re.compile(r"<!-- drawn: (\w+) -->")
BLOCK = re.compile(r"^```(?:python|\{\.python[^}\n]*\})\n(.*?)^```[ \t]*$", re.S | re.M)


def on_page_markdown(markdown: str, page, config, files) -> str:
    if not MARKER.search(markdown):
        return markdown
    names: dict = {"__name__": "__drawn__"}
    with contextlib.redirect_stdout(io.StringIO()):
        for code in BLOCK.findall(markdown):
            exec(compile(code, page.file.abs_src_path, "exec"), names)   # noqa: S102 - our docs

    def draw(match: re.Match) -> str:
        obj = names[match.group(1)]
        if hasattr(obj, "savefig"):                     # a matplotlib figure
            png = io.BytesIO()
            obj.savefig(png, format="png", dpi=100, bbox_inches="tight")
            data = base64.b64encode(png.getvalue()).decode()
            html = f'<img alt="{match.group(1)}" src="data:image/png;base64,{data}">'
        else:
            html = obj._repr_html_() if hasattr(obj, "_repr_html_") else str(obj)
        return f'<div class="seqstate-picture">{html}</div>'

    return MARKER.sub(draw, markdown)
