"""The logits processor for vLLM's Model Runner V2: one `Request` per request slot that carries
a seqstate spec (`seqstate_vllm.core.Constrained`, shared with the V1 processor).

vLLM 0.32 runs Model Runner V2 wherever Triton runs (every CUDA GPU), and its loader refuses
V1-interface processors; ``python -m seqstate.vllm serve`` passes this class there
(``--logits-processors seqstate_vllm:SeqStateLogitsProcessorV2``).  The interface differs
from V1's in two ways, and this module holds only those:

- a request joins by its *slot* (``add_request``), which it keeps until it ends; slots are
  recycled, so joining replaces whatever held the slot, and no call says a request left
  (a finished request's `Request` stays until its slot is reused, never read meanwhile);
- its output tokens are not handed over: they are the runner's committed tokens,
  ``all_token_ids[slot, prompt_len:total]``, read at each ``apply`` for the rows of this step
  (``ctx.idx_mapping_np``: batch position -> slot) where they have grown.  A request resumed
  after preemption joins again with its partial output among those tokens, and its `Request`
  walks them from the start.

The number of tokens a row has is the step's ``seq_lens_upper_bound_np``, exact without
speculative decoding, which the processor refuses (vLLM refuses V1 processors with it too).
"""

from __future__ import annotations

import torch

from vllm.v1.worker.gpu.sample.logits_processor import LogitsContext, LogitsProcessor

from seqstate_vllm.core import Constrained, parse
from seqstate_vllm.cursors import Request

__all__ = ["SeqStateLogitsProcessorV2"]


class SeqStateLogitsProcessorV2(LogitsProcessor):
    """The Model Runner V2 logits processor: the constrained requests by slot."""

    @classmethod
    def validate_params(cls, sampling_params) -> None:
        parse(sampling_params)

    def __init__(self, vllm_config, req_states) -> None:
        if getattr(vllm_config, "speculative_config", None) is not None:
            raise ValueError("seqstate's plugin cannot run with speculative decoding (a draft "
                             "token's row would need its constraint walked past tokens not "
                             "yet accepted); start the server without --speculative-config")
        self.req_states = req_states
        self.constrained = Constrained()

    def add_request(self, req_idx: int, sampling_params) -> bool:
        return self.constrained.add(req_idx, sampling_params, [])

    def apply(self, logits: torch.Tensor, ctx: LogitsContext) -> torch.Tensor:
        self.constrained.settle()
        requests = self.constrained.requests
        rows = {row: requests[slot] for row, slot in enumerate(ctx.idx_mapping_np.tolist())
                if slot in requests}
        if not rows:
            return logits
        self._catch_up(rows, ctx)
        return self.constrained.apply(logits, rows)

    def _catch_up(self, rows: dict[int, Request], ctx: LogitsContext) -> None:
        """Each row's `Request` given the tokens its request has committed since the last
        step: one gather from the runner's token buffer, one copy to the host."""
        prompt = self.req_states.prompt_len.np
        slots, columns, counts = [], [], []
        for row, request in rows.items():
            slot = int(ctx.idx_mapping_np[row])
            start = int(prompt[slot]) + len(request.output)
            end = int(ctx.seq_lens_upper_bound_np[row])          # its prompt and output so far
            counts.append(max(0, end - start))
            slots += [slot] * counts[-1]
            columns += range(start, end)
        if not slots:
            return
        buffer = self.req_states.all_token_ids.gpu                # (max_num_reqs, max_model_len)
        at = (torch.tensor(slots, device=buffer.device),
              torch.tensor(columns, device=buffer.device))
        tokens = iter(buffer[at].tolist())
        for request, count in zip(rows.values(), counts):
            request.output.extend(next(tokens) for _ in range(count))
