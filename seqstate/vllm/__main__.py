"""``python -m seqstate.vllm serve``: see `seqstate.vllm`."""

import sys

from seqstate.vllm import main

if __name__ == "__main__":
    sys.exit(main())
