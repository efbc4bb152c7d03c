"""A child process for the interrupt test: ``run_batch`` of 8 programs, each several calls
long; the parent sends SIGINT once the run is under way.

Prints JSON lines: ``{"running": t}`` when the run starts, then ``{"interrupted": t, ...}``
with the ``time.monotonic()`` at which ``KeyboardInterrupt`` reached the caller (the clock is
the system's, shared with the parent) and whether the model works afterwards.

    python tests/children/interrupted.py hf|llama.cpp ROUNDS TOKENS
"""

from __future__ import annotations

import json
import sys
import threading
import time

import seqstate as ss


def model_of(engine: str):
    if engine == "hf":
        return ss.models.testing.tiny()
    return ss.models.default(engine="llama.cpp", n_ctx=8192, n_threads=1)


def main() -> None:
    engine, rounds, tokens = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    model = model_of(engine)
    text = ss.text(model)
    check = text("Once upon a time", max_tokens=8).token_ids          # greedy, alone

    def program(i: int) -> str:
        s = text(f"Story {i}: once upon a time", max_tokens=tokens)
        for _ in range(rounds - 1):
            s = text(s + "\nThen", max_tokens=tokens)
        return str(s)

    print(json.dumps({"running": time.monotonic()}), flush=True)
    try:
        ss.run_batch(program, range(8), concurrency=8, progress=False)
        print(json.dumps({"finished": time.monotonic()}), flush=True)
        return
    except KeyboardInterrupt:
        caught = time.monotonic()
    threads = [t.name for t in threading.enumerate() if t.name.startswith("seqstate-run-batch")]
    again = text("Once upon a time", max_tokens=8).token_ids
    if model.store is not None:
        model.store.verify()
    print(json.dumps({"interrupted": caught, "usable": again == check,
                      "program_threads_left": len(threads),
                      "held": model.stats.kv_bytes_held}), flush=True)


if __name__ == "__main__":
    main()
