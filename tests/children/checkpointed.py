"""A child process for the crash-resume test: ``run_batch`` over 12 inputs with a checkpoint.

    python tests/children/checkpointed.py PATH run      # the parent SIGKILLs it mid-run
    python tests/children/checkpointed.py PATH rerun    # resumes; prints one JSON line

``rerun`` prints how many inputs the checkpoint held, how many times the program was called,
and whether the results equal those of a run without a checkpoint.
"""

from __future__ import annotations

import json
import sqlite3
import sys

import seqstate as ss

model = ss.models.testing.tiny()
text = ss.text(model)
INPUTS = [f"item {i}" for i in range(12)]
calls: list[str] = []


def program(item: str) -> dict:
    calls.append(item)
    s = text(f"Describe {item}:", max_tokens=24)
    return {"item": item, "text": s.generated, "state": s}


def main() -> None:
    path, mode = sys.argv[1], sys.argv[2]
    if mode == "run":
        ss.run_batch(program, INPUTS, concurrency=2, checkpoint=path, progress=False)
        return
    with sqlite3.connect(path) as db:
        held = db.execute("SELECT count(*) FROM results").fetchone()[0]
    resumed = ss.run_batch(program, INPUTS, concurrency=4, checkpoint=path, progress=False)
    called = len(calls)
    fresh = ss.run_batch(program, INPUTS, concurrency=4, progress=False)
    same = [(r["item"], r["text"], r["state"].token_ids) for r in resumed] == \
        [(r["item"], r["text"], r["state"].token_ids) for r in fresh]
    print(json.dumps({"held": held, "calls": called, "inputs": len(INPUTS), "equal": same}))


if __name__ == "__main__":
    main()
