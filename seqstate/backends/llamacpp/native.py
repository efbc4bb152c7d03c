"""llama.cpp itself: one model and context, their batch, and the few calls seqstate makes."""

from __future__ import annotations

import ctypes
import os
import weakref
from collections.abc import Sequence

import llama_cpp as ll
import numpy as np
import torch

from seqstate.errors import ModelNotAvailable

__all__ = ["Llama", "usable_cores"]

_K_BYTES = 2.0                # bytes per K element: f16, llama.cpp's default
_V_TYPES = {ll.GGML_TYPE_Q8_0: 34 / 32, ll.GGML_TYPE_F16: 2.0}   # V type -> bytes per element


def _ignore_log(level: int, text: bytes, user_data: ctypes.c_void_p) -> None:
    """llama.cpp's log callback: seqstate keeps the C library quiet."""


# llama.cpp holds this pointer for the life of the process, so it must never be collected
_QUIET_LOG = ll.llama_log_callback(_ignore_log)


def _free_llama(model: ll.llama_model_p, ctx: ll.llama_context_p, batch: ll.llama_batch) -> None:
    ll.llama_batch_free(batch)
    ll.llama_free(ctx)
    ll.llama_model_free(model)


class Llama:
    """The ctypes side: one model, one context with a unified KV cache, one batch buffer."""

    def __init__(self, path: str, n_ctx: int, n_threads: int, n_seq_max: int, n_batch: int) -> None:
        ll.llama_log_set(_QUIET_LOG, None)
        ll.llama_backend_init()
        self.model = ll.llama_model_load_from_file(path.encode(), ll.llama_model_default_params())
        if not self.model:
            raise ModelNotAvailable(f"llama.cpp could not load {path!r}; expected a GGUF model file")
        params = ll.llama_context_default_params()
        params.n_ctx = n_ctx
        params.n_batch = params.n_ubatch = n_batch
        params.n_seq_max = n_seq_max
        params.n_threads = params.n_threads_batch = n_threads
        params.kv_unified = True                      # seq_cp shares cells instead of copying
        # Flash attention with K and V of different types (f16 / q8_0) always runs llama.cpp's
        # per-row CPU kernel: its tiled kernel (64+ query rows) and split-KV kernel (one query,
        # 512+ cells) need equal types and round differently, which would make a row's logits
        # depend on what else is in its batch.  q8_0 V also saves a third of the KV memory.
        params.flash_attn_type = ll.LLAMA_FLASH_ATTN_TYPE_ENABLED
        params.no_perf = True
        for v_type in _V_TYPES:                       # q8_0 needs head dims divisible by 32
            params.type_v = self.v_type = v_type
            self.ctx = ll.llama_init_from_model(self.model, params)
            if self.ctx:
                break
        if not self.ctx:
            ll.llama_model_free(self.model)
            raise RuntimeError(f"llama.cpp could not create a context with n_ctx={n_ctx}, "
                               f"n_seq_max={n_seq_max}, n_batch={n_batch}")
        self.mem = ll.llama_get_memory(self.ctx)
        self.n_batch = n_batch
        self.batch = ll.llama_batch_init(n_batch, 0, 1)
        self._token = np.ctypeslib.as_array(self.batch.token, shape=(n_batch,))
        self._pos = np.ctypeslib.as_array(self.batch.pos, shape=(n_batch,))
        self._out = np.ctypeslib.as_array(self.batch.logits, shape=(n_batch,))
        np.ctypeslib.as_array(self.batch.n_seq_id, shape=(n_batch,))[:] = 1
        self._seq_rows = [self.batch.seq_id[i] for i in range(n_batch)]
        self.vocab_size = ll.llama_vocab_n_tokens(ll.llama_model_get_vocab(self.model))
        weakref.finalize(self, _free_llama, self.model, self.ctx, self.batch)

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
        per_layer = ll.llama_model_n_head_kv(self.model) * (k_dim * _K_BYTES
                                                             + v_dim * _V_TYPES[self.v_type])
        return round(ll.llama_model_n_layer(self.model) * per_layer)

    def decode(self, tokens: Sequence[int], positions: Sequence[int], seqs: Sequence[int],
               outputs: Sequence[bool]) -> int:
        """One ``llama_decode``; returns its status (0 ok, 1 no KV slot)."""
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
        if not ll.llama_memory_seq_rm(self.mem, seq, p0, p1):
            raise RuntimeError(f"llama.cpp refused to remove positions [{p0}, {p1}) of seq {seq}")

    def seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        ll.llama_memory_seq_cp(self.mem, src, dst, p0, p1)

    def seq_pos_min(self, seq: int) -> int:
        return ll.llama_memory_seq_pos_min(self.mem, seq)

    def seq_pos_max(self, seq: int) -> int:
        return ll.llama_memory_seq_pos_max(self.mem, seq)


def usable_cores() -> int:
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1
