"""What only the vllm engine has: a real vLLM server on loopback (fp32, seqstate's plugin
inside), its requests, its prefix cache, its HTTP failures, its vocabulary check.

Features that every engine has run on the server too, through conftest's `engine` fixture in
the feature files (chat, captures, healing, call options, failures, scoring, the contract in
test_contract.py).  Here the reference is twofold: the HF engine on the same weights (greedy ids
equal, log-probs within fp32 noise: `assert_close`'s bound from the HF model's noise floor
measured on this CPU) and the server's own answers (prompt_logprobs for scoring).  Constraints
run in the server's plugin; their tokens must equal the HF engine's, which runs them locally.
"""

from __future__ import annotations

import dataclasses
import http.server
import json
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

import seqstate as ss
from seqstate.backends.base import Completion
from seqstate.backends.vllm.backend import VllmBackend

from conftest import assert_close, assert_same_rows, collect

pytestmark = pytest.mark.vllm

PERSON = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"]}
ARITHMETIC = """
start: NUMBER OP NUMBER
OP: "+" | "-"
NUMBER: /[0-9]{1,3}/
"""


def calls(model) -> int:
    return model.stats.forward_calls


# -- native requests ---------------------------------------------------------------------------
def test_samples_share_one_request(vllm):
    prompt = "Pick a random fruit:"
    before = vllm.stats
    ss.text(vllm)(prompt, num_samples=4, max_tokens=8, sampler=ss.multinomial(), seed=7)
    used = vllm.stats - before
    assert used.forward_calls == 1                        # the fork is one request with n=4
    assert used.prefill_tokens + used.cached_tokens_reused == len(vllm.encode_prompt(prompt))


def test_the_prefix_cache_is_reported_as_reuse(vllm):
    prompt = " ".join(["The quick brown fox jumps over the lazy dog."] * 12)
    ss.text(vllm)(prompt, max_tokens=1)
    before = vllm.stats
    ss.text(vllm)(prompt + " Again:", max_tokens=1)
    used = vllm.stats - before
    assert used.cached_tokens_reused >= 96                 # whole 32-token blocks of the prompt
    assert used.prefill_tokens < 40


# -- constraints in the server's plugin --------------------------------------------------------
@pytest.mark.parametrize("make", [
    lambda m: ss.regex(m, r"[0-9]{3}-[0-9]{2}"),
    lambda m: ss.regex(m, r"[0-9]{0,3}"),                # matches the empty string (sentinel)
    lambda m: ss.choice(m, ["Paris", "London", "Lyon"]),
    lambda m: ss.json(m, PERSON),
    lambda m: ss.cfg(m, ARITHMETIC),
], ids=["regex", "empty-matching regex", "choice", "json", "cfg"])
def test_constraints_equal_local_cursors(vllm, real, make):
    prompt = "Answer: "
    a, b = make(vllm)(prompt), make(real)(prompt)
    assert_same_rows(a, b)
    assert a.value == b.value and a.finish_reason == b.finish_reason


@pytest.mark.parametrize("make", [
    lambda m: ss.json(m, PERSON),
    lambda m: ss.regex(m, r"(ab|cd){3,6}x"),
], ids=["json", "regex"])
def test_resume_after_slicing_continues_the_constraint(vllm, real, make):
    whole = make(vllm)("Data: ")
    assert whole.token_ids == make(real)("Data: ").token_ids
    for k in (1, 3):
        sliced = whole[:, :, :-k]
        resumed = make(vllm).resume(sliced)
        # the plugin replayed the k-shorter span: the server's cursor stood where the local one did
        assert resumed.token_ids == whole.token_ids and resumed.value == whole.value


def test_concatenation_then_another_constraint(vllm, real):
    def program(model):
        s = ss.text(model)("My favourite city is", max_tokens=6)
        s = ss.choice(model, ["Paris", "Rome"])(s + ". Capital of France:")
        return ss.json(model, PERSON)(s + "\nA person: ")

    assert_same_rows(program(vllm), program(real))


# -- hooks on the stream: an intervention re-sends from the kept tokens -------------------------
def test_ban_phrases_equal_the_hf_engine(vllm, real):
    for prompt, phrases in [("The capital of France is", ["Paris"]),
                            ("List three colors:", ["red", "blue"])]:
        a = ss.text(vllm)(prompt, max_tokens=24, hooks=[ss.hooks.ban_phrases(phrases)])
        b = ss.text(real)(prompt, max_tokens=24, hooks=[ss.hooks.ban_phrases(phrases)])
        assert_same_rows(a, b)
        assert not any(p.lower() in a.value.lower() for p in phrases)


def test_resample_replace_and_constraints_with_hooks_equal_the_hf_engine(vllm, real):
    space = vllm.encode(" the")[0]
    dot = vllm.encode(".")[0]

    def hook(event):
        assert event.logits is None or event.logits.ndim == 1
        if event.token == space:
            return ss.hooks.Resample()
        if event.token == dot:
            return ss.hooks.Replace(vllm.encode("!")[0])
        return None

    for make in (lambda m: ss.text(m), lambda m: ss.regex(m, r"[A-Za-z ,.!']{1,80}")):
        a = make(vllm)("Tell me about the sea.", max_tokens=20, hooks=[hook])
        b = make(real)("Tell me about the sea.", max_tokens=20, hooks=[hook])
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        assert space not in a.rows[0].tokens[len(vllm.encode_prompt("Tell me about the sea.")):]


def test_a_hooks_event_top_equals_the_hf_engines(vllm, real):
    """The server sends each token's 5 most likely alternatives (raw), so `event.top` reads
    the same tokens and probabilities as on an engine with the logits."""
    seen = {}

    def look(model):
        def hook(event):
            seen.setdefault(model, []).append((event.token, event.top))
        return hook

    for model in (vllm, real):
        ss.text(model)("The capital of France is", max_tokens=6, hooks=[look(model)])
    assert len(seen[vllm]) == len(seen[real]) == 6
    for (token, got), (same, want) in zip(seen[vllm], seen[real]):
        assert token == same and got[0][0] == token
        assert [t for t, _ in got] == [t for t, _ in want]
        assert_close([p for _, p in got], [q for _, q in want], real,
                     "vLLM's top alternatives vs the HF engine's")


def test_a_streamed_hooked_call_yields_only_kept_text(vllm):
    hook = ss.hooks.ban_phrases(["Paris"])
    chunks, final = collect(ss.text(vllm).stream("The capital of France is", max_tokens=16,
                                                 hooks=[hook]))
    assert "".join(chunks) == final.value and "Paris" not in final.value


# -- scoring -----------------------------------------------------------------------------------
def test_score_equals_the_servers_prompt_logprobs(vllm, vllm_server, real):
    prefix = "Question: what is the capital of France? Answer:"
    options = [" Paris", " London", " the city of Lyon"]
    got = ss.text(vllm)(prefix, max_tokens=1)[:, :, :-1].score(options)
    ids = vllm.encode_prompt(prefix)
    for j, option in enumerate(options):
        cont = vllm.encode(option)
        body = {"model": vllm.backend.served, "prompt": ids + cont, "max_tokens": 1,
                "prompt_logprobs": 0, "temperature": 0}
        req = urllib.request.Request(vllm_server.url + "/v1/completions",
                                     json.dumps(body).encode(), {"Content-Type": "application/json"})
        with urllib.request.urlopen(req) as r:
            answer = json.loads(r.read())["choices"][0]["prompt_logprobs"]
        server = [answer[len(ids) + k][str(t)]["logprob"] for k, t in enumerate(cont)]
        mine = got.logprobs[0][0][j]
        assert_close(mine, server, real, "scores vs the server's prompt_logprobs")


def test_scored_choice_equals_the_hf_engine(vllm, real):
    options = ["blue", "green", "red"]
    a = ss.choice(vllm, options, method="score")("The sky on a clear day is")
    b = ss.choice(real, options, method="score")("The sky on a clear day is")
    assert a.value == b.value and a.token_ids == b.token_ids


# -- beam search: one-token requests for each beam's most likely allowed tokens ----------------
BEAMS = {
    "text, stopped": lambda m: ss.text(m)("Q: name a colour.\nA:", max_tokens=6, stop_at="\n",
                                          sampler=ss.beam_search(3)),
    "then a choice": lambda m: ss.choice(m, ["yes", "no", "maybe"])(
        BEAMS["text, stopped"](m) + " Is it warm? ", sampler=ss.beam_search(3)),
    "regex, two prompts": lambda m: ss.regex(m, r"[0-9]{2}")(["Two digits:", "A number:"],
                                                            sampler=ss.beam_search(4)),
    "json": lambda m: ss.json(m, {"type": "object", "properties": {"age": {"type": "integer"}},
                                  "required": ["age"]})("Bob is 42. JSON:", max_tokens=12,
                                                        sampler=ss.beam_search(2)),
}


@pytest.mark.parametrize("program", BEAMS)
def test_beam_search_equals_the_hf_engine(vllm, real, program):
    got, want = BEAMS[program](vllm), BEAMS[program](real)
    assert got.shape == want.shape
    assert_same_rows(got, want)


def test_a_beams_candidates_are_exact_for_every_allowed_set(vllm, real):
    """`top` against the HF engine's next-token distribution: no mask (the server's top k),
    a few allowed ids (asked for by id), and a large set that the server's most likely tokens
    barely meet (read from the whole distribution: a second request)."""
    tokens = real.encode_prompt("The capital of France is")
    want = real.full_logits(tokens)[-1].log_softmax(-1)
    size = want.shape[0]
    few = torch.zeros(size, dtype=torch.bool)
    few[[11, 400, 7042, 30000]] = True
    rare = torch.ones(size, dtype=torch.bool)
    rare[want.topk(200).indices] = False                  # the 200 most likely are not allowed
    for allowed, requests in [(None, 1), (few, 1), (rare, 2)]:
        before = calls(vllm)
        got = vllm.backend.top(tokens, 6, allowed)
        masked = want if allowed is None else want.masked_fill(~allowed, float("-inf"))
        top = masked.topk(min(6, int(masked.isfinite().sum())))
        assert [t for t, _ in got] == top.indices.tolist()
        assert_close([lp for _, lp in got], top.values, real, "a beam's candidates")
        assert calls(vllm) - before == requests


# -- failures ----------------------------------------------------------------------------------
def running(url: str) -> float:
    with urllib.request.urlopen(url + "/metrics") as r:
        for line in r.read().decode().splitlines():
            if line.startswith("vllm:num_requests_running"):
                return float(line.rsplit(" ", 1)[1])
    raise AssertionError("no running-requests gauge")


def test_a_stream_closed_early_aborts_its_request(vllm, vllm_server):
    stream = ss.text(vllm).stream("Count from one to a thousand:", max_tokens=2000)
    next(stream), next(stream)
    assert running(vllm_server.url) >= 1
    stream.close()
    deadline = time.monotonic() + 10
    while running(vllm_server.url) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert running(vllm_server.url) == 0


@pytest.mark.parametrize("feature", ["full_logits", "custom sampler"])
def test_features_needing_full_logits_are_refused_before_any_request(vllm, feature):
    state = ss.text(vllm)("Hello", max_tokens=2)
    before = calls(vllm)

    class Odd(ss.sampling.Greedy):
        pass

    run = {
        "full_logits": lambda: vllm.full_logits([1, 2, 3]),
        "custom sampler": lambda: ss.text(vllm)(state, sampler=Odd(), max_tokens=4),
    }[feature]
    with pytest.raises(ss.CapabilityError) as info:
        run()
    assert info.value.capability == "full_logits"
    assert info.value.engine == "vllm"
    assert calls(vllm) == before


def _status(url: str, body: dict) -> int:
    """The HTTP status of one raw completion request, straight to the server."""
    request = urllib.request.Request(url + "/v1/completions", json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request) as answer:
            return answer.status
    except urllib.error.HTTPError as err:
        return err.code


@pytest.mark.parametrize("name, outside, bound", [
    ("frequency_penalty", 2.5, 2.0), ("frequency_penalty", -2.5, -2.0),
    ("presence_penalty", 3.0, 2.0), ("presence_penalty", -3.0, -2.0),
    ("temperature", 2.5, 2.0)])
def test_values_outside_vllms_ranges_are_refused_before_any_request(vllm, vllm_server, name,
                                                                    outside, bound):
    before = calls(vllm)
    with pytest.raises(ss.ArgumentError, match=rf"{name}={outside!r} is outside vLLM's range"):
        ss.text(vllm)("Hello", sampler=ss.multinomial(**{name: outside}), max_tokens=2, seed=0)
    assert calls(vllm) == before
    # the server's own answers draw the same line: it refuses the value and takes the bound
    body = {"model": vllm.backend.served, "prompt": vllm.encode_prompt("Hello"),
            "max_tokens": 1}
    assert _status(vllm_server.url, {**body, name: outside}) == 400
    assert _status(vllm_server.url, {**body, name: bound}) == 200
    s = ss.text(vllm)("Hello", sampler=ss.multinomial(**{name: bound}), max_tokens=2, seed=0)
    assert s.finish_reason in ("max_tokens", "eos")


def test_vllms_ranges_refuse_only_what_the_sampler_lets_through():
    # no server: the check is the client's alone.  Values every engine's sampler refuses are
    # refused there first (one error type, one place); vLLM's own limits come after
    from seqstate.backends.vllm.backend import VLLM_RANGES, sampling_of

    assert set(VLLM_RANGES) <= set(sampling_of(ss.multinomial(top_p=0.5, min_p=0.1)))
    with pytest.raises(ss.ArgumentError, match=r"repetition_penalty=inf .* \(0, inf\)"):
        sampling_of(ss.multinomial(repetition_penalty=float("inf")))
    for wrong in ({"top_p": 0.0}, {"min_p": 1.5}, {"temperature": 0.0}):
        with pytest.raises(ss.ArgumentError):
            ss.multinomial(**wrong)            # the sampler's own bound, on every engine
    assert sampling_of(ss.greedy()) == {"temperature": 0.0}


def test_a_server_that_ignores_forcing_names_both_plugins(vllm, monkeypatch):
    # a server started without the plugin ignores the spec: its greedy tokens come back
    backend = vllm.backend
    served = backend.complete
    monkeypatch.setattr(backend, "complete", lambda request:
                        served(dataclasses.replace(request, spec=None)))
    state = ss.text(vllm)("The capital of France is", max_tokens=1)
    with pytest.raises(ss.EngineError, match="plugin loaded") as err:
        state.score([" zebra zebra zebra"])
    assert "SeqStateLogitsProcessor " in str(err.value)
    assert "SeqStateLogitsProcessorV2" in str(err.value)


def test_a_vocabulary_that_differs_is_refused(vllm):
    odd = VllmBackend(vllm.backend.client, vllm.backend.served, vllm.vocab.size, "0" * 64,
                      vllm.context_length)
    with pytest.raises(ss.ModelMismatch, match="vocabulary"):
        list(odd.complete(Completion(vllm.encode_prompt("Hi"), 2, ss.greedy(),
                                     spec={"regex": "(?:a)$"})))


def test_an_unreachable_server_is_a_typed_error():
    from seqstate.vllm import free_port

    with pytest.raises(ss.EngineError, match="did not answer"):
        ss.models.vllm(f"http://127.0.0.1:{free_port()}")


class _Dying(http.server.BaseHTTPRequestHandler):
    """A server that answers like vLLM, then drops the connection after two tokens."""

    folder = ""

    def log_message(self, *args):
        pass

    def do_GET(self):
        body = json.dumps({"data": [{"id": "m", "root": self.folder, "max_model_len": 512}]})
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body.encode())

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for token in (504, 3458):
            event = {"choices": [{"index": 0, "token_ids": [token], "finish_reason": None,
                                  "logprobs": {"token_logprobs": [-1.0],
                                               "top_logprobs": [{f"token_id:{token}": -1.0}]}}]}
            self.wfile.write(f"data: {json.dumps(event)}\n\n".encode())
            self.wfile.flush()
        self.wfile.write(b"data: {\"choices\": [{\"index\": 0, \"token_")   # cut mid-event
        self.wfile.flush()
        self.connection.shutdown(2)


def test_a_server_that_dies_mid_call_is_a_typed_error_and_loses_nothing(vllm_server):
    _Dying.folder = str(vllm_server.folder)
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Dying)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        model = ss.models.vllm(f"http://127.0.0.1:{httpd.server_address[1]}")
        state = ss.from_tokens(model, [model.encode_prompt("Hello there")])
        snapshot = (state.token_ids, str(state))
        for call in (lambda: ss.text(model)(state, max_tokens=8),
                     lambda: ss.text(model)(state, max_tokens=4, sampler=ss.beam_search(2)),
                     lambda: state.next_logprobs()):
            with pytest.raises(ss.EngineError):
                call()
        _, final = collect(ss.text(model).stream(state, max_tokens=1))      # one token: fine
        assert final.token_ids[0][0][-1] == 504
        assert (state.token_ids, str(state)) == snapshot
    finally:
        httpd.shutdown()


def test_stats_and_engine_name(vllm):
    assert vllm.engine == "vllm"
    assert not vllm.backend.capabilities.full_logits
    with vllm.frozen_store():                          # nothing is stored here to freeze
        ss.text(vllm)("Hi", max_tokens=1)
    before = vllm.stats
    ss.text(vllm)("Hi there", max_tokens=3)
    used = vllm.stats - before
    assert used.forward_calls == 1 and used.decode_tokens == 3
    assert used.kv_bytes_cached == 0                     # the KV is the server's
