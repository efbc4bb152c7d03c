"""The overhead suite of two checkouts, in turns, in one session: before/after figures.

``python benchmarks/compare_overhead.py BEFORE AFTER [--models tiny,smollm2] [--rounds 2]
[--repeat 5]`` (or ``benchmarks/compare_overhead.sh BEFORE AFTER``) runs, for each round and
each model, ``benchmarks.overhead.measure`` of BEFORE's checkout, then AFTER's, each in a
process of its own that imports that checkout's ``seqstate`` (one thread, glibc's malloc
pinned), and prints both tables one after the other, then every run's ratios side by side.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

RUN = """
import sys
sys.path.insert(0, {root!r})
import torch
torch.set_num_threads(1)
import seqstate as ss
from benchmarks import harness, overhead
print("seqstate from", ss.__file__, flush=True)
print(harness.steady_allocator(), flush=True)
model = ss.models.testing.tiny() if {name!r} == "tiny" else ss.models.default()
overhead.measure(model, {name!r}, {repeat})
"""


def run(root: str, name: str, repeat: int) -> str:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               TOKENIZERS_PARALLELISM="false")
    env.pop("PYTHONPATH", None)
    out = subprocess.run([sys.executable, "-c", RUN.format(root=root, name=name, repeat=repeat)],
                         cwd=root, env=env, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{root}: the overhead suite failed\n{out.stderr[-4000:]}")
    return out.stdout


def ratios(text: str) -> dict[int, str]:
    """Per row count, the best-run cells of a `measure` table."""
    found = {}
    for line in text.splitlines():
        m = re.match(r"\s+(\d+)\s+[\d.]+ ms\s", line)
        if m:
            found[int(m.group(1))] = " ".join(re.findall(r"\(([\d.]+x)\)", line))
    return found


def main() -> None:
    parser = argparse.ArgumentParser(prog="benchmarks/compare_overhead.py")
    parser.add_argument("before")
    parser.add_argument("after")
    parser.add_argument("--models", default="tiny,smollm2")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    roots = {"before": os.path.abspath(args.before), "after": os.path.abspath(args.after)}
    summary = []
    for k in range(args.rounds):
        for name in args.models.split(","):
            for side, root in roots.items():
                text = run(root, name, args.repeat)
                print(f"\n#### round {k + 1}, {name}, {side} ({root})\n{text}", flush=True)
                summary.append((k + 1, name, side, ratios(text)))
    print("\n#### best-run ratios to the hand loop (regex text json), per round")
    for k, name, side, found in summary:
        print(f"  round {k} {name:>8} {side:>6}: "
              + "; ".join(f"{rows} rows {cells}" for rows, cells in sorted(found.items())))


if __name__ == "__main__":
    main()
