"""``python -m seqstate.lm_eval ...``: the same as ``seqstate-lm-eval ...``."""

from seqstate.lm_eval.cli import main

if __name__ == "__main__":
    main()
