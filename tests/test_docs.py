"""The documentation as a reader sees it: code that fits, a reference without markup debris."""

import html
import json
import pathlib
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser

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


CHECK = """<script>
  // which code blocks does the browser have to scroll at this width?
  const wide = [...document.querySelectorAll("pre > code")]
    .filter(c => c.scrollWidth > c.clientWidth + 1)
    .map(c => c.textContent.split("\\n").reduce((a, b) => a.length >= b.length ? a : b));
  document.body.setAttribute("data-wide", JSON.stringify(wide));
</script>"""


def chromium_dom(page: pathlib.Path, profile: pathlib.Path) -> str:
    chromium = shutil.which("chromium")
    assert chromium, "make test installs Debian's chromium; install it with apt-get install chromium"
    out = subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu",
                          "--disable-quic", "--no-first-run", "--disable-background-networking",
                          "--disable-component-update", "--disable-sync",
                          f"--user-data-dir={profile}", "--window-size=1280,1000",
                          "--dump-dom", page.as_uri()],
                         check=True, capture_output=True, text=True, timeout=180)
    return out.stdout


class _Text(HTMLParser):
    """The page's prose (outside code) and its code blocks' text."""

    def __init__(self) -> None:
        super().__init__()
        self.prose, self.depth = [], 0

    def handle_starttag(self, tag, attrs):
        self.depth += tag in ("code", "pre", "script", "style")

    def handle_endtag(self, tag):
        self.depth -= tag in ("code", "pre", "script", "style")

    def handle_data(self, data):
        if not self.depth:
            self.prose.append(data)


def test_reference_renders_clean_in_chromium(tmp_path):
    site = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet",
                    "--site-dir", str(site)], cwd=ROOT, check=True, timeout=600)
    reference = site / "reference" / "index.html"
    checked = reference.with_name("checked.html")
    checked.write_text(reference.read_text().replace("</body>", CHECK + "</body>"))
    dom = chromium_dom(checked, tmp_path / "profile")
    text = _Text()
    text.feed(dom)
    prose = "".join(text.prose)
    for role in (":func:", ":class:", ":meth:", ":attr:", ":mod:"):
        assert role not in prose, f"a Sphinx role {role} shows as text"
    assert not re.search(r"::\s*$", prose, re.M), "an RST '::' literal block shows as text"
    wide = json.loads(html.unescape(re.search(r'data-wide="([^"]*)"', dom).group(1)))
    assert wide == [], f"code lines wider than their block at 1280 px: {wide}"
    import seqstate as ss

    names = set(ss.__all__) | {"shape", "token_ids", "Span", "Captures", "tokens", "tree",
                               "tiny", "load", "ban_phrases", "Capabilities"}
    missing = [n for n in sorted(names) if not re.search(rf'id="([\w.]*\.)?{n}"', dom)]
    assert not missing, f"public names missing from the reference: {missing}"
