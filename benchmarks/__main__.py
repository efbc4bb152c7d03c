"""`make bench`: every suite on the real default model, ratios against peers in the same run."""

import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import seqstate as ss  # noqa: E402
from benchmarks import (batch, beam, engine, engines, first_calls, hooks,  # noqa: E402
                        json_schemas, programs, speculation)

SUITES = {"engine": engine.main, "programs": programs.main, "hooks": hooks.main,
          "beam": beam.main, "batch": batch.main, "json": json_schemas.main,
          "engines": engines.main, "speculation": speculation.main,
          "first_calls": first_calls.main}


def main(argv: list[str]) -> None:
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    model = ss.models.default()
    for name in argv or list(SUITES):
        SUITES[name](model)


if __name__ == "__main__":
    main(sys.argv[1:])
