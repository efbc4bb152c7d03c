"""Run in the vLLM server's environment (``.venv-vllm``) by tests/test_vllm_plugin.py: the
plugin's two processors, each loaded by vLLM's own loader for its model runner, stepped side
by side over the same requests.  The scenario (JSON on stdin) names the requests; the answer
(JSON on stdout) says what each loader did and, at every step, whether the two processors'
masks were equal.

V1's processor gets what V1's runner gives it: a `BatchUpdate` per step (requests added with
their live output-token lists, removed, re-added after a preemption).  V2's gets what Model
Runner V2 gives it: ``add_request`` by slot, a `RequestState` whose buffers hold each slot's
committed tokens, and a `LogitsContext` per step whose rows come in a new order each step.
The writes that V2's runner makes with Triton kernels (vLLM's CPU build has none) are made
here directly into the same buffers: the prompt at admission, each sampled token after its
step (``post_update``).  Each step's token is the best of the V1-masked logits, so both
processors see the tokens a constrained request would produce.
"""

from __future__ import annotations

import json
import random
import sys

import torch

import vllm.v1.worker.cpu.shm  # noqa: F401  (vLLM's CPU worker's own shims, as it imports them)
from vllm import SamplingParams
from vllm.config import VllmConfig
from vllm.exceptions import VLLMValidationError
from vllm.v1.sample.logits_processor import BatchUpdate, build_logitsprocs
from vllm.v1.worker.gpu.sample.logits_processor import (LogitsContext,
                                                         build_custom_logits_processors,
                                                         build_custom_logits_processors_params_validator)
from vllm.v1.worker.gpu.states import RequestState

V1, V2 = "seqstate_vllm:SeqStateLogitsProcessor", "seqstate_vllm:SeqStateLogitsProcessorV2"
SLOTS, LENGTH = 8, 512


def loaders(config: VllmConfig, states: RequestState, good: dict) -> dict:
    """What vLLM's V2 loader and admission check do with each class."""
    said = {}
    try:
        build_custom_logits_processors(config, states, False, [V1])
        said["v1_on_v2"] = "accepted"
    except ValueError as exc:
        said["v1_on_v2"] = str(exc)
    validate = build_custom_logits_processors_params_validator([V2])
    validate(SamplingParams(extra_args={"seqstate": json.dumps(good)}))
    try:
        validate(SamplingParams(extra_args={"seqstate": "{"}))
        said["malformed"] = "accepted"
    except VLLMValidationError as exc:                    # the API server's HTTP 400
        said["malformed"] = str(exc)
    return said


class Runners:
    """Both processors and the state each runner keeps for them."""

    def __init__(self, scenario: dict) -> None:
        self.config = VllmConfig()
        self.states = RequestState(SLOTS, LENGTH, LENGTH, 0, scenario["vocab"],
                                   torch.device("cpu"))
        built = build_logitsprocs(self.config, torch.device("cpu"), False, False, [V1])
        self.v1 = next(p for p in built.all if type(p).__name__ == "SeqStateLogitsProcessor")
        self.v2, = build_custom_logits_processors(self.config, self.states, False, [V2])
        for kind, text in scenario["builds"]:             # built before the first step
            for processor in (self.v1, self.v2):
                processor.constrained.builder.build(kind, text).result(timeout=120)
        self.index: dict[str, int] = {}                   # V1: request -> batch index
        self.slot: dict[str, int] = {}                    # V2: request -> slot
        self.outputs: dict[str, list[int]] = {}
        self.held: dict[int, str] = {}                    # V2: slot -> its last request
        self.reused = 0                                   # slots that held another request
        self.added, self.removed = [], []

    def join(self, name: str, params: SamplingParams, prompt: list[int]) -> None:
        """The request joins (again, after a preemption: its output so far is kept)."""
        output = self.outputs.setdefault(name, [])
        self.index[name] = min(set(range(SLOTS)) - set(self.index.values()))
        self.added.append((self.index[name], params, prompt, output))
        slot = self.slot[name] = min(set(range(SLOTS)) - set(self.slot.values()))
        self.reused += self.held.get(slot, name) != name
        self.held[slot] = name
        committed = prompt + output
        self.states.prompt_len.np[slot] = len(prompt)
        self.states.prefill_len.np[slot] = len(committed)
        self.states.prompt_len.copy_to_uva()
        self.states.prefill_len.copy_to_uva()
        self.states.all_token_ids.gpu[slot, :len(committed)] = torch.tensor(committed)
        self.states.total_len.gpu[slot] = len(committed)
        self.v2.add_request(slot, params)

    def leave(self, name: str) -> None:
        self.removed.append(self.index.pop(name))
        self.slot.pop(name)

    def step(self, names: list[str], seen: dict[str, int], generator: torch.Generator
             ) -> dict[str, tuple[bool, int]]:
        """One step over ``names`` (in V2's row order), ``seen[name]`` tokens visible to
        each; per request: (whether the two masks are equal, how many tokens V1's allows)."""
        self.v1.update_state(BatchUpdate(batch_size=len(self.index), removed=self.removed,
                                         added=self.added, moved=[]))
        self.added, self.removed = [], []
        vocab = self.states.vocab_size
        logits = torch.randn(len(names), vocab, generator=generator)
        by_index = torch.zeros(SLOTS, vocab)
        for row, name in enumerate(names):
            by_index[self.index[name]] = logits[row]
        slots = [self.slot[name] for name in names]
        ctx = LogitsContext(expanded_idx_mapping=torch.tensor(slots),
                            idx_mapping=torch.tensor(slots), idx_mapping_np=torch.tensor(
                                slots).numpy(), expanded_local_pos=torch.zeros(len(names)),
                            input_ids=torch.zeros(len(names), dtype=torch.long),
                            pos=torch.zeros(len(names)),
                            seq_lens_upper_bound_np=torch.tensor(
                                [seen[name] for name in names]).numpy())
        first = self.v1.apply(by_index.clone())
        second = self.v2.apply(logits.clone(), ctx)
        out = {}
        for row, name in enumerate(names):
            one, two = first[self.index[name]], second[row]
            out[name] = (torch.equal(one, two), int(torch.isfinite(one).sum()))
        return out, {name: int(first[self.index[name]].argmax()) for name in names}

    def commit(self, name: str, token: int) -> None:
        """The sampled token, where each runner keeps it (V2: ``post_update``'s writes)."""
        self.outputs[name].append(token)
        slot = self.slot[name]
        total = int(self.states.total_len.gpu[slot])
        self.states.all_token_ids.gpu[slot, total] = token
        self.states.total_len.gpu[slot] = total + 1


def main() -> None:
    scenario = json.load(sys.stdin)
    runners = Runners(scenario)
    said = loaders(runners.config, runners.states, scenario["requests"][0]["spec"])
    generator = torch.Generator().manual_seed(scenario["seed"])
    order = random.Random(scenario["seed"])
    requests = {r["name"]: r for r in scenario["requests"]}
    params = {n: SamplingParams(extra_args=None if r["spec"] is None else
                                {"seqstate": json.dumps(r["spec"])})
              for n, r in requests.items()}
    steps, live, chunked = [], [], set()
    for step in range(scenario["steps"]):
        for name, r in requests.items():
            if r["joins"] == step:
                runners.join(name, params[name], r["prompt"])
                live.append(name)
                if r.get("chunked"):
                    chunked.add(name)
            if r.get("preempted") == step and name in live:
                runners.leave(name)
                runners.join(name, params[name], r["prompt"])
        if not live:
            break
        order.shuffle(live)
        seen = {n: len(requests[n]["prompt"]) + len(runners.outputs[n]) for n in live}
        for name in chunked:                              # half its prompt computed
            seen[name] = len(requests[name]["prompt"]) // 2
        compared, best = runners.step(list(live), seen, generator)
        steps.append(compared)
        for name in list(live):
            if name in chunked:                           # no token from a partial prefill
                chunked.discard(name)
                continue
            runners.commit(name, best[name])
            r = requests[name]
            if best[name] in r["ends"] or len(runners.outputs[name]) >= r["max_tokens"]:
                runners.leave(name)
                live.remove(name)
    print(json.dumps({"loaders": said, "steps": steps, "outputs": runners.outputs,
                      "reused": runners.reused}))


if __name__ == "__main__":
    main()
