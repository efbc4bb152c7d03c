#!/bin/sh
# The overhead suite of two checkouts in turns: benchmarks/compare_overhead.sh BEFORE AFTER [options]
# (options: --models tiny,smollm2 --rounds 2 --repeat 5; see benchmarks/compare_overhead.py).
here=$(dirname "$0")
exec "${PYTHON:-$here/../.venv/bin/python}" "$here/compare_overhead.py" "$@"
