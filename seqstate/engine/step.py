"""One decoding step after the forward: constrain -> sample -> hooks -> accept.

`Stepper` is the engine's own step, usable on its own: feed it logits you computed
(``stepper.step(logits)``) and reuse sampling, constraints, hooks, stop strings and
detokenization.  It knows nothing about KV.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np
import torch

from seqstate.engine.buffers import OVERLAP_ELEMENTS, Computed, StepBuffers, TwoEnded, shared
from seqstate.engine.rows import LiveRow, RowRequest, RowResult
from seqstate.errors import LogitsError
from seqstate.finish import FinishReason
from seqstate.hooks import Replace, Rollback, SampleEvent, checked
from seqstate.sampling.functions import greedy_list, greedy_tokens, host_values, picked_values
from seqstate.sampling.params import Greedy, Sampler

__all__ = ["Stepper", "StepEvent", "allowed_mask", "allowed_masks", "constrained",
           "DEFAULT_MAX_BACKTRACKS"]

DEFAULT_MAX_BACKTRACKS = 32
# a greedy row whose best token is refused tries this many next best ones before a mask:
# each costs an argmax of the row (~5-15 us after a forward) and a cursor check (~1-3 us),
# a mask ~50-200 us (a grammar's, filled, unpacked and applied)
RUNNERS_UP = 4
# a log-prob written once the step's log-softmax is done (`Stepper._accept_before_logprobs`)
_PENDING = object()


@dataclasses.dataclass(frozen=True, slots=True)
class StepEvent:
    """What one step did to one row."""

    row: int
    token: int | None          # the accepted token (None after a rollback or when finishing)
    text: str                  # text this step added (UTF-8 safe)
    rolled_back: int = 0       # generated tokens removed by a hook
    finish_reason: FinishReason | None = None


def allowed_mask(row: LiveRow, vocab_size: int,
                 device: torch.device | str = "cpu") -> torch.Tensor | None:
    """Bool mask (V,) of the row's allowed tokens (constraint and bans), or None when anything goes."""
    banned = row.bans.get(len(row.tokens))
    if row.cursor is None and not banned:
        return None
    mask = torch.ones(vocab_size, dtype=torch.bool, device=device)        # (V,)
    if row.cursor is not None:
        allowed = row.cursor.allowed()                                      # (V_tok,)
        mask[: allowed.shape[0]] = allowed
        mask[allowed.shape[0]:] = False
    if banned:
        mask[list(banned)] = False
    return mask


def allowed_masks(rows: Sequence[LiveRow], vocab_size: int,
                  device: torch.device) -> torch.Tensor | None:
    """Bool masks (B, V) on ``device``: every row's `allowed_mask` at once, or None when no row
    is constrained or banned.

    Cursors of one kind compute their masks together (`Cursor.prepare`: llguidance fills
    a batch's bitmasks in parallel); the masks, cached on the CPU by their constraints, are
    stacked and moved to ``device`` in one copy.
    """
    cursors = [r.cursor for r in rows]
    bans = [r.bans.get(len(r.tokens)) for r in rows]
    constrained = [j for j, c in enumerate(cursors) if c is not None]
    if not constrained and not any(bans):
        return None
    for kind, group in _kinds(cursors).items():
        kind.prepare(group)
    parts = [cursors[j].allowed() for j in constrained]                        # (V_tok,) each
    if len(constrained) == len(rows) and all(p.shape[0] == vocab_size for p in parts):
        mask = torch.stack(parts).to(device, non_blocking=True)                    # (B, V)
    else:
        mask = torch.ones(len(rows), vocab_size, dtype=torch.bool, device=device)  # (B, V)
        for j, part in zip(constrained, parts):
            mask[j, : part.shape[0]] = part.to(device, non_blocking=True)
            mask[j, part.shape[0]:] = False
    for j, banned in enumerate(bans):
        if banned:
            mask[j, torch.tensor(sorted(banned), dtype=torch.long, device=device)] = False
    return mask


def _best_allowed(row: LiveRow, values: np.ndarray, best: int) -> int | None:
    """The row's masked argmax read on the host without its mask, where that is cheap, else
    None (its mask decides, dead ends too).  ``values`` are its logits (read only), ``best``
    their argmax, which the row refuses.  A cursor whose mask is known (a grammar forcing
    text: a few tokens allowed) gives its `allowed_ids`: the best of those not banned, the
    first id on ties.  Otherwise its next best tokens are tried, up to `RUNNERS_UP`, each
    NumPy's argmax over a copy of ``values`` with the refused ones set to -inf (the first id
    on ties): the first the row allows is its masked argmax."""
    cursor = row.cursor
    if cursor is not None and cursor.mask_known:
        ids = cursor.allowed_ids()                                                  # (K,)
        banned = row.bans.get(len(row.tokens))
        if banned:
            ids = ids[~np.isin(ids, list(banned))]
        return int(ids[values[ids].argmax()]) if len(ids) else None
    values = values.copy()                                                          # (V,)
    token = best
    for _ in range(RUNNERS_UP):
        values[token] = float("-inf")
        token = int(values.argmax())
        if values[token] == float("-inf"):
            return None
        if row.allows(token):
            return token
    return None


def _kinds(cursors: Sequence) -> dict[type, list]:
    """``cursors`` (None for an unconstrained row) grouped by their class."""
    kinds: dict[type, list] = {}
    for c in cursors:
        if c is not None:
            kinds.setdefault(type(c), []).append(c)
    return kinds


def constrained(logits: torch.Tensor, allowed: torch.Tensor, finite: bool = False,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """``logits`` where ``allowed`` (bool, same shape), -inf elsewhere, written to ``out`` (a
    tensor like ``logits``; a new one when None).

    With ``finite`` logits (no NaN or inf anywhere) this is the minimum of the logits and a
    +inf/-inf bias made from the mask: arithmetic the CPU vectorizes, several times faster
    than ``torch.where`` on a bool mask (a (64, 49152) batch: ~2 ms against ~12 ms, one
    thread).  Otherwise it is ``torch.where``, which keeps a NaN from leaking out of a
    disallowed token.
    """
    if out is None:
        out = torch.empty_like(logits)
    if not finite:
        return out.copy_(torch.where(allowed, logits, float("-inf")))
    bias = out.copy_(allowed.view(torch.uint8)).sub_(0.5).mul_(float("inf"))     # +-inf
    return torch.minimum(logits, bias, out=out)


class Stepper:
    """Sampling, constraints, hooks and stop handling over logits computed by the caller.

    Parameters
    ----------
    model : Model
        Supplies the vocabulary and EOS ids.
    requests : list of RowRequest or of token lists
        One `RowRequest` per row (or plain token lists, unconstrained,
        with ``max_new`` 64).

    Examples
    --------
    >>> import seqstate as ss
    >>> model = ss.models.testing.tiny()
    >>> stepper = ss.engine.Stepper(model, [model.encode("Hi")])
    >>> while not stepper.done:
    ...     rows = [model.full_logits(stepper.tokens(i))[-1] for i in stepper.live]
    ...     events = stepper.step(torch.stack(rows))
    >>> len(stepper.results()[0].tokens) > 1
    True
    """

    def __init__(self, model, requests: Sequence[RowRequest | Sequence[int]], sampler: Sampler = Greedy(),
                 rng: torch.Generator | None = None, hooks: Sequence = (),
                 max_backtracks: int = DEFAULT_MAX_BACKTRACKS, rows: Sequence[LiveRow] | None = None) -> None:
        reqs = [r if isinstance(r, RowRequest) else RowRequest(tuple(r), 64) for r in requests]
        self.rows = list(rows) if rows is not None else [LiveRow(r, model.vocab, model.eos_token_ids)
                                                         for r in reqs]
        self.vocab = model.vocab
        self.sampler, self.rng = sampler, rng
        self.hooks = tuple(hooks)
        self.max_backtracks = max_backtracks
        self._own = StepBuffers()

    @property
    def live(self) -> list[int]:
        """Rows that need logits this step, in the order ``step`` expects them."""
        return [i for i, r in enumerate(self.rows) if not r.done]

    @property
    def done(self) -> bool:
        return all(r.done for r in self.rows)

    def tokens(self, i: int) -> list[int]:
        """Row ``i``'s tokens so far (the logits to feed are the next token's after these)."""
        return list(self.rows[i].tokens)

    @property
    def buffers(self) -> StepBuffers:
        """The buffers this step writes into: the thread's `shared_buffers`, else its own."""
        return shared.buffers or self._own

    def close(self) -> None:
        """Drop its own buffers and end its helper thread, if one was started (a
        garbage-collected stepper ends it too)."""
        self._own.close()

    def _log_softmax(self, logits: torch.Tensor) -> tuple[Computed | TwoEnded, bool]:
        """``(pending, beside)``: ``pending.get()`` is ``logits.log_softmax(-1)``, computed
        now, or on a large CPU batch (``beside`` True) begun on the helper thread, beside the
        rest of the step (greedy's reductions, the masks, the sampler), into a kept tensor,
        and finished with this thread's help when asked."""
        if not logits.is_cpu or logits.numel() < OVERLAP_ELEMENTS:
            return Computed(logits.log_softmax(dim=-1)), False
        buffers = self.buffers
        out = buffers.tensor("logprobs", logits)
        return TwoEnded(logits, out, buffers.lead).start(buffers.helper()), True

    def results(self, handles: Sequence | None = None) -> list[RowResult]:
        return [r.result(handles[i] if handles else None) for i, r in enumerate(self.rows)]

    # -- the step -----------------------------------------------------------------------------
    def step(self, logits: torch.Tensor, rows: Sequence[int] | None = None) -> list[StepEvent]:
        """Advance every live row by one token given its logits (B_live, V), in ``live`` order
        (or only ``rows``, live rows given in that order)."""
        live = self.live if rows is None else list(rows)
        if not (isinstance(logits, torch.Tensor) and logits.dim() == 2
                and logits.shape[0] == len(live)):
            got = (f"shape {tuple(logits.shape)}" if isinstance(logits, torch.Tensor)
                   else type(logits).__name__)
            raise LogitsError(f"expected logits for {len(live)} live rows, a tensor of shape "
                              f"({len(live)}, vocab) in `live` order, got {got}; feed one row of "
                              f"logits per row of stepper.live (or of `rows`)")
        greedy = not self.hooks and isinstance(self.sampler, Greedy)
        if logits.dtype != torch.float32:
            logits = logits.float()
        pending, beside = self._log_softmax(logits)  # beside the rest of the step (B, V)
        try:
            return self._choose_and_accept(live, logits, greedy, pending, beside)
        except BaseException:
            pending.cancel()                        # nothing left writing into kept tensors
            raise

    def _choose_and_accept(self, live: Sequence[int], logits: torch.Tensor, greedy: bool,
                           pending: Computed | TwoEnded, beside: bool) -> list[StepEvent]:
        if greedy:
            # each row's best token, and the value there of its log-probs (the log-softmax
            # done) or of its logits (still running beside, waited for after the masks): a
            # finite value means a finite row (a NaN or +inf anywhere makes the log-prob NaN
            # and the peak NaN or inf; all -inf too), so the whole check runs only where one
            # is not.  After a forward every operation costs several times what it does in a
            # loop (~5 us): few of them, on the host in lists
            best = greedy_list(logits)                                                  # (B,)
            logprobs = None if beside else pending.get()                                # (B, V)
            picked = picked_values(logits if beside else logprobs, best)                # (B,)
            finite = all(map(math.isfinite, picked))
        else:
            finite = all(map(math.isfinite, logits.amax(dim=-1).tolist()))
        if not finite and not torch.isfinite(logits).any(dim=-1).all():
            raise LogitsError(f"a row's logits are all NaN/inf (dtype {logits.dtype}): most likely "
                              "the model's forward overflowed in float16/bfloat16; load it with "
                              "dtype=torch.float32 (or bfloat16 rather than float16), else check "
                              "its weights or the custom step that made these logits")
        if finite and greedy:
            chosen, events = self._greedy(live, logits, best)
            if beside:                              # the log-softmax still runs beside
                return events + self._accept_before_logprobs(live, chosen, pending)
            if chosen is not best:                  # masked rows took other tokens
                picked = picked_values(logprobs, chosen)
        else:
            # 1. constrain: disallowed tokens get -inf; a row with nothing allowed is a dead end
            allowed = allowed_masks([self.rows[i] for i in live], logits.shape[-1],
                                    logits.device)
            if allowed is None:
                # hooks' resampling bans write into `masked`; with neither it is `logits`
                masked = logits.clone() if self.hooks else logits
            else:
                masked = constrained(logits, allowed, finite,
                                     self.buffers.tensor("masked", logits))            # (B, V)
            events = self._dead_ends(live, allowed, logits, masked)
            # 2. sample every row at once, 3. and the model's own log-prob of each token
            chosen = self._choose(masked, live).tolist()                               # (B,)
            logprobs = pending.get()                                                    # (B, V)
            picked = picked_values(logprobs, chosen)                                    # (B,)
        # 4. hooks may replace, resample or roll back; 5. accept
        for j, i in enumerate(live):
            row = self.rows[i]
            if row.done:
                continue
            token, rolled = (self._run_hooks(row, i, chosen[j], logits[j], logprobs[j], masked[j])
                             if self.hooks else (chosen[j], 0))
            if row.done or rolled:
                events.append(StepEvent(i, None, "", rolled, row.finish_reason))
                continue
            logprob = picked[j] if token == chosen[j] else logprobs[j, token].item()
            events.append(self._accept(row, i, token, logprob))
        return events

    @staticmethod
    def _accept(row: LiveRow, i: int, token: int, logprob: float) -> StepEvent:
        """Row ``i`` accepts ``token``; the step's event for it."""
        before = len(row.tokens)
        chunk = row.accept(token, logprob)
        accepted = token if len(row.tokens) > before else None       # EOS is not appended
        return StepEvent(i, accepted, chunk, 0, row.finish_reason)

    def _accept_before_logprobs(self, live: Sequence[int], chosen: list[int],
                                pending: TwoEnded) -> list[StepEvent]:
        """Accept greedy's ``chosen`` tokens (no hooks: each is final) while the helper
        thread is still computing the log-softmax, then write each accepted token's log-prob
        where it was left pending: the rows' cursors, detokenization and stop strings take
        the step's own thread while it would otherwise wait, and it joins the log-softmax
        with less of it left."""
        events, later = [], []
        try:
            for j, i in enumerate(live):
                row = self.rows[i]
                if row.done:                        # a dead end, finished by `_greedy`
                    continue
                later.append((row, len(row.logprobs), j))
                events.append(self._accept(row, i, chosen[j], _PENDING))
        finally:                                    # a cursor that failed leaves none pending
            picked = picked_values(pending.get(), chosen)                               # (B,)
            for row, k, j in later:
                # a stop string that cut the row's text re-encodes its tail: no log-prob there
                if k < len(row.logprobs) and row.logprobs[k] is _PENDING:
                    row.logprobs[k] = picked[j]
        return events

    def _greedy(self, live: Sequence[int], logits: torch.Tensor, best: list[int]
                ) -> tuple[list[int], list[StepEvent]]:
        """Greedy's tokens from each row's best token ``best``, masking only the rows that
        need it: a row whose best token its cursor and bans allow takes it (the masked argmax
        is the same token, ties too: no allowed token before it holds the same value).  On
        the CPU a row that refuses it finds its masked argmax on the host where that is cheap
        (`_best_allowed`: the best of a known mask's few ids, or the first allowed of its next
        best tokens).  The rest are masked and take their best allowed token.  With a trained
        model most rows' best token is allowed, so most steps build no mask at all (a JSON
        cursor checks one token, not the vocabulary).  ``best`` itself where every row takes
        its best token, else a new list."""
        for kind, group in _kinds([self.rows[i].cursor for i in live]).items():
            kind.prepare_allows(group)
        refused = [j for j, i in enumerate(live) if not self.rows[i].allows(best[j])]
        if not refused:
            return best, []
        chosen = list(best)
        host = host_values(logits)                                                     # (B, V)
        if host is not None:
            found = [_best_allowed(self.rows[live[j]], host[j], best[j]) for j in refused]
            for j, token in zip(refused, found):
                if token is not None:
                    chosen[j] = token
            refused = [j for j, token in zip(refused, found) if token is None]
            if not refused:
                return chosen, []
        where = torch.tensor(refused, device=logits.device)                            # (R,)
        out = self.buffers.tensor("gathered", logits, len(refused))
        some = torch.index_select(logits, 0, where, out=out)                           # (R, V)
        rows = [live[j] for j in refused]
        allowed = allowed_masks([self.rows[i] for i in rows], logits.shape[-1], logits.device)
        masked = constrained(some, allowed, True, self.buffers.tensor("masked", some))  # (R, V)
        events = self._dead_ends(rows, allowed, some, masked)
        for j, token in zip(refused, greedy_tokens(masked).tolist()):
            chosen[j] = token
        return chosen, events

    def _dead_ends(self, live: Sequence[int], allowed: torch.Tensor | None,
                   logits: torch.Tensor, masked: torch.Tensor) -> list[StepEvent]:
        """Finish the rows whose masks allow nothing; they sample from their unmasked logits
        (the token is dropped).  Only a row whose masked peak is -inf can be one: one
        reduction over (B, V), then a look at those rows alone."""
        if allowed is None:
            return []
        events = []
        peaks = masked.amax(dim=-1)                                                     # (B,)
        for j in (peaks == float("-inf")).nonzero().flatten().tolist():
            if not allowed[j].any():
                self.rows[live[j]].finish(FinishReason.DEAD_END)
                events.append(StepEvent(live[j], None, "", finish_reason=FinishReason.DEAD_END))
                masked[j] = logits[j]
        return events

    def _choose(self, masked: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
        """The sampler's tokens for ``rows``' masked logits; penalties see the rows' tokens."""
        if self.sampler.needs_history:
            history = [(self.rows[i].tokens, self.rows[i].start) for i in rows]
            return self.sampler.choose(masked, self.rng, history)
        return self.sampler.choose(masked, self.rng)

    def _run_hooks(self, row: LiveRow, i: int, token: int, logits: torch.Tensor,
                   logprobs: torch.Tensor, masked: torch.Tensor) -> tuple[int, int]:
        """Run the hooks in order; returns (token, tokens rolled back).

        A Replace hands its token on to the later hooks; a Resample restarts the chain on the
        newly sampled token; a Rollback ends the step for this row.
        """
        k = 0
        while k < len(self.hooks):
            hook = self.hooks[k]
            event = SampleEvent(i, len(row.tokens), token, logprobs[token].item(), logits,
                                row.text, self.vocab.decode([token]), row.generated, row.offsets,
                                lambda: row.prompt_text)
            action = checked(hook, hook(event), row, token,
                             lambda t: bool(torch.isfinite(masked[t])), self.max_backtracks)
            if row.done:
                return token, 0
            if action is None or isinstance(action, Replace):
                token = token if action is None else action.token
                k += 1
                continue
            if isinstance(action, Rollback):
                row.rollback(action.n)
                return token, action.n
            banned = list(action.ban)
            masked[banned] = float("-inf")
            if not torch.isfinite(masked).any():
                row.finish(FinishReason.DEAD_END)
                return token, 0
            row.bans.setdefault(len(row.tokens), set()).update(banned)
            token = int(self._choose(masked[None], [i])[0])
            k = 0
        return token, 0
