"""Pictures of states: how rows share prefixes, as an SVG tree.

``ss.viz.tree(state)`` compresses the rows' tokens into a radix tree (one box per shared span)
and draws it left to right; leaves are labelled ``[batch,sample]``.  Boxes whose KV is in the
model's store are filled blue; spans that would be recomputed at the next call are grey.
"""

from __future__ import annotations

import dataclasses
import html
import math

__all__ = ["tree", "Tree", "tokens_html"]

_BOX_W, _BOX_H, _GAP_X, _GAP_Y = 200, 48, 36, 14
_CHARS = 28            # monospace characters per label line at font-size 11 in a box


@dataclasses.dataclass
class _Node:
    tokens: list[int]
    start: int
    children: list[_Node] = dataclasses.field(default_factory=list)
    rows: list[int] = dataclasses.field(default_factory=list)


def _insert(root: _Node, tokens: tuple[int, ...], row: int) -> None:
    node, pos = root, 0
    while True:
        if pos == len(tokens):
            node.rows.append(row)
            return
        child = next((c for c in node.children if c.tokens[0] == tokens[pos]), None)
        if child is None:
            node.children.append(_Node(list(tokens[pos:]), pos, rows=[row]))
            return
        i = 0
        while i < len(child.tokens) and pos + i < len(tokens) and child.tokens[i] == tokens[pos + i]:
            i += 1
        if i < len(child.tokens):                     # split the child at the divergence
            tail = _Node(child.tokens[i:], child.start + i, child.children, child.rows)
            child.tokens, child.children, child.rows = child.tokens[:i], [tail], []
        node, pos = child, pos + i


class Tree:
    """An SVG drawing of a state's prefix tree; shows itself in notebooks and docs."""

    def __init__(self, state) -> None:
        self.state = state
        self.root = _Node([], 0)
        for i, row in enumerate(state.rows):
            _insert(self.root, row.tokens, i)

    def _label(self, node: _Node) -> list[str]:
        """The span's text in at most two box-wide lines, broken between words; a longer
        text keeps its start and end with an ellipsis between."""
        text = self.state.model.vocab.decode(node.tokens).replace("\n", "⏎")
        lines = _wrap(text)
        if len(lines) <= 2:
            return lines
        tail = _wrap(text[-_CHARS:])[-1]
        return [lines[0], "… " + tail if len(tail) <= _CHARS - 2 else "…" + tail[-_CHARS + 1:]]

    def _stored(self, node: _Node, prefix: tuple[int, ...]) -> bool:
        full = prefix + tuple(node.tokens)
        return self.state.model.store.match(full).length >= len(full) - 1

    def svg(self) -> str:
        """The drawing as an SVG document."""
        boxes, lines, leaves = [], [], [0]

        def place(node: _Node, depth: int, prefix: tuple[int, ...]) -> float:
            """Draw ``node`` and its subtree; return its y (children first, leaves in order)."""
            child_ys = [place(c, depth + 1, prefix + tuple(node.tokens)) for c in node.children]
            ys = list(child_ys)
            if node.rows or not node.children:        # a row ends here: it takes a line of its own
                ys.append(leaves[0] * (_BOX_H + _GAP_Y))
                leaves[0] += 1
            y = sum(ys) / len(ys)
            if not node.tokens:                       # the invisible root
                return y
            x = depth * (_BOX_W + _GAP_X)
            fill = "#cfe3ff" if self._stored(node, prefix) else "#e6e6e6"
            tags = " ".join(f"[{r // self.state.n_samples},{r % self.state.n_samples}]" for r in node.rows)
            label = "".join(
                f'<text x="{x + 6}" y="{y + 14 + 13 * i}" font-size="11" '
                f'font-family="monospace" xml:space="preserve">{html.escape(line)}</text>'
                for i, line in enumerate(self._label(node)))
            boxes.append(
                f'<rect x="{x}" y="{y}" width="{_BOX_W}" height="{_BOX_H}" rx="5" fill="{fill}" '
                f'stroke="#456"/>{label}<text x="{x + 6}" y="{y + 42}" font-size="10" '
                f'fill="#555">{len(node.tokens)} tok {html.escape(tags)}</text>')
            for cy in child_ys:
                lines.append(f'<line x1="{x + _BOX_W}" y1="{y + _BOX_H / 2}" x2="{x + _BOX_W + _GAP_X}" '
                             f'y2="{cy + _BOX_H / 2}" stroke="#789"/>')
            return y

        place(self.root, -1, ())
        depth = self._depth(self.root)
        width = max(1, depth) * (_BOX_W + _GAP_X)
        height = max(1, leaves[0]) * (_BOX_H + _GAP_Y)
        return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
                f'viewBox="0 0 {width} {height}">{"".join(lines)}{"".join(boxes)}</svg>')

    def _depth(self, node: _Node) -> int:
        """Columns of boxes below and including ``node`` (the root has no box)."""
        below = max((self._depth(c) for c in node.children), default=0)
        return below + (1 if node.tokens else 0)

    def _repr_html_(self) -> str:
        return self.svg()

    def __str__(self) -> str:
        return self.svg()


def _wrap(text: str) -> list[str]:
    """``text`` in lines of at most ``_CHARS`` characters, broken after spaces where a line
    has one (a word longer than a line is cut)."""
    lines = []
    while len(text) > _CHARS:
        cut = text.rfind(" ", 0, _CHARS + 1)
        cut = cut + 1 if cut > 0 else _CHARS
        lines.append(text[:cut].rstrip(" ") or text[:cut])
        text = text[cut:]
    return lines + [text] if text or not lines else lines


def tree(state) -> Tree:
    """A prefix-tree picture of ``state``'s rows.

    Examples
    --------
    >>> import seqstate as ss
    >>> model = ss.models.testing.tiny()
    >>> s = ss.text(model)("Fork me", num_samples=3, seed=0, max_tokens=3,
    ...                    sampler=ss.multinomial())
    >>> ss.viz.tree(s).svg().count("<rect") >= 4
    True
    """
    return Tree(state)


def tokens_html(state) -> str:
    """``state``'s rows as HTML, one line a row, each generated token shaded by its
    probability (its log-prob on hover); prompt and appended tokens in grey.  A state's
    ``_repr_html_`` (notebooks)."""
    rows = []
    for i, r in enumerate(state.rows):
        cells = []
        for t, lp in zip(r.tokens, r.logprobs):
            piece = html.escape(state.model.vocab.token_bytes[t].decode("utf-8", "replace"))
            if lp is None:
                cells.append(f"<span style='color:#555'>{piece}</span>")
            else:
                p = min(1.0, max(0.0, math.exp(lp)))
                cells.append(f"<span title='logprob {lp:.3f}' style='background:"
                             f"hsl({int(120 * p)},80%,85%)'>{piece}</span>")
        rows.append(f"<div><b>[{i // state.n_samples},{i % state.n_samples}]</b> "
                    f"<span style='white-space:pre-wrap;font-family:monospace'>{''.join(cells)}</span></div>")
    return f"<div class='seqstate'><i>SequenceState {state.shape}</i>{''.join(rows)}</div>"
