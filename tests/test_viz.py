"""The HTML pictures: the state's token colouring and the prefix tree, rendered in Chromium."""

import shutil
import subprocess

from PIL import Image

import seqstate as ss


def test_tree_structure(tiny):
    # a hot sampler: the three samples of each prompt differ from their first token
    s = ss.text(tiny)(["Fork me", "Other"], num_samples=3, sampler=ss.multinomial(temperature=50.0),
                      seed=0, max_tokens=3)
    svg = ss.viz.tree(s).svg()
    assert svg.count("<rect") == 2 + 6            # two prompts, six suffixes
    assert svg.count("<line") == 6
    assert "[1,2]" in svg and "#cfe3ff" in svg    # leaves labelled; stored KV drawn blue
    one = ss.viz.tree(ss.from_tokens(tiny, [tiny.encode("never run")]))
    assert "#e6e6e6" in one.svg()                 # no KV yet: grey


def test_html_repr_marks_generated_tokens(tiny):
    s = ss.text(tiny)("abc", max_tokens=2)
    html = s._repr_html_()
    assert html.count("title='logprob") == 2 and "[0,0]" in html


def test_rendering_in_headless_chromium(tiny, tmp_path):
    chromium = shutil.which("chromium")
    assert chromium, "make test installs Debian's chromium; install it with apt-get install chromium"
    s = ss.text(tiny)(["Fork me", "Other prompt"], num_samples=3, sampler=ss.multinomial(),
                      seed=0, max_tokens=4)
    page = tmp_path / "state.html"
    page.write_text(f"<html><body>{s._repr_html_()}{ss.viz.tree(s).svg()}</body></html>")
    shot = tmp_path / "state.png"
    subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                    "--no-first-run", "--disable-background-networking", "--disable-component-update",
                    "--disable-sync", f"--user-data-dir={tmp_path / 'profile'}",
                    f"--screenshot={shot}", "--window-size=900,600", page.as_uri()],
                   check=True, capture_output=True, timeout=120)
    img = Image.open(shot).convert("RGB")
    assert img.size == (900, 600)
    colours = img.getcolors(maxcolors=1 << 20)
    assert len(colours) > 50                       # text, boxes, token colours: not a blank page
    assert any(rgb == (0xcf, 0xe3, 0xff) for _, rgb in colours)   # the stored-KV box fill
