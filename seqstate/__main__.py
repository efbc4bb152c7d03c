"""`python -m seqstate demo`: a short chained program on the default model, with timings."""

from __future__ import annotations

import sys
import time


def demo() -> None:
    t0 = time.perf_counter()
    import seqstate as ss

    model = ss.models.default()
    print(f"loaded {model.name} in {time.perf_counter() - t0:.1f} s")
    ss_demo = __import__("seqstate.demo", fromlist=["run"])
    ss_demo.run(model)


def main(argv: list[str]) -> int:
    if argv[:1] != ["demo"]:
        print("usage: python -m seqstate demo", file=sys.stderr)
        return 2
    demo()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
