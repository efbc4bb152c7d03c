"""`make bench`: every suite on the real default model, ratios against peers in the same run.

``python -m benchmarks [suite ...] [--questions N] [--batch-sizes 8,32] [--schemas N]
[--time-limit S] [--details PATH]``: the scoring suite's options (the first N ARC-Easy
questions; lm-eval HF backend batch sizes) and maskbench's (the first N schemas, seconds a
schema per engine, a JSON-lines file of per-schema results).
"""

import argparse
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import seqstate as ss  # noqa: E402
from benchmarks import (activations, batch, beam, engine, engines,  # noqa: E402
                        first_calls, hooks, json_schemas, kept, maskbench, masks, overhead,
                        programs, scoring, service, speculation, vllm, vllm_pool)

SUITES = {"engine": engine.main, "programs": programs.main, "hooks": hooks.main,
          "beam": beam.main, "batch": batch.main, "json": json_schemas.main,
          "engines": engines.main, "speculation": speculation.main,
          "first_calls": first_calls.main, "scoring": scoring.main,
          "variants": scoring.variants_main, "vllm": vllm.main, "kept": kept.main,
          "overhead": overhead.main, "service": service.main,
          "activations": activations.main, "pool": vllm_pool.main, "maskbench": maskbench.main,
          "masks": masks.main}


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks")
    parser.add_argument("suites", nargs="*", metavar="suite",
                        help=f"suites to run (default: all): {', '.join(SUITES)}")
    parser.add_argument("--questions", type=int, default=None,
                        help="scoring: the first N ARC-Easy questions (default: all 570)")
    parser.add_argument("--batch-sizes", default="8,32",
                        help="scoring: lm-eval HF backend batch sizes, the fastest kept")
    parser.add_argument("--schemas", type=int, default=None,
                        help="maskbench: the first N schemas (default: all 3,000)")
    parser.add_argument("--time-limit", type=float, default=20.0,
                        help="maskbench: seconds a schema may take on one engine")
    parser.add_argument("--details", default=None,
                        help="maskbench: write per-schema results to this JSON-lines file")
    args = parser.parse_args(argv)
    unknown = [s for s in args.suites if s not in SUITES]
    if unknown:
        parser.error(f"unknown suites {unknown}; the suites are {', '.join(SUITES)}")
    options = {"scoring": {"questions": args.questions,
                           "batch_sizes": tuple(int(b) for b in args.batch_sizes.split(","))},
               "maskbench": {"schemas": args.schemas, "time_limit": args.time_limit,
                             "out": args.details}}
    print(f"torch {torch.__version__}, threads {torch.get_num_threads()}")
    model = ss.models.default()
    for name in args.suites or list(SUITES):
        SUITES[name](model, **options.get(name, {}))


if __name__ == "__main__":
    main(sys.argv[1:])
