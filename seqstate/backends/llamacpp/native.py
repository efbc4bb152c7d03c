"""llama.cpp itself: one model and context, their batch, and the few calls seqstate makes.

Two things here keep every row's logits independent of what else runs (see docs/engines.md,
"Exactness on llama.cpp"):

- the KV types make llama.cpp's CPU flash attention take its per-query-row kernel, whatever
  the batch holds (`KV_TYPES`);
- no freed cell is ever reused below live ones.  Cells are freed only by `Llama.compact()`,
  which packs the live cells to the bottom of the cache in their order; everything else that
  would free cells (`Llama.seq_rm`) leaves them tagged with a garbage sequence until then.
  llama.cpp places new tokens in the lowest free cells at or above its search head, and with no
  free cell below a live one that is always above every live cell, so each sequence's cells
  stay in position order, the order a fresh evaluation sums them in.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import weakref
from collections.abc import Iterator, Sequence

import llama_cpp as ll
import numpy as np
import torch

from seqstate.errors import EngineError, ModelNotAvailable

__all__ = ["Llama", "check_gguf", "padding_only", "quiet_logs", "logged_errors", "usable_cores",
           "SCRATCH_SEQ", "GARBAGE_SEQ", "KV_TYPES", "GGUF_MAGIC"]

GGUF_MAGIC = b"GGUF"

# the `options.RESERVED_SEQS` sequence ids seqstate keeps for itself
SCRATCH_SEQ = 0               # fresh evaluations (`LlamaCppBackend.fresh_logits`)
GARBAGE_SEQ = 1               # cells nothing uses any more, kept occupied until compact()

# (K, V) cache types, first that the model takes.  K and V of different types keep llama.cpp's
# CPU flash attention on its per-row kernel for every batch: its tiled kernel (64+ query rows
# in a ubatch) and split-KV kernel (one query over 512+ cells) need K and V both f16 or f32,
# and they group cells by absolute cell index, so a row's result would depend on where its
# cells lie.  q8_0 needs head dims divisible by 32; f32 V is the fallback.
KV_TYPES = ((ll.GGML_TYPE_F16, ll.GGML_TYPE_Q8_0), (ll.GGML_TYPE_F16, ll.GGML_TYPE_F32))
_BYTES = {ll.GGML_TYPE_F16: 2.0, ll.GGML_TYPE_F32: 4.0, ll.GGML_TYPE_Q8_0: 34 / 32}
_STATE_HEADER = 8             # magic and sequence id before a sequence state's cells
_LOG_ERROR = 4                # GGML_LOG_LEVEL_ERROR


def check_gguf(path: str | os.PathLike) -> None:
    """`ModelNotAvailable` unless ``path`` is a readable file that starts as a GGUF file does
    (checked before llama.cpp, which may abort the process on a foreign file, touches it)."""
    try:
        with open(path, "rb") as f:
            head = f.read(len(GGUF_MAGIC))
    except OSError as exc:
        raise ModelNotAvailable(f"cannot read the model file {os.fspath(path)!r} ({exc}); pass "
                                f"the path of a local .gguf file") from exc
    if head != GGUF_MAGIC:
        raise ModelNotAvailable(
            f"{os.fspath(path)!r} is not a GGUF file: it starts with {head!r}, a GGUF file with "
            f"{GGUF_MAGIC!r}; the llama.cpp engine takes .gguf files (a transformers checkpoint "
            f"loads with ss.models.transformers())")


def padding_only(path: str | os.PathLike, start: int) -> bool:
    """True when every token of the GGUF file at ``path`` from id ``start`` on is unused
    padding (llama.cpp's UNUSED attribute: ids a converter adds to round the vocabulary up to
    the embedding's rows), so that a tokenizer of ``start`` tokens is the file's own.  Reads
    the vocabulary only."""
    params = ll.llama_model_default_params()
    params.vocab_only = True
    model = ll.llama_model_load_from_file(os.fspath(path).encode(), params)
    if not model:
        return False
    try:
        vocab = ll.llama_model_get_vocab(model)
        return all(ll.llama_vocab_get_attr(vocab, token) & ll.LLAMA_TOKEN_ATTR_UNUSED
                   for token in range(start, ll.llama_vocab_n_tokens(vocab)))
    finally:
        ll.llama_model_free(model)


def _ignore_log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    """llama.cpp's log callback: seqstate keeps the C library quiet."""


# llama.cpp holds this pointer for the life of the process, so it must never be collected
_QUIET_LOG = ll.llama_log_callback(_ignore_log)


def quiet_logs() -> None:
    """Silence llama.cpp's C logging (its log callback is one for the whole process)."""
    ll.llama_log_set(_QUIET_LOG, None)


@contextlib.contextmanager
def logged_errors() -> Iterator[list[str]]:
    """The error lines llama.cpp logs while the block runs, which say why a load failed.

    The log callback is one for the whole process: the one set before keeps receiving every
    line (quiet or not, as it was) and is set again after the block.
    """
    previous, data = ll.llama_log_callback(), ctypes.c_void_p()
    ll.llama_log_get(ctypes.byref(previous), ctypes.byref(data))
    errors: list[str] = []

    def capture(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
        if level == _LOG_ERROR and text:
            errors.append(text.decode(errors="replace").strip())
        if previous:
            previous(level, text, data)

    callback = ll.llama_log_callback(capture)      # referenced until the block ends
    ll.llama_log_set(callback, data)
    try:
        yield errors
    finally:
        ll.llama_log_set(previous, data)


def _cause(line: str) -> str:
    """One of llama.cpp's error lines without the name of the C function that logged it."""
    return re.sub(r"^\w+: ", "", line).removeprefix("error loading model: ")


def _not_loaded(path: str, errors: list[str]) -> str:
    """Why llama.cpp refused a file that starts as a GGUF file does, and what to do."""
    # the first line is the cause; later ones report the failure again
    reason = _cause(errors[0]) if errors else "no reason logged"
    version = getattr(ll, "__version__", "?")
    arch = (f"an architecture the llama.cpp inside llama-cpp-python {version} does not know "
            "(a newer llama-cpp-python may; ss.models.transformers() reads some GGUF files too)")
    cut = "a truncated or damaged file (an interrupted download or copy: fetch it again)"
    if "architecture" in reason:
        causes = arch
    elif any(word in reason for word in ("bounds", "incomplete", "corrupted", "file size")):
        causes = cut
    else:
        causes = f"{arch}, or {cut}"
    return f"llama.cpp could not load {path!r} (llama.cpp: {reason}); the likely cause: {causes}"


def _free_llama(model: ll.llama_model_p, ctx: ll.llama_context_p, batch: ll.llama_batch) -> None:
    ll.llama_batch_free(batch)
    ll.llama_free(ctx)
    ll.llama_model_free(model)


class Llama:
    """The ctypes side: one model, one context with a unified KV cache, one batch buffer."""

    def __init__(self, path: str, n_ctx: int, n_threads: int, n_seq_max: int, n_batch: int,
                 quiet: bool = True) -> None:
        if quiet:
            quiet_logs()
        ll.llama_backend_init()
        with logged_errors() as errors:
            self.model = ll.llama_model_load_from_file(path.encode(),
                                                       ll.llama_model_default_params())
        if not self.model:
            raise ModelNotAvailable(_not_loaded(path, errors))
        params = ll.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = params.n_ubatch = n_batch
        params.n_seq_max = n_seq_max
        params.n_threads = params.n_threads_batch = n_threads
        params.kv_unified = True                      # seq_cp shares cells instead of copying
        params.flash_attn_type = ll.LLAMA_FLASH_ATTN_TYPE_ENABLED
        params.no_perf = True
        for self.k_type, self.v_type in KV_TYPES:
            params.type_k, params.type_v = self.k_type, self.v_type
            with logged_errors() as errors:
                self.ctx = ll.llama_init_from_model(self.model, params)
            if self.ctx:
                break
        if not self.ctx:
            kv_gib = n_ctx * self.bytes_per_cell() / 2**30
            ll.llama_model_free(self.model)
            # the first line says what ran out, the last what it was for
            said = "; ".join(dict.fromkeys(_cause(e) for e in errors[:1] + errors[-1:]))
            said = f" (llama.cpp: {said})" if said else ""
            raise ModelNotAvailable(
                f"llama.cpp could not create a context for {path!r} with n_ctx={n_ctx}, "
                f"n_seq_max={n_seq_max}, n_batch={n_batch}{said}; its KV cache alone takes "
                f"about {kv_gib:.2f} GiB, and most often memory ran out: pass a smaller n_ctx "
                f"(KV cells shared by every state and row) or a smaller n_seq_max")
        self.mem = ll.llama_get_memory(self.ctx)
        self.n_batch = n_batch
        self.n_seq_max = n_seq_max
        self.garbage = False                          # cells tagged GARBAGE_SEQ exist
        self.compactions = 0
        self.batch = ll.llama_batch_init(n_batch, 0, 1)
        self._token = np.ctypeslib.as_array(self.batch.token, shape=(n_batch,))
        self._pos = np.ctypeslib.as_array(self.batch.pos, shape=(n_batch,))
        self._out = np.ctypeslib.as_array(self.batch.logits, shape=(n_batch,))
        np.ctypeslib.as_array(self.batch.n_seq_id, shape=(n_batch,))[:] = 1
        self._seq_rows = [self.batch.seq_id[i] for i in range(n_batch)]
        self.vocab_size = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(self.model))
        self._free = weakref.finalize(self, _free_llama, self.model, self.ctx, self.batch)

    def close(self) -> None:
        """Free the model, its context and its batch now (once; nothing may use them after)."""
        self._free()

    def meta(self, key: str) -> str | None:
        buf = ctypes.create_string_buffer(256)
        n = ll.llama_model_meta_val_str(self.model, key.encode(), buf, len(buf))
        return buf.value.decode() if n >= 0 else None

    def bytes_per_cell(self) -> int:
        """K and V bytes one cached token takes over all layers."""
        arch = self.meta("general.architecture") or "llama"
        heads = ll.llama_model_n_head(self.model)
        k_dim = int(self.meta(f"{arch}.attention.key_length") or ll.llama_model_n_embd(self.model) // heads)
        v_dim = int(self.meta(f"{arch}.attention.value_length") or k_dim)
        per_layer = ll.llama_model_n_head_kv(self.model) * (k_dim * _BYTES[self.k_type]
                                                             + v_dim * _BYTES[self.v_type])
        return round(ll.llama_model_n_layer(self.model) * per_layer)

    DECODE_STATUS = {
        2: "aborted by the abort callback",
        -1: "an invalid batch (a token id outside the vocabulary, a sequence id of n_seq_max "
            "or more, or positions that do not continue the sequence's stored ones)",
        -2: "a fatal failure, usually memory: the KV cache could not prepare the batch, or the "
            "output or compute buffers could not be allocated",
        -3: "the computation failed",
    }

    def decode(self, tokens: Sequence[int], positions: Sequence[int], seqs: Sequence[int],
               outputs: Sequence[bool]) -> int:
        """One ``llama_decode``; returns its status (llama.h, llama-cpp-python 0.3.36):

        - 0: done;
        - 1: no KV slot for the batch: too few free cells (nothing changed);
        - 2: aborted by the abort callback;
        - -1: an invalid batch, such as a token id outside the vocabulary, a sequence id
          of ``n_seq_max`` or more, or positions that do not continue the sequence's stored
          ones (nothing changed);
        - -2: a fatal failure, usually memory: the KV cache could not prepare the batch, or
          the output or compute buffers could not be allocated;
        - -3: the computation failed.

        After 2, -2 and -3 the ubatches already computed stay in the cache.
        """
        n = len(tokens)
        self._token[:n] = tokens
        self._pos[:n] = positions
        self._out[:n] = outputs
        rows = self._seq_rows
        for i, seq in enumerate(seqs):
            rows[i][0] = seq
        self.batch.n_tokens = n
        return ll.llama_decode(self.ctx, self.batch)

    def logits(self, n_outputs: int) -> torch.Tensor:
        """The last decode's logits, one row per output token in batch order: (n, V) copy."""
        ptr = ll.llama_get_logits(self.ctx)
        view = np.ctypeslib.as_array(ptr, shape=(n_outputs, self.vocab_size))
        return torch.from_numpy(view.copy())

    # -- the Memory protocol of SeqStore --------------------------------------------------------
    def seq_rm(self, seq: int, p0: int, p1: int) -> None:
        """Untag positions ``[p0, p1)`` of ``seq``; cells no other sequence holds become
        garbage (occupied until `compact()`), never free cells below live ones."""
        ll.llama_memory_seq_cp(self.mem, seq, GARBAGE_SEQ, p0, p1)
        self.garbage = True
        if not ll.llama_memory_seq_rm(self.mem, seq, p0, p1):
            raise EngineError(f"llama.cpp refused to remove positions [{p0}, {p1}) of sequence "
                              f"{seq}: this model's memory cannot drop the end of a sequence "
                              f"(a recurrent or hybrid architecture); seqstate's llama.cpp "
                              f"engine needs a transformer's KV cache")

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        ll.llama_memory_seq_cp(self.mem, src, dst, p0, p1)

    def seq_pos_min(self, seq: int) -> int:
        return ll.llama_memory_seq_pos_min(self.mem, seq)

    def seq_pos_max(self, seq: int) -> int:
        return ll.llama_memory_seq_pos_max(self.mem, seq)

    # -- cell layout ------------------------------------------------------------------------------
    def free_top(self, seq: int) -> None:
        """Free every cell of ``seq`` at once; only for a sequence whose cells are the topmost
        ones of the cache (the scratch sequence right after its evaluation): no hole results."""
        ll.llama_memory_seq_rm(self.mem, seq, -1, -1)

    def compact(self) -> bool:
        """Free the garbage cells and pack the live ones to the bottom, in their order.

        The whole cache goes through llama.cpp's own state copy (out, then back in from cell
        0): bytes, positions and sequence tags are kept exactly.  Returns False when there was
        no garbage to free.
        """
        if not self.garbage:
            return False
        ll.llama_memory_seq_rm(self.mem, GARBAGE_SEQ, -1, -1)
        buf, n = self._state()
        if ll.llama_state_seq_set_data(self.ctx, buf.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)),
                                       n, -1) != n:
            raise RuntimeError("llama.cpp could not restore its KV cache while compacting it")
        self.garbage = False
        self.compactions += 1
        return True

    def _state(self) -> tuple[np.ndarray, int]:
        n = ll.llama_state_seq_get_size(self.ctx, -1)
        buf = np.empty(n, np.uint8)
        if ll.llama_state_seq_get_data(self.ctx, buf.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)),
                                       n, -1) != n:
            raise RuntimeError("llama.cpp could not copy out its KV cache")
        return buf, n

    def cell_positions(self) -> dict[int, list[int]]:
        """Per sequence, the positions of its cells in cell order (a check of the layout; it
        copies the whole cache).  Reads the cache's first section: the full-attention cells."""
        buf, n = self._state()
        words = buf[_STATE_HEADER: n - (n - _STATE_HEADER) % 4].view(np.int32)
        # n_stream, cell_count, then per cell: position, n_seq_id, the sequence ids
        if words[0] != 1:
            raise RuntimeError(f"expected a unified KV cache (one stream), got {words[0]}")
        out: dict[int, list[int]] = {}
        at = 2
        for _ in range(int(words[1])):
            pos, n_ids = int(words[at]), int(words[at + 1])
            if not 0 < n_ids <= self.n_seq_max:
                raise RuntimeError("cannot read llama.cpp's cell layout (a model with extra "
                                   "per-cell data?)")
            for seq in words[at + 2: at + 2 + n_ids]:
                out.setdefault(int(seq), []).append(pos)
            at += 2 + n_ids
        return out


def usable_cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
