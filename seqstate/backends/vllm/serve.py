"""``python -m seqstate.vllm serve``: a `Server` from the command line, until Ctrl-C or ``kill``;
``python -m seqstate.vllm router URL ...``: a `Router` (vllm-router) in front of servers.

Everything after ``--`` goes to vLLM (or vllm-router) verbatim, after seqstate's own flags,
so it wins over them: ``serve --dtype bfloat16 -- --ssl-keyfile key.pem --ssl-certfile
cert.pem``; ``router URL URL -- --retry-max-retries 3``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from typing import Any

from seqstate.backends.vllm.gateway import POLICIES, Router
from seqstate.backends.vllm.model import API_KEY_ENV
from seqstate.backends.vllm.server import Process, Server, keyed, loopback
from seqstate.errors import ArgumentError, EngineError, ModelNotAvailable

__all__ = ["main", "parser"]


def parser() -> argparse.ArgumentParser:
    """The command line's parser (its ``serve`` subcommand holds every option)."""
    top = argparse.ArgumentParser(
        prog="python -m seqstate.vllm", description="Serve a model with vLLM and seqstate's "
        "plugin, or put vllm-router in front of servers.  Anything after `--` is passed to "
        "vLLM (or vllm-router) verbatim.")
    sub = top.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="start a server and wait; Ctrl-C stops it")
    serve.add_argument("--model", help="a transformers checkpoint folder or a GGUF file, "
                                       "dequantized to fp32 once (default: the default model, "
                                       "SmolLM2-135M-Instruct)")
    serve.add_argument("--port", type=int, help="default: a free port")
    serve.add_argument("--host", default="127.0.0.1",
                       help="the interface to listen on (default 127.0.0.1, this machine only)")
    serve.add_argument("--python", help="the server environment's Python (default: .venv-vllm)")
    serve.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None,
                       help=f"requests must carry this key (default: ${API_KEY_ENV})")
    serve.add_argument("--dtype", help="default: float32 on a CPU, the model's on CUDA")
    serve.add_argument("--tensor-parallel-size", type=int)
    serve.add_argument("--max-model-len", type=int,
                       help="default: 8192 on a CPU, the model's on CUDA")
    serve.add_argument("--gpu-memory-utilization", type=float)
    serve.add_argument("--kv-cache-gib", type=float,
                       help="the KV cache per device, in GiB (default: 1 on a CPU; on CUDA "
                            "vLLM's --gpu-memory-utilization)")
    router = sub.add_parser("router", help="start vllm-router in front of servers and wait; "
                                           "Ctrl-C stops it")
    router.add_argument("urls", nargs="+", metavar="URL", help="the vLLM servers")
    router.add_argument("--policy", default="consistent_hash", choices=POLICIES,
                        help="vllm-router's policy (default: consistent_hash, which keeps "
                             "each lineage on one server by seqstate's X-Session-ID)")
    router.add_argument("--port", type=int, help="default: a free port")
    router.add_argument("--host", default="127.0.0.1",
                        help="the interface to listen on (default 127.0.0.1)")
    router.add_argument("--python", help="the server environment's Python, whose bin holds "
                                         "vllm-router (default: .venv-vllm)")
    return top


def main(argv: list[str] | None = None) -> int:
    """``python -m seqstate.vllm serve [options] [-- vLLM flags]`` or ``router URL ...
    [options] [-- vllm-router flags]``; the exit status."""
    argv = list(sys.argv[1:] if argv is None else argv)
    cut = argv.index("--") if "--" in argv else len(argv)
    args, extra = parser().parse_args(argv[:cut]), tuple(argv[cut + 1:])
    if args.command == "router":
        try:
            router = Router(args.urls, args.policy, port=args.port, host=args.host,
                            python=args.python, extra_args=extra, log=sys.stderr)
            print(f"starting vllm-router on {router.url} ({args.policy}, in front of "
                  f"{' '.join(router.urls)}) ...", file=sys.stderr)
            router.start()
        except (ModelNotAvailable, ArgumentError, EngineError) as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        return _until_stopped(router)
    if not loopback(args.host) and not keyed(args.api_key, extra):
        print(f"warning: listening on {args.host} without an API key: anyone who can reach "
              "this port can run the model; pass --api-key KEY (or set "
              f"${API_KEY_ENV}), and put TLS in front of it (see the docs' page Deploying with "
              "vLLM)", file=sys.stderr)
    try:
        server = Server(args.model, port=args.port, host=args.host, python=args.python,
                        dtype=args.dtype, tensor_parallel_size=args.tensor_parallel_size,
                        max_model_len=args.max_model_len,
                        gpu_memory_utilization=args.gpu_memory_utilization,
                        kv_cache_gib=args.kv_cache_gib, api_key=args.api_key,
                        extra_args=extra, log=sys.stderr)
        device = "CUDA, vLLM's defaults" if server.cuda else "CPU, the exact profile"
        device += ", Model Runner V2" if server.runner_v2 else ", the V1 model runner"
        print(f"starting vLLM on {server.url} (model {server.folder}; {device}) ...",
              file=sys.stderr)
        server.start()
    except (ModelNotAvailable, ArgumentError, EngineError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return _until_stopped(server)


def _until_stopped(started: Process) -> int:
    """Print the started process's URL and wait until it ends, or Ctrl-C or ``kill`` end it."""
    print(started.url, flush=True)
    signal.signal(signal.SIGTERM, _interrupt)          # `kill` stops it as Ctrl-C does
    try:
        while started.process is not None and started.process.poll() is None:
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        started.stop()
    return 0


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt
