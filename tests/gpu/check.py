"""``make gpu-check``: the exactness subset (tests/gpu/) on CUDA where torch sees a CUDA
device; elsewhere it says so and exits 0, so nothing else ever depends on a GPU.

``python tests/gpu/check.py [--device cuda:1]`` picks another device (default ``cuda``).
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import pytest
import torch

HERE = pathlib.Path(__file__).resolve().parent


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="a CUDA device (default: cuda)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("no CUDA device: nothing run")
        return 0
    device = torch.device(args.device)
    print(f"exactness subset on {device} ({torch.cuda.get_device_name(device)}), "
          f"torch {torch.__version__}, CUDA {torch.version.cuda}")
    return int(pytest.main(["-q", "-rs", "-p", "no:cacheprovider", str(HERE),
                            "--device", str(device)]))


if __name__ == "__main__":
    sys.exit(main())
