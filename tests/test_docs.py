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


# -- what pages say about the protocol and about other projects ------------------------------------
def test_the_backend_page_lists_every_capability():
    import dataclasses

    from seqstate.backends.base import Capabilities

    page = (ROOT / "docs" / "concepts" / "backends.md").read_text()
    row = next(line for line in page.splitlines() if line.startswith("| `capabilities` |"))
    fields = [f.name for f in dataclasses.fields(Capabilities) if f.name != "name"]
    assert [f for f in fields if f"`{f}`" not in row] == []
    assert "**`StepBackend`**" in page and "**`RequestBackend`**" in page   # the two kinds


def test_the_comparison_lists_the_three_engines_and_serving():
    page = (ROOT / "docs" / "comparison.md").read_text()
    assert "not built yet" not in page
    backends = next(line for line in page.splitlines() if line.startswith("| Model backends |"))
    seqstate_cell = backends.split("|")[2]
    for engine in ("transformers", "llama.cpp", "vLLM"):
        assert engine in seqstate_cell
    serving = next(line for line in page.splitlines() if line.startswith("| Production serving"))
    assert serving.split("|")[2].strip().startswith("yes")


def test_lm_evals_hf_backend_groups_rows_as_the_lm_eval_page_says(fresh_tiny):
    """lm-eval.md: lm-eval's HF backend runs one row per distinct context + answer[:-1], so
    one-token answers share a forward and longer ones mostly do not.  Checked against the
    installed lm-eval, so an lm-eval that changes it fails here before the page misleads."""
    from lm_eval.api.instance import Instance    # make install installs lm-eval: no skip
    from lm_eval.models.huggingface import HFLM

    page = (ROOT / "docs" / "tutorials" / "lm-eval.md").read_text()
    assert "runs each (context, answer) pair as its own padded row" not in page
    assert "`context + answer[:-1]`" in page and "PR #1425" in page
    model = fresh_tiny                          # its own weights: the hook below stays here
    lm = HFLM(pretrained=model.hf_model, tokenizer=model.hf_tokenizer, batch_size=1)
    rows = []                                   # the rows of each forward lm-eval runs
    model.hf_model.register_forward_pre_hook(lambda module, args: rows.append(len(args[0])))
    context = "Question: Which is a colour?\nAnswer:"

    def forwarded(answers):
        rows.clear()
        lm.loglikelihood([Instance("loglikelihood", {}, (context, a), i)
                          for i, a in enumerate(answers)], disable_tqdm=True)
        return sum(rows)

    one_token = [" red", " table", " seven"]
    assert [len(model.encode(a)) for a in one_token] == [1, 1, 1]
    assert forwarded(one_token) == 1                        # one row for the question
    assert forwarded([" dark red", " a table", " seven apples"]) == 3      # one per answer
    assert forwarded([" the moon", " the sun"]) == 1        # they differ only in the last token


def test_reliability_page_describes_the_scheduler():
    page = (ROOT / "docs/concepts/reliability.md").read_text()
    assert "serialised" not in page and "one worker thread" in page


PAGE = """# A page

```python
import pathlib
pathlib.Path("{log}").open("a").write("first block ran\\n")
items = [1]
```

```{{.python continuation}}
items.append(2)
```

```{{.python continuation}}
assert items == [1, 2], items
items.append(3)
raise RuntimeError("the third block fails here")
```
"""


def test_a_continuation_block_runs_only_its_own_code_after_the_blocks_before(tmp_path):
    """docs/conftest.py: the page's first block runs once, not once per block after it (the
    plugin's own runner ran it three times here), and a failing block's traceback still names
    its line on the page."""
    log = tmp_path / "ran.txt"
    (tmp_path / "page.md").write_text(PAGE.format(log=log))
    shutil.copy(ROOT / "docs" / "conftest.py", tmp_path / "conftest.py")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "--markdown-docs", "--markdown-docs-syntax=superfences",
                          str(tmp_path / "page.md")],
                         cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert "2 passed, 1 failed" in run.stdout or "1 failed, 2 passed" in run.stdout, run.stdout
    assert log.read_text() == "first block ran\n"
    assert 'page.md", line 16' in run.stdout and "the third block fails here" in run.stdout
