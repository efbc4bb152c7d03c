"""The llama.cpp engine: KV lives in llama.cpp, shared token by token through its sequences.

`LlamaCppBackend`, a `seqstate.backends.base.StepBackend`, runs llama-cpp-python's low-level
API: stored paths live in `SeqStore`, working rows are `LlamaCppBatch` slots, and every fed
row of a step runs in one ``llama_decode``.  How cells are shared, why a row's logits equal
a fresh evaluation and what was measured: docs/engines.md, "How KV is shared inside
llama.cpp" and "Exactness on llama.cpp".
"""


from __future__ import annotations

import contextlib
import os
import threading
import traceback
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path

import llama_cpp as ll
import torch

from seqstate.backends.base import (CacheFullError, Capabilities, Scored, StepBackend,
                                    WorkCounters, single_threaded_torch)
from seqstate.backends.llamacpp.store import SeqHandle, SeqStore
from seqstate.backends.prefixes import ensure_stored, trie_size
from seqstate.backends.teacher_forcing import score_pairs
from seqstate.errors import ContextOverflowError, EngineError
from seqstate.backends.llamacpp.batch import LlamaCppBatch
from seqstate.backends.llamacpp.native import (GARBAGE_SEQ, SCRATCH_SEQ, Llama, check_gguf,
                                               usable_cores)
from seqstate.backends.llamacpp.options import MAX_SEQS, RESERVED_SEQS, LlamaCppOptions

__all__ = ["LlamaCppBackend", "NOISE_FLOOR"]

# Max abs logit difference against a fresh evaluation that tests allow: every path measured
# 0.0 (docs/engines.md); positive so that comparisons can be strict.
NOISE_FLOOR = 1e-4


def _tails(rows: Sequence[Sequence[int]], starts: Sequence[int], seqs: Sequence[int]
           ) -> tuple[list[int], list[int], list[int]]:
    """Tokens, positions and sequences of every ``row[start:]``, rows one after another."""
    tokens: list[int] = []
    positions: list[int] = []
    owners: list[int] = []
    for row, start, seq in zip(rows, starts, seqs):
        tokens.extend(row[start:])
        positions.extend(range(start, len(row)))
        owners.extend([seq] * (len(row) - start))
    return tokens, positions, owners


class LlamaCppBackend(StepBackend):
    """The llama.cpp engine behind the generators (see ``seqstate.backends.base.StepBackend``).

    Its batches (`LlamaCppBatch`) work through `ensure_kv`, `fork`, `evaluate` and ``llama``
    (the native context: `seqstate.backends.llamacpp.native.Llama`, for its sequence
    operations ``seq_cp``, ``seq_rm``, ``seq_pos_min``, ``seq_pos_max``).

    Parameters
    ----------
    path : str or os.PathLike
        A GGUF model file.
    options : LlamaCppOptions, optional
        KV cells, threads, sequences, decode size, logs (`LlamaCppOptions`, which checks
        them); ``keywords`` set single fields over it.

    Examples
    --------
    >>> import seqstate as ss
    >>> backend = LlamaCppBackend(ss.models.default_gguf(), n_ctx=2048, n_threads=1)
    >>> prompt_ids = ss.models.loading.default_tokenizer().encode("Hello there")
    >>> batch = backend.batch()
    >>> [slot] = batch.add([prompt_ids], grow_by=8)             # prefills prompt_ids[:-1]
    >>> batch.forward([slot], [prompt_ids[-1]]).shape           # next-token logits
    torch.Size([1, 49152])
    >>> handle = batch.commit(slot, prompt_ids, len(prompt_ids))
    >>> batch.close()
    >>> handle.length == len(prompt_ids)
    True
    """

    def __init__(self, path: str | os.PathLike, options: LlamaCppOptions | None = None,
                 **keywords: object) -> None:
        self.options = LlamaCppOptions.of(keywords, options)
        n_ctx, n_seq_max = self.options.n_ctx, self.options.n_seq_max
        check_gguf(path)
        threads = self.options.n_threads or usable_cores()
        self.n_threads = threads
        self.llama = Llama(str(Path(path)), n_ctx, threads, n_seq_max, self.options.n_batch,
                           self.options.quiet_logs)
        self.n_ctx = ll.llama_n_ctx(self.llama.ctx)
        self.n_seq_max = n_seq_max
        self.vocab_size = self.llama.vocab_size
        self.context_length = ll.llama_model_n_ctx_train(self.llama.model)
        self.bytes_per_cell = self.llama.bytes_per_cell()
        hint = (f"create the backend with a larger n_ctx (now {self.n_ctx}) or n_seq_max "
                f"(now {n_seq_max}, at most {MAX_SEQS})")
        self.store = SeqStore(self.llama, range(RESERVED_SEQS, n_seq_max), hint)
        self.capabilities = Capabilities(name="llama.cpp", full_logits=True, prefix_sharing=True,
                                         batching=True, exact=False,
                                         max_rows=self.options.max_rows,
                                         own_threads=True)
        self.counters = WorkCounters.zeros()
        self.lock = threading.RLock()
        self._batches: weakref.WeakSet[LlamaCppBatch] = weakref.WeakSet()

    @contextlib.contextmanager
    def guarded(self) -> Iterator[None]:
        """The engine's lock, held for one operation; on an error, the finished frames under
        it are cleared before the error leaves the engine.  Those frames hold handles (a
        prefix prefilled for rows whose tails then did not fit), and an error keeps its
        frames alive for as long as anyone keeps the error, which the scheduler and a
        caller's traceback do: a failed call must not keep KV pinned, or the next call that
        fits fails too."""
        with self.lock:
            try:
                yield
            except BaseException as exc:
                traceback.clear_frames(exc.__traceback__)      # executing frames are skipped
                raise

    def on_worker_start(self) -> None:
        """llama.cpp computes on threads of its own: the sampling step on the scheduler's
        worker (torch ops over a few rows of logits) runs single-threaded, so torch's thread
        team does not compete with llama.cpp's (see ``Capabilities.own_threads``)."""
        single_threaded_torch()

    # -- decoding -----------------------------------------------------------------------------
    def evaluate(self, tokens: list[int], positions: list[int], seqs: list[int],
                 outputs: list[bool]) -> torch.Tensor | None:
        """``llama_decode`` in chunks of ``n_batch``, evicting stored paths when the
        cache has no free cells; logits (outputs, V) of the tokens flagged in ``outputs``."""
        step = self.llama.n_batch
        parts = []
        for lo in range(0, len(tokens), step):
            hi = lo + step
            self._decode(tokens[lo:hi], positions[lo:hi], seqs[lo:hi], outputs[lo:hi])
            n_out = sum(outputs[lo:hi])
            if n_out:
                parts.append(self.llama.logits(n_out))
        if not parts:
            return None
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def _decode(self, tokens: list[int], positions: list[int], seqs: list[int],
                outputs: list[bool]) -> None:
        while True:
            status = self.llama.decode(tokens, positions, seqs, outputs)
            if status == 0:
                self.count(forward_calls=1)
                return
            if status != 1:
                meaning = self.llama.DECODE_STATUS.get(status, "not documented by llama.cpp")
                raise EngineError(f"llama_decode failed with status {status}: {meaning}; "
                                  f"existing states are unchanged")
            # no free cells (llama.cpp left the cache as it was): free the garbage first, then
            # evict the least recently used stored paths, live states' too (their cells become
            # garbage), and try again
            if self.llama.compact():
                continue
            if not self._evict(len(tokens)):
                raise CacheFullError(
                    f"the llama.cpp KV cache (n_ctx={self.n_ctx} cells) is full of working rows' "
                    f"KV and the stored paths they borrow, so {len(tokens)} more tokens do not "
                    f"fit; run fewer rows at once, or create the backend with a larger n_ctx")

    def _evict(self, cells: int) -> bool:
        """Evict least recently used stored paths until about ``cells`` stored cells are gone
        (one compaction then frees them all); False when nothing could be evicted."""
        target = self.store.cells - cells
        evicted = False
        while self.store.cells > target and self.store.evict_one():
            evicted = True
        return evicted

    # -- prefill ------------------------------------------------------------------------------
    def _run_tails(self, todo: list[tuple[tuple[int, ...], SeqHandle]]) -> list[SeqHandle]:
        """Compute every row's uncached tail (rows packed into shared decodes, a sequence per
        row sharing its stored cells); store them.  On failure the sequences go back."""
        targets, handles = [t for t, _ in todo], [h for _, h in todo]
        scratch = self.store.frozen           # read before the decode: what it computes is scratch
        seqs = self.fork(handles)
        try:
            tokens, positions, owners = _tails(targets, [h.length for h in handles], seqs)
            self.evaluate(tokens, positions, owners, [False] * len(tokens))
        except BaseException:
            self._release(seqs)
            raise
        self.count(prefill_tokens=len(tokens))
        return [self.store.insert(t, len(t), seq, scratch=scratch or h.node.scratch)
                for t, h, seq in zip(targets, handles, seqs)]

    def fork(self, handles: Sequence[SeqHandle]) -> list[int]:
        """A new sequence per handle, holding its KV (shared cells, not copies); the caller
        owns them and gives each back to the store (``store.release``)."""
        seqs: list[int] = []
        try:
            for h in handles:
                seqs.append(self.store.acquire())
                self.store.load(h, seqs[-1])
        except BaseException:
            self._release(seqs)
            raise
        return seqs

    def _release(self, seqs: Sequence[int]) -> None:
        for seq in seqs:
            self.store.release(seq)

    def ensure_kv(self, rows: Sequence[Sequence[int]], grow_by: int) -> list[SeqHandle]:
        """Store every ``row[:-1]``, computing only uncached tails; hard-pinned handles on
        them (see ``base.Batch.add``).  Refused before any compute where the rows, each
        growing by ``grow_by``, cannot fit even an empty cache."""
        if not rows:
            return []
        if any(len(r) == 0 for r in rows):
            raise ValueError("every row needs at least one token")
        self._check_fits([tuple(r[:-1]) for r in rows], grow_by)
        return ensure_stored(self.store, rows, self._run_tails, self.count)

    def _check_fits(self, targets: list[tuple[int, ...]], grow_by: int) -> None:
        """Refuse, before any compute, a call that cannot fit even in an empty cache."""
        longest = max(len(t) for t in targets) + grow_by
        cells, carriers = trie_size(targets)
        cells += len(targets) * grow_by
        seqs = len(targets) + carriers
        usable = self.store.capacity
        if longest > self.n_ctx or cells > self.n_ctx:
            raise ContextOverflowError(
                f"this call needs up to {max(longest, cells)} KV cells (rows of up to {longest} "
                f"tokens, {len(targets)} rows growing by {grow_by}) but the llama.cpp context has "
                f"n_ctx={self.n_ctx}; load the model with a larger n_ctx or run fewer rows")
        if seqs > usable:
            need = seqs + RESERVED_SEQS
            bigger = (f"load the model with n_seq_max={need} or more" if need <= MAX_SEQS
                      else f"n_seq_max is at most {MAX_SEQS}")
            raise ContextOverflowError(
                f"this call needs {seqs} llama.cpp sequences ({len(targets)} rows, each its "
                f"own, + {carriers} for the distinct prompts they continue) but "
                f"n_seq_max={self.n_seq_max} leaves {usable} ({RESERVED_SEQS} are kept by "
                f"seqstate); run at most {self.capabilities.max_rows} rows of one prompt "
                f"(samples, batch items) or fewer distinct prompts per call, or {bigger}")

    # -- the Backend protocol -----------------------------------------------------------------
    def batch(self) -> LlamaCppBatch:
        """A new, empty batch."""
        batch = LlamaCppBatch(self)
        self._batches.add(batch)
        return batch

    def score(self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]], *,
              store: bool = False) -> list[Scored]:
        """See ``Backend.score``: `seqstate.backends.teacher_forcing` over this engine's batches
        (continuations on sequences sharing their prefix's cells, freed unless stored)."""
        with self.guarded():
            return score_pairs(self, pairs, store=store)

    def fresh_logits(self, tokens: Sequence[int]) -> torch.Tensor:
        """Logits ``(T, V)`` of ``tokens`` evaluated from scratch on a private sequence."""
        if not 0 < len(tokens) <= self.n_ctx:
            raise ContextOverflowError(f"fresh_logits takes 1..n_ctx={self.n_ctx} tokens, got "
                                       f"{len(tokens)}")
        with self.guarded():
            try:
                return self.evaluate(list(tokens), list(range(len(tokens))),
                                 [SCRATCH_SEQ] * len(tokens), [True] * len(tokens))
            finally:
                # its cells are the topmost ones (nothing ran after it): freeing them leaves
                # no free cell below a live one
                self.llama.free_top(SCRATCH_SEQ)

    # -- stats and checks ---------------------------------------------------------------------
    @property
    def reference_options(self) -> dict[str, object]:
        """Keywords of ``llama_cpp.Llama`` that give llama-cpp-python's own evaluation this
        engine's attention and KV types (so their results can be compared token for token)."""
        return {"flash_attn": True, "type_k": self.llama.k_type, "type_v": self.llama.v_type}

    def kv_stats(self) -> dict[str, int]:
        """The store's counters (`seqstate.radix.RadixStore.kv_stats`): cells x bytes per
        cell."""
        return self.store.kv_stats()

    def verify(self) -> None:
        """Check the store and every open batch against llama.cpp's own sequence positions."""
        with self.lock:
            self.store.verify()
            owned: set[int] = set()
            for batch in list(self._batches):
                batch.verify()
                owned |= batch.owned()
            if owned != set(self.store.lent()):
                raise RuntimeError(f"sequences lent out {sorted(self.store.lent())} differ from "
                                   f"those open batches own {sorted(owned)}")
            if self.llama.seq_pos_max(SCRATCH_SEQ) != -1:
                raise RuntimeError("the fresh_logits sequence still holds cells")
            for seq, positions in self.llama.cell_positions().items():
                if seq != GARBAGE_SEQ and positions != sorted(set(positions)):
                    raise RuntimeError(f"the cells of sequence {seq} are out of position order "
                                       f"{positions}: its logits would differ from a fresh "
                                       f"evaluation")

    def __repr__(self) -> str:
        return (f"LlamaCppBackend(n_ctx={self.n_ctx}, n_seq_max={self.n_seq_max}, "
                f"stored_cells={self.store.cells})")
