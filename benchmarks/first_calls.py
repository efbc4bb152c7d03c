"""One-time costs on a 262k vocabulary (Gemma 3 270M), each in a fresh process.

Reported: converting the GGUF for the HF engine (an empty cache), loading it from the cache,
the first and second text calls (20 tokens), the first JSON build (2 fields) and the first
regex build, on the HF engine and on llama.cpp.  Targets: the first text call within 1.5x of
the second; the first JSON build under 2 s.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import seqstate as ss
from pydantic import BaseModel
out = {"import": time.perf_counter() - t0}

class City(BaseModel):
    name: str
    population: int

def timed(key, fn):
    t = time.perf_counter()
    value = fn()
    out[key] = time.perf_counter() - t
    return value

engine = sys.argv[1]
path = ss.models.gemma3_gguf()
if engine == "hf":
    m = timed("load", lambda: ss.models.transformers(path))
else:
    m = timed("load", lambda: ss.models.llamacpp(path, n_ctx=2048))
text = ss.text(m)
timed("first text call", lambda: text("Once upon a time", max_tokens=20))
timed("second text call", lambda: text("Far away, long ago", max_tokens=20))
timed("first json build", lambda: ss.json(m, City))
timed("first regex build", lambda: ss.regex(m, r"[0-9]{4}-[0-9]{2}"))
print("RESULT " + json.dumps(out))
"""


def _child(engine: str, cache: str | None = None) -> dict[str, float]:
    env = dict(os.environ)
    if cache is not None:
        env["SEQSTATE_CACHE"] = cache
    done = subprocess.run([sys.executable, "-c", CHILD, engine], env=env, capture_output=True,
                          text=True, check=True)
    line = next(x for x in done.stdout.splitlines() if x.startswith("RESULT "))
    return json.loads(line[len("RESULT "):])


def main(model=None) -> None:
    try:
        import seqstate as ss
        ss.models.gemma3_gguf()
    except Exception as exc:                        # the model package is not installed
        print(f"  Gemma 3 270M unavailable: {exc}")
        return
    print("\n== one-time costs on a 262k vocabulary (Gemma 3 270M), each in a fresh process")
    with tempfile.TemporaryDirectory() as cache:
        t = time.perf_counter()
        cold = _child("hf", cache)
        print(f"  HF engine, empty cache: GGUF -> transformers + first use {cold['load']:.1f} s "
              f"(whole process {time.perf_counter() - t:.1f} s)")
    engines = ["hf"]
    try:
        import llama_cpp  # noqa: F401
        engines.append("llama.cpp")
    except ImportError:
        print("  llama.cpp engine unavailable")
    for engine in engines:
        r = _child(engine)
        first, second = r["first text call"], r["second text call"]
        print(f"  {engine:<9} load {r['load']:5.2f} s   first text call {first:5.2f} s   "
              f"second {second:5.2f} s ({first / second:.2f}x; target <= 1.5x)   "
              f"first json build {r['first json build']:5.2f} s (target < 2 s)   "
              f"first regex build {r['first regex build']:5.2f} s")
