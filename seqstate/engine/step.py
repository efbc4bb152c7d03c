"""One decoding step: forward -> constrain -> sample -> hooks -> accept.

The forward is the caller's (`seqstate.engine.decode.DecodeJob` runs the batch's; anyone may
compute logits their own way): `Stepper.step` takes its logits and does the rest, with the
call's `Decoding` (sampler, RNG, hooks).  It knows nothing about KV.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np
import torch

from seqstate.constraints import bitmask
from seqstate.engine.buffers import StepBuffers
from seqstate.engine.logits import check_rows, finite_rows, greedy_list, picked_values
from seqstate.engine.masks import constrained, packed_masks
from seqstate.engine.rows import Decoding, LiveRow, RowRequest, RowResult
from seqstate.errors import ArgumentError
from seqstate.finish import FinishReason
from seqstate.hooks import Hooked, run_hooks
from seqstate.sampling.params import Greedy

__all__ = ["Stepper", "StepEvent"]


@dataclasses.dataclass(frozen=True, slots=True)
class StepEvent:
    """What one step did to one row."""

    row: int
    token: int | None          # the accepted token (None after a rollback or when finishing)
    text: str                  # text this step added (UTF-8 safe)
    rolled_back: int = 0       # generated tokens removed by a hook
    finish_reason: FinishReason | None = None


class Stepper:
    """Sampling, constraints, hooks and stop handling over logits computed by the caller.

    Parameters
    ----------
    model : Model
        Supplies the vocabulary and EOS ids.
    requests : list of RowRequest or of token lists
        One `RowRequest` per row (or plain token lists, unconstrained, with ``max_new`` 64).
    decoding : Decoding
        The call's sampler, RNG, hooks and backtrack limit (greedy, no hooks by default).
    rows : list of LiveRow, keyword-only
        The rows themselves, instead of ``requests`` (a scheduler's job keeps them): give
        one of the two (`ArgumentError` otherwise).

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

    def __init__(self, model, requests: Sequence[RowRequest | Sequence[int]] | None = None,
                 decoding: Decoding = Decoding(), *,
                 rows: Sequence[LiveRow] | None = None) -> None:
        if (requests is None) == (rows is None):
            raise ArgumentError("Stepper takes its rows as requests (RowRequests or token "
                                "lists) or as live rows (rows=), one of them; it was given "
                                + ("neither" if rows is None else "both"))
        if rows is None:
            rows = [LiveRow(r if isinstance(r, RowRequest) else RowRequest(tuple(r), 64),
                            model.vocab, model.eos_token_ids) for r in requests]
        self.rows = list(rows)
        self.decoding = decoding
        self.hooks = decoding.hooks
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

    def close(self) -> None:
        """Drop its own buffers (those it steps with when it is handed none)."""
        self._own.close()

    def results(self, handles: Sequence | None = None) -> list[RowResult]:
        return [r.result(handles[i] if handles else None) for i, r in enumerate(self.rows)]

    def step(self, logits: torch.Tensor, rows: Sequence[int] | None = None,
             buffers: StepBuffers | None = None) -> list[StepEvent]:
        """Advance every live row by one token given its logits (B_live, V), in ``live`` order
        (or only ``rows``, live rows given in that order).  ``buffers``: where the step
        writes its large tensors, kept from step to step by whoever runs it (a scheduler's
        run); None: the stepper's own."""
        live = self.live if rows is None else list(rows)
        buffers = self._own if buffers is None else buffers
        check_rows(logits, len(live))
        logits = logits.float()                                                         # (B, V)
        best = greedy_list(logits)                                                      # (B,)
        finite = finite_rows(logits, best)
        # 1. constrain and 2. sample; rows whose mask allows nothing are dead ends
        if isinstance(self.decoding.sampler, Greedy) and not self.hooks:
            chosen, events = self._greedy(live, logits, best, finite, buffers)
            masked = logits
        else:
            masked, events = self._masked(live, logits, finite, buffers)
            chosen = self._choose(masked, live).tolist()                               # (B,)
        # the model's log-prob of a token: its logit less its row's logsumexp
        norms = torch.logsumexp(logits, dim=-1).tolist()                                # (B,)
        picked = picked_values(logits, chosen)                                          # (B,)
        # 3. hooks may replace, resample or roll back; 4. accept
        for j, i in enumerate(live):
            row = self.rows[i]
            if row.done:
                continue
            token = chosen[j]
            if self.hooks:
                hooked = self._run_hooks(row, i, token, logits[j], norms[j], masked[j])
                if row.done or hooked.rolled_back:
                    events.append(StepEvent(i, None, "", hooked.rolled_back, row.finish_reason))
                    continue
                token = hooked.token
            logit = picked[j] if token == chosen[j] else logits[j, token].item()
            before = len(row.tokens)
            chunk = row.accept(token, logit - norms[j])
            accepted = token if len(row.tokens) > before else None       # EOS is not appended
            events.append(StepEvent(i, accepted, chunk, 0, row.finish_reason))
        return events

    def _greedy(self, live: Sequence[int], logits: torch.Tensor, best: list[int],
                finite: bool, buffers: StepBuffers) -> tuple[list[int], list[StepEvent]]:
        """Greedy's tokens: a row whose cursor and bans allow its ``best`` token takes it (the
        masked argmax is the same token, ties too: no allowed token before it holds its
        value); the other rows are masked together and take their masked argmax."""
        refused = [j for j, i in enumerate(live) if not self.rows[i].allows(best[j])]
        if not refused:
            return best, []
        some = logits
        if len(refused) < len(live):
            where = torch.tensor(refused, device=logits.device)                        # (R,)
            out = buffers.tensor("gathered", logits, len(refused))
            some = torch.index_select(logits, 0, where, out=out)                       # (R, V)
        masked, events = self._masked([live[j] for j in refused], some, finite, buffers)
        chosen = list(best)
        for j, token in zip(refused, greedy_list(masked)):
            chosen[j] = token
        return chosen, events

    def _masked(self, rows: Sequence[int], logits: torch.Tensor, finite: bool,
                buffers: StepBuffers) -> tuple[torch.Tensor, list[StepEvent]]:
        """``rows``' logits with what their cursors and bans refuse at -inf (``logits``
        itself where nothing is refused and no hook may ban), and the events of the rows left
        with nothing allowed: they finish as dead ends (their masked rows are their logits,
        for a token that is dropped)."""
        packed = packed_masks([self.rows[i] for i in rows], logits.shape[-1])         # (B, W)
        if packed is None:
            return (logits.clone() if self.hooks else logits), []
        allowed = bitmask.unpack(packed, logits.shape[-1], logits.device)               # (B, V)
        masked = constrained(logits, allowed, finite, buffers.tensor("masked", logits))
        events = []
        for j in np.flatnonzero(~packed.any(axis=1)).tolist():                        # dead ends
            self.rows[rows[j]].finish(FinishReason.DEAD_END)
            events.append(StepEvent(rows[j], None, "", finish_reason=FinishReason.DEAD_END))
            masked[j] = logits[j]
        return masked, events

    def _choose(self, masked: torch.Tensor, rows: Sequence[int]) -> torch.Tensor:
        """The sampler's tokens for ``rows``' masked logits; penalties see the rows' tokens."""
        sampler, rng = self.decoding.sampler, self.decoding.rng
        if sampler.needs_history:
            return sampler.choose(masked, rng, [(self.rows[i].tokens, self.rows[i].start)
                                                for i in rows])
        return sampler.choose(masked, rng)

    def _run_hooks(self, row: LiveRow, i: int, token: int, logits: torch.Tensor, norm: float,
                   masked: torch.Tensor) -> Hooked:
        """The hook chain (`run_hooks`) on row ``i``'s sampled ``token``: a resample bans
        tokens in its ``masked`` logits and samples again from them."""
        def sample_again(banned: list[int]) -> int | None:
            masked[banned] = float("-inf")
            if not torch.isfinite(masked).any():
                return None
            return int(self._choose(masked[None], [i])[0])

        def logprob_of(t: int) -> float:
            return logits[t].item() - norm

        return run_hooks(self.hooks, row, i, token, logprob_of(token), logprob_of=logprob_of,
                         logits=logits, allowed=lambda t: bool(torch.isfinite(masked[t])),
                         max_backtracks=self.decoding.max_backtracks, sample_again=sample_again)
