"""One decode step's token masks for 64 JSON rows: the step's path beside llguidance's own.

``python -m benchmarks masks``: 64 rows of the overhead suite's JSON schema, each at its own
place in one document (so no two share a mask), on SmolLM2's vocabulary (49k tokens) and on
Gemma 3 270M's (262k). For each, the best of a few repeats, one thread:

- **llguidance fill**: ``fill_next_token_bitmask_par`` alone into a packed (64, V/32) int32
  bitmask: the floor, what any engine on llguidance pays;
- **step masks**: the decode step's masks for those rows (`allowed_masks`: every row's
  mask, bool (64, V) on the CPU, ready to apply), fresh cursors each repeat, so nothing is
  cached;
- **step constrain**: the step's whole constrain stage (`Stepper._masked`: the masks, then
  the logits masked with them);
- **plugin**: seqstate's vLLM plugin's processor function (``mask_rows``, read from the
  checkout's ``plugins/``) on CPU logits: the rows' masks and the logits masked, the tokens
  of each row walked beforehand.

The masked logits cost one pass over (64, V) floats whatever the masks' form: at Gemma's
vocabulary that pass is most of the constrain stage on a CPU.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import pathlib
import sys
import tempfile
import time
import types

import llguidance
import llguidance.torch
import torch

import seqstate as ss
from benchmarks.overhead import SCHEMA
from seqstate.backends.vllm import wire
from seqstate.constraints import spec as keys
from seqstate.backends.vllm.vocab import signal_tokens, vocabulary_table
from seqstate.engine.buffers import StepBuffers
from seqstate.engine.masks import allowed_masks
from seqstate.engine.rows import LiveRow, RowRequest
from seqstate.engine.step import Stepper

ROWS = 64
REPEAT = 5


def _document(model) -> list[int]:
    """The tokens of one valid document of the schema (its two strings long enough for each
    of the rows to stop at its own place inside them)."""
    return model.encode('{"name": "' + "a quiet river runs by the old mill " * 8
                        + '", "city": "' + "north of the hills " * 12 + '"}')


def _walked(model, rows: int) -> list:
    """``rows`` cursors of the JSON schema, row k after the first k+1 tokens of the
    document."""
    tokens = _document(model)
    cursor = ss.json(model, SCHEMA).constraint.start()
    walked = []
    for token in tokens[:rows]:
        cursor = cursor.advance(token)
        walked.append(cursor)
    return walked


def _best(run) -> float:
    best = float("inf")
    for _ in range(REPEAT):
        t = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - t)
    return best


def measure(model, label: str) -> dict[str, float]:
    """Seconds for one step's masks of ``ROWS`` JSON rows: llguidance's fill, the step's."""
    walked = _walked(model, ROWS)
    constraint = walked[0].constraint
    width = model.vocab.size
    bitmask = llguidance.torch.allocate_token_bitmask(ROWS, width)

    def fill():
        llguidance.torch.fill_next_token_bitmask_par(
            constraint.executor, [(c.matcher, k) for k, c in enumerate(walked)], bitmask)

    logits = torch.randn(ROWS, width, generator=torch.Generator().manual_seed(0))
    buffers = StepBuffers()

    def rows():
        fresh = [type(c)(c.constraint, c.matcher) for c in walked]      # nothing cached
        return [LiveRow(RowRequest((1,), 8, cursor=c), model.vocab, model.eos_token_ids)
                for c in fresh]

    def step():
        Stepper(model, rows=rows())._masked(range(ROWS), logits, True, buffers)

    out = {"llguidance fill": _best(fill),
           "step masks": _best(lambda: allowed_masks(rows(), width, torch.device("cpu"))),
           "step constrain": _best(step), "plugin": _plugin(model, logits)}
    fill_time = out["llguidance fill"]
    print(f"  {label:13s} {width:>7d} " + " ".join(
        f"{v * 1e3:8.2f} ms ({v / fill_time:5.1f}x)" for v in out.values()), flush=True)
    return out


def _plugin(model, logits: torch.Tensor) -> float:
    """The plugin's ``mask_rows`` for the rows, over the model's vocabulary table as
    ``serve`` writes it; each repeat starts from the rows' masks unknown."""
    table = vocabulary_table(model.vocab, model.eos_token_ids)
    with tempfile.TemporaryDirectory() as tmp:
        path = pathlib.Path(tmp) / wire.VOCAB_FILE
        path.write_text(json.dumps(table))
        os.environ[wire.VOCAB_ENV] = str(path)
        package = types.ModuleType("seqstate_vllm")       # its __init__ (vLLM's) not run
        package.__path__ = [str(pathlib.Path(__file__).parents[1] / "plugins" / "seqstate-vllm"
                                / "seqstate_vllm")]
        sys.modules["seqstate_vllm"] = package
        try:
            build, cursors, tables = (importlib.import_module(f"seqstate_vllm.{name}")
                                      for name in ("build", "cursors", "table"))

            grammar = ss.json(model, SCHEMA).constraint.remote()[keys.GRAMMAR]
            spec = {wire.VOCAB_KEY: tables.table().fingerprint,
                    wire.SIGNALS: signal_tokens(table), keys.GRAMMAR: grammar}
            built = build.Builder().build(keys.GRAMMAR, grammar)
            built.result(timeout=120)
            tokens = _document(model)
            requests = {k: cursors.Request(spec, tokens[: k + 1], built) for k in range(ROWS)}
            for request in requests.values():
                request.walk() if hasattr(request, "walk") else request.keep(logits.shape[1])
            work = logits.clone()

            def run():
                for request in requests.values():
                    request.cursor.words = None          # (before: no cache to clear)
                work.copy_(logits)
                cursors.mask_rows(requests, work)

            return _best(run)
        finally:
            for name in [m for m in sys.modules if m.startswith("seqstate_vllm")]:
                del sys.modules[name]
            os.environ.pop(wire.VOCAB_ENV)


def main(model=None, **_) -> dict[str, dict[str, float]]:
    torch.set_num_threads(1)
    print(f"\n== one step's masks, {ROWS} JSON rows, 1 thread "
          f"(llguidance {importlib.metadata.version('llguidance')}); each against the fill")
    print(f"  {'vocabulary':13s} {'V':>7s} " + " ".join(
        f"{k:>20s}" for k in ("llguidance fill", "step masks", "step constrain", "plugin")))
    models = {"SmolLM2": model or ss.models.default(),
              "Gemma 3 270M": ss.models.transformers(ss.models.gemma3_gguf())}
    return {label: measure(m, label) for label, m in models.items()}


if __name__ == "__main__":
    main()
