"""The vllm engine against vLLM's own OpenAI-compatible API and against seqstate's llama.cpp
engine, in one run, on one fp32 server with seqstate's plugin.

The peer sends what a user of vLLM's API would: text prompts (the program's text so far) and
vLLM's own structured outputs (``structured_outputs``: choice, json); seqstate sends token ids
and runs its constraints in the plugin.  Both run the same 16 programs concurrently.
"""

from __future__ import annotations

import json
import time
from concurrent.futures import ThreadPoolExecutor

import urllib3

import seqstate as ss
from benchmarks.harness import interleaved, report
from seqstate.vllm import Server

PROGRAMS = 16
TEXT_TOKENS = 24
TOPICS = [f"topic number {i}: {w}" for i, w in enumerate(
    ["rivers", "stars", "cats", "trains", "bread", "rain", "maps", "glass",
     "bees", "salt", "ships", "clocks", "moss", "kites", "ink", "wolves"])]
OPTIONS = ["positive", "negative", "neutral"]
SCHEMA = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 24},
                                           "score": {"type": "integer", "minimum": 0,
                                                     "maximum": 10}},
          "required": ["title", "score"]}


class Direct:
    """Programs as plain OpenAI-compatible requests with vLLM's structured outputs."""

    def __init__(self, url: str, served: str) -> None:
        self.url, self.served = url, served
        self.http = urllib3.PoolManager(maxsize=64)
        self.usage = {"requests": 0, "prompt": 0, "cached": 0, "completion": 0}

    def complete(self, prompt: str, **extra) -> str:
        return self.choices(prompt, **extra)[0]

    def choices(self, prompt: str, **extra) -> list[str]:
        body = {"model": self.served, "prompt": prompt, "temperature": 0, **extra}
        r = self.http.request("POST", self.url + "/v1/completions", body=json.dumps(body),
                              headers={"Content-Type": "application/json"})
        answer = json.loads(r.data)
        u = answer["usage"]
        self.usage["requests"] += 1
        self.usage["prompt"] += u["prompt_tokens"]
        self.usage["cached"] += (u.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
        self.usage["completion"] += u["completion_tokens"]
        return [c["text"] for c in answer["choices"]]

    def program(self, topic: str) -> str:
        text = f"Write one sentence about {topic}."
        text += self.complete(text, max_tokens=TEXT_TOKENS)
        text += " Sentiment: "
        text += self.complete(text, max_tokens=8, structured_outputs={"choice": OPTIONS})
        text += "\nAs JSON: "
        return text + self.complete(text, max_tokens=64, structured_outputs={"json": SCHEMA})


def program(model, topic: str) -> ss.SequenceState:
    s = ss.text(model)(f"Write one sentence about {topic}.", max_tokens=TEXT_TOKENS)
    s = ss.choice(model, OPTIONS)(s + " Sentiment: ")
    return ss.json(model, SCHEMA)(s + "\nAs JSON: ", max_tokens=64)


def concurrently(fn, items):
    with ThreadPoolExecutor(max_workers=len(items)) as pool:
        return list(pool.map(fn, items))


def main(model=None) -> None:
    server = Server(log=open("/tmp/seqstate-bench-vllm.log", "w")).start()
    try:
        remote = ss.models.vllm(server.url)
        direct = Direct(server.url, remote.backend.served)
        llama = ss.models.default(engine="llama.cpp")
        _programs(remote, direct, llama)
        _single_calls(remote, direct)
        _fork(remote)
        _beams(remote, direct)
    finally:
        server.stop()


def _programs(remote, direct, llama) -> None:
    t_ours, t_direct = interleaved([lambda: concurrently(lambda t: program(remote, t), TOPICS),
                                    lambda: concurrently(direct.program, TOPICS)], repeat=3)
    t0 = time.perf_counter()
    ss.run_batch(lambda t: program(llama, t), TOPICS)
    t_llama = time.perf_counter() - t0
    before = remote.stats
    states = concurrently(lambda t: program(remote, t), TOPICS)
    used = remote.stats - before
    generated = sum(len(r.tokens) - r.spans[0].start for s in states for r in s.rows)
    reused = used.cached_tokens_reused / max(1, used.cached_tokens_reused + used.prefill_tokens)
    u = {k: 0 for k in direct.usage}
    before_direct = dict(direct.usage)
    concurrently(direct.program, TOPICS)
    u = {k: direct.usage[k] - before_direct[k] for k in u}
    report(f"{PROGRAMS} concurrent programs: text ({TEXT_TOKENS} tokens) -> choice -> JSON", [
        ("vLLM API + structured outputs", t_direct,
         f"{u['requests']} requests, cached share {u['cached'] / max(1, u['prompt']):.2f}"),
        ("seqstate vllm engine (plugin)", t_ours,
         f"{used.forward_calls} requests, cached share {reused:.2f}, "
         f"{generated / t_ours:.1f} generated tok/s"),
        ("seqstate llama.cpp engine", t_llama, "run_batch, one process"),
    ], "vLLM API + structured outputs")


def _single_calls(remote, direct) -> None:
    prompts = [f"Write one sentence about {t}." for t in TOPICS]
    t_ours, t_direct = interleaved([
        lambda: concurrently(lambda p: ss.text(remote)(p, max_tokens=32), prompts),
        lambda: concurrently(lambda p: direct.complete(p, max_tokens=32), prompts),
    ], repeat=3)
    report(f"native text: {PROGRAMS} concurrent calls x 32 tokens", [
        ("vLLM API", t_direct, ""), ("seqstate vllm engine", t_ours, "")], "vLLM API")
    gen = ss.json(remote, SCHEMA)
    t_ours, t_direct = interleaved([
        lambda: concurrently(lambda p: gen(p + " As JSON: ", max_tokens=64), prompts),
        lambda: concurrently(lambda p: direct.complete(p + " As JSON: ", max_tokens=64,
                                                       structured_outputs={"json": SCHEMA}), prompts),
    ], repeat=3)
    report(f"constrained: {PROGRAMS} concurrent JSON calls", [
        ("vLLM structured outputs", t_direct, ""),
        ("seqstate plugin (llguidance)", t_ours, "")], "vLLM structured outputs")


def _fork(remote) -> None:
    prompt = ("Once upon a time, in a small village by the sea, there lived an old keeper. " * 40)
    ids = remote.encode_prompt(prompt)[:512]
    state = ss.from_tokens(remote, [ids])
    before = remote.stats
    t0 = time.perf_counter()
    ss.text(remote)(state, num_samples=8, sampler=ss.multinomial(), seed=0, max_tokens=32)
    took = time.perf_counter() - t0
    used = remote.stats - before
    print(f"\n== fork: 512-token prompt, 8 samples x 32 tokens on the vllm engine: "
          f"{took * 1000:.0f} ms, {used.forward_calls} request(s), prompt tokens sent "
          f"{used.prefill_tokens + used.cached_tokens_reused} (prefilled {used.prefill_tokens}, "
          f"cached {used.cached_tokens_reused})")


def _beams(remote, direct) -> None:
    """Beam search, 4 prompts at once: seqstate's (one-token requests per beam, selection
    here) against vLLM's own (``use_beam_search``); the same beams are expected."""
    prompts = [f"Write one sentence about {t}." for t in TOPICS[:4]]
    width, tokens = 4, 16

    def ours():
        return concurrently(lambda p: ss.text(remote)(p, max_tokens=tokens,
                                                      sampler=ss.beam_search(width)), prompts)

    def theirs():
        return concurrently(lambda p: direct.choices(p, max_tokens=tokens, n=width,
                                                     use_beam_search=True), prompts)

    t_ours, t_direct = interleaved([ours, theirs], repeat=3)
    got = [sorted(s.value[0]) for s in ours()]
    want = [sorted(texts) for texts in theirs()]
    same = sum(g == w for g, w in zip(got, want))
    report(f"beam search: {len(prompts)} concurrent prompts, width {width}, {tokens} tokens", [
        ("vLLM use_beam_search", t_direct, ""),
        ("seqstate vllm engine", t_ours, f"same {width} beams on {same}/{len(prompts)} prompts"),
    ], "vLLM use_beam_search")

