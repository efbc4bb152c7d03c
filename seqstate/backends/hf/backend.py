"""The Hugging Face engine: the reference backend, exact against a fresh fp32 forward.

`HFBackend` is a `seqstate.backends.base.StepBackend` over a transformers causal LM.  It owns
the network (its geometry and the one forward every call goes through) and the radix store of
torch KV segments (`seqstate.backends.hf.store`).  A call's rows are loaded into an in-place
decode buffer (`HFBatch`), and finished rows write their new KV back as segments.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from seqstate.backends.base import (Capabilities, Scored, StepBackend, WorkCounters, free_cpus,
                                    torch_threads)
from seqstate.backends.hf.batch import HFBatch
from seqstate.backends.hf.guard import HookGuard
from seqstate.backends.hf.hook_points import HookPoint, resolve
from seqstate.backends.hf.hooked import Hooked, run_hooked
from seqstate.backends.hf.store import DEFAULT_BUDGET_BYTES, KVStore
from seqstate.backends.hf.packed import score_packed
from seqstate.backends.teacher_forcing import score_pairs

__all__ = ["HFBackend"]


class HFBackend(StepBackend):
    """The engine behind a `seqstate.backends.hf.model.HFModel` (see
    ``seqstate.backends.base.StepBackend``).

    Parameters
    ----------
    hf_model : transformers.PreTrainedModel
        A causal LM in eval mode.
    pad_token_id : int
        The id fed at padded positions (always masked out, so any valid id is exact).
    kv_budget_bytes : int
        Byte budget of the store's cache of unreferenced segments.

    Examples
    --------
    >>> import seqstate as ss
    >>> model = ss.models.testing.tiny()
    >>> backend, ids = model.backend, model.encode("Hello there")
    >>> batch = backend.batch()
    >>> [slot] = batch.add([ids], grow_by=8)                    # prefills ids[:-1]
    >>> logits = batch.forward([slot], [ids[-1]])               # next-token logits (1, V)
    >>> bool((logits[0] - backend.fresh_logits(ids)[-1]).abs().max() < 1e-3)
    True
    >>> handle = batch.commit(slot, ids, len(ids))
    >>> batch.close()
    >>> backend.store.match(ids).length == len(ids)
    True
    """

    capabilities = Capabilities(name="hf", exact=True, activations=True)

    def __init__(self, hf_model: Any, *, pad_token_id: int,
                 kv_budget_bytes: int = DEFAULT_BUDGET_BYTES) -> None:
        self.hf_model = hf_model
        # where the model is, read off its first parameter, looked up by name each time (a
        # move may replace the parameter): cheaper than `hf_model.device`, asked every step
        first, _ = next(hf_model.named_parameters())
        owner, _, self._anchor_name = first.rpartition(".")
        self._anchor_owner = hf_model.get_submodule(owner)
        self.pad_token_id = pad_token_id
        self.store = KVStore(kv_budget_bytes)
        self.guard = HookGuard(hf_model, self.store)     # no hooked KV into the store
        self.counters = WorkCounters.zeros()
        cfg = hf_model.config.get_text_config(decoder=True)
        self.num_layers = cfg.num_hidden_layers
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.context_length = int(getattr(cfg, "max_position_embeddings", None) or 2048)
        self._decoder = hf_model.get_decoder()

    # -- the network --------------------------------------------------------------------------
    @property
    def vocab_size(self) -> int:
        """Logits per position (the LM head's rows)."""
        return int(self.hf_model.get_output_embeddings().weight.shape[0])

    @property
    def device(self) -> torch.device:
        return getattr(self._anchor_owner, self._anchor_name).device

    @property
    def dtype(self) -> torch.dtype:
        # the first parameter's, where it is a float (transformers' `dtype` walks the
        # parameters for the first float one, several times a call)
        dtype = getattr(self._anchor_owner, self._anchor_name).dtype
        return dtype if dtype.is_floating_point else self.hf_model.dtype

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                position_ids: torch.Tensor | None, cache: Any, *,
                logits: bool | torch.Tensor = True, scratch: bool = False
                ) -> torch.Tensor | None:
        """Run ``input_ids`` (B, T) over ``cache``; last-position logits (B, V) in float32 or None.

        ``attention_mask`` (B, past + T) may be None when no row is padded; a 4-D float mask
        (B, 1, T, past + T) is used as it is (`seqstate.backends.hf.packed`).
        ``position_ids`` None: every row's positions are the cache's length on (the model's
        own).  ``logits=False`` skips the LM head (prefill); a ``(B, k)`` tensor of positions
        gives those positions' (B, k, V), a ``(B, T)`` boolean tensor its True positions'
        (N, V), row by row.  Runs in inference mode (entered here where it is not already on).
        Refused (`seqstate.ActivationHookError`) on a hooked model outside ``frozen_store()``,
        unless ``scratch``: nothing this forward computes is ever stored (a hooked run,
        `seqstate.backends.hf.hooked`).
        """
        if not torch.is_inference_mode_enabled():
            with torch.inference_mode():
                return self.forward(input_ids, attention_mask, position_ids, cache,
                                    logits=logits, scratch=scratch)
        if not scratch:
            self.guard.check()
        self.counters["forward_calls"] += 1
        kwargs = dict(input_ids=input_ids, attention_mask=attention_mask,
                      position_ids=position_ids, past_key_values=cache, use_cache=True)
        if logits is False:
            self._decoder(**kwargs)                                    # prefill: skip the LM head
            return None
        if logits is True:
            return _float(self.hf_model(**kwargs, logits_to_keep=1).logits[:, -1])      # (B, V)
        return _float(self.hf_model(**kwargs, logits_to_keep=logits).logits)  # (B, k, V) | (N, V)

    def on_worker_start(self) -> None:
        """The CPU thread policy, set once per scheduler worker: its forwards run on torch's
        threads, but on no more than the CPUs no other process was running on as it started
        (`free_cpus`): a team member parked behind a busy process stalls every barrier of a
        forward.  Nothing off the CPU."""
        if self.device.type == "cpu":
            torch_threads(free_cpus())

    @torch.inference_mode()
    def fresh_logits(self, tokens: Sequence[int]) -> torch.Tensor:
        """Logits (T, V) of a fresh forward over ``tokens``, no cache: the exactness reference."""
        out = self.hf_model(input_ids=torch.tensor([list(tokens)], device=self.device),
                            use_cache=False)
        return out.logits[0].float()

    # -- activations --------------------------------------------------------------------------
    def hook_points(self, names: Sequence[str]) -> list[HookPoint]:
        """Each activation name's `HookPoint` (`seqstate.backends.hf.hook_points.resolve`);
        `seqstate.HookNameError` listing the accepted forms for one that names none."""
        return [resolve(self.hf_model, name) for name in names]

    def run_hooked(self, rows: Sequence[Sequence[int]], starts: Sequence[int],
                   reads: Sequence[int], hooks: dict[str, Sequence[Any]],
                   capture: Sequence[str]) -> Hooked:
        """A hooked forward over the rows' stored prefixes, nothing stored
        (`seqstate.backends.hf.hooked.run_hooked`)."""
        points = self.hook_points(list(dict.fromkeys([*hooks, *capture])))
        return run_hooked(self, rows, starts, reads, points, hooks, capture)

    # -- counters -----------------------------------------------------------------------------
    def kv_stats(self) -> dict[str, int]:
        """The store's counters (`seqstate.radix.RadixStore.kv_stats`)."""
        return self.store.kv_stats()

    # -- the StepBackend protocol -------------------------------------------------------------
    def batch(self) -> HFBatch:
        """A new, empty batch."""
        return HFBatch(self)

    def score(self, pairs: Sequence[tuple[Sequence[int], Sequence[int]]], *,
              store: bool = False) -> list[Scored]:
        """See ``Backend.score``: a group of contexts a forward (`seqstate.backends.hf.packed`);
        with ``store=True``, `seqstate.backends.teacher_forcing` over this engine's batches."""
        return score_pairs(self, pairs, store=True) if store else score_packed(self, pairs)


def _float(logits: torch.Tensor) -> torch.Tensor:
    """``logits`` in float32 (no operation where they are already: each costs, after a forward)."""
    return logits if logits.dtype == torch.float32 else logits.float()
