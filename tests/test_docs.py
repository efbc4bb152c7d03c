"""The documentation as a reader sees it: code that fits, a reference without markup debris."""

import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
WIDTH = 80
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})")


def code_lines(path: pathlib.Path):
    """(line number, text) of every line inside a fenced code block."""
    inside, marker = False, ""
    for number, line in enumerate(path.read_text().splitlines(), 1):
        m = FENCE.match(line)
        if m and (not inside or m.group(2).startswith(marker)):
            inside, marker = (not inside), m.group(2)
            continue
        if inside:
            yield number, line


def test_code_blocks_fit_80_columns():
    pages = sorted((ROOT / "docs").rglob("*.md")) + [ROOT / "README.md"]
    wide = [f"{p.relative_to(ROOT)}:{n} ({len(line)} columns)"
            for p in pages for n, line in code_lines(p) if len(line) > WIDTH]
    assert not wide, "code lines wider than 80 columns scroll on the site:\n" + "\n".join(wide)
