"""The vLLM plugin without a server: its admission check (fuzzed), its bounded builds off the
step loop, the signals that end a request whose constraint is not built or failed, and the
batched mask.  The plugin's modules are read from the checkout (conftest's ``plugin``); its
table is built over the tiny model's vocabulary, as ``serve`` writes it."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import Future

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import seqstate as ss
from seqstate.backends.base import Completion
from seqstate.backends.vllm import wire
from seqstate.backends.vllm.vocab import signal_tokens, vocabulary_table
from seqstate.constraints import spec as keys

from conftest import PLUGIN_PACKAGE

pytestmark = pytest.mark.vllm

PATHOLOGICAL = "(a|b)*a(a|b){40}"          # a DFA of 2^40 states


@pytest.fixture(scope="module")
def served(plugin, tiny, tmp_path_factory):
    """The plugin's modules with the tiny vocabulary's table named as ``serve`` names it:
    (table, its JSON form, the signals a client sends)."""
    table = vocabulary_table(tiny.vocab, tiny.eos_token_ids)
    path = tmp_path_factory.mktemp("vocab") / wire.VOCAB_FILE
    path.write_text(json.dumps(table))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(wire.VOCAB_ENV, str(path))
        yield plugin.module("table").table(), table, signal_tokens(table)


def _spec(served, **entries):
    table, _, signals = served
    return {wire.VOCAB_KEY: table.fingerprint, wire.SIGNALS: signals, **entries}


def _done(built) -> Future:
    future = Future()
    future.set_result(built)
    return future


# -- admission ---------------------------------------------------------------------------------
JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
                    lambda inner: st.lists(inner, max_size=4)
                    | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=12)
ID = st.integers(-3, 49160)
VALUES = {keys.REGEX: st.text(max_size=8) | JSON, keys.GRAMMAR: st.text(max_size=8) | JSON,
          keys.HEAL: st.text("0123456789abcdefx", max_size=6) | JSON,
          keys.REPLAY: st.lists(ID, max_size=4) | JSON, keys.FORCE: st.lists(ID, max_size=4) | JSON,
          keys.BAN: st.lists(st.tuples(ID, st.lists(ID, max_size=3)).map(list), max_size=3) | JSON,
          keys.ALLOW: st.lists(st.tuples(ID, st.lists(ID, max_size=3)).map(list), max_size=3)
          | JSON, wire.SIGNALS: st.lists(ID, min_size=3, max_size=5) | JSON}


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_a_spec_is_refused_with_a_message_or_admitted_and_never_fails_a_step(served, plugin,
                                                                            data):
    """Whatever a client sends (garbage, wrong types, ids out of range, near-miss specs):
    admission raises `SpecError` (HTTP 400) with its message, or the spec is one the engine
    steps without an exception, its regex or grammar built or failed."""
    table, _, _ = served
    check, cursors, build = plugin.module("spec"), plugin.module("cursors"), plugin.module("build")
    chosen = data.draw(st.sets(st.sampled_from(sorted(VALUES)), max_size=4))
    raw = {wire.VOCAB_KEY: data.draw(st.sampled_from([table.fingerprint, "x"]))}
    raw.update((key, data.draw(VALUES[key])) for key in chosen)
    sent = data.draw(st.sampled_from([raw, json.dumps(raw)]) | JSON | st.text() | st.binary())
    try:
        spec = check.check(sent, table.fingerprint, table.size)
    except check.SpecError as exc:
        assert str(exc).startswith("seqstate spec refused: ")
        return
    failed = _done(build.Built(failure=wire.FAILED, reason="not built here"))
    constrained = keys.REGEX in spec or keys.GRAMMAR in spec
    request = cursors.Request(spec, [], failed if constrained else None)
    for token in data.draw(st.lists(st.integers(0, table.size - 1), max_size=3)):
        keep = request.keep(table.size)
        assert keep is None or keep.shape == (table.size,)
        request.output.append(token)
    if constrained:                  # a regex or grammar needs signals, and ends by one
        assert request.keep(table.size).nonzero().flatten().tolist() == [
            spec[wire.SIGNALS][wire.SIGNAL_KINDS.index(wire.FAILED)]]


def test_what_admission_refuses_says_why(served, plugin):
    table, _, _ = served
    check = plugin.module("spec")
    bad = {"not JSON": "{", "expected a JSON object": "[1]", "unknown keys": {"regexp": "a"},
           "needs signals": {keys.REGEX: "a"}, "vocabulary mismatch": {wire.VOCAB_KEY: "x"},
           "not a token id": {keys.REPLAY: [table.size]}, "over the bound": {
               keys.REGEX: "a" * (check.MAX_CONSTRAINT_CHARS + 1)},
           "not hex": {keys.HEAL: "zz"}, "at most one": {keys.REGEX: "a", keys.GRAMMAR: "b"}}
    for why, raw in bad.items():
        if isinstance(raw, dict):
            raw = {wire.VOCAB_KEY: table.fingerprint, **raw}
        with pytest.raises(ValueError, match=why):
            check.check(raw, table.fingerprint, table.size)


# -- builds off the step loop --------------------------------------------------------------------
@pytest.fixture(scope="module")
def builder(served, plugin):
    build = plugin.module("build")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(build.SECONDS_ENV, "3")
        yield build.Builder()


def test_builds_are_bounded_in_time_and_failures_are_kept(builder):
    started = time.monotonic()
    slow = builder.build(keys.REGEX, PATHOLOGICAL)
    fine = builder.build(keys.REGEX, "[0-9]{3}")
    assert fine.result(timeout=30).failure is None          # not held up by the slow one
    assert not slow.done()
    built = slow.result(timeout=30)
    assert built.failure == wire.BOUND and "over 3 s" in built.reason, built
    assert time.monotonic() - started < 10
    assert builder.build(keys.REGEX, PATHOLOGICAL) is slow                 # answered at once
    wrong = builder.build(keys.REGEX, "(").result(timeout=30)
    assert wrong.failure == wire.FAILED and wrong.reason
    grammar = builder.build(keys.GRAMMAR, "start: /[/").result(timeout=30)
    assert grammar.failure == wire.FAILED and grammar.reason


def test_a_regex_build_is_bounded_in_memory(served, plugin):
    build = plugin.module("build")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(build.MIB_ENV, "64")
        patch.setenv(build.SECONDS_ENV, "120")     # the memory bound ends it, on a slow CPU too
        built = build.Builder().build(keys.REGEX, PATHOLOGICAL).result(timeout=180)
    assert built.failure == wire.BOUND and "MiB" in built.reason, built


# -- signals -------------------------------------------------------------------------------------
def test_a_request_waits_then_runs_or_ends_by_its_signal(served, plugin, builder, tiny):
    table, _, signals = served
    cursors, build = plugin.module("cursors"), plugin.module("build")
    signal = dict(zip(wire.SIGNAL_KINDS, signals))
    spec = _spec(served, **{keys.REGEX: "[0-9]{2}"})

    def only(request):
        return request.keep(table.size).nonzero().flatten().tolist()

    assert only(cursors.Request(spec, [], Future())) == [signal[wire.PENDING]]
    assert only(cursors.Request(spec, [], _done(build.Built(failure=wire.BOUND)))) == [
        signal[wire.BOUND]]
    output: list[int] = []
    running = cursors.Request(spec, output, builder.build(keys.REGEX, "[0-9]{2}"))
    running.build.result(timeout=30)
    allowed = running.keep(table.size)
    assert not allowed[signals].any() and allowed.any()
    digits = [i for i in allowed.nonzero().flatten().tolist()
              if tiny.vocab.decode([i]).isdigit() and len(tiny.vocab.decode([i])) == 1]
    output.append(digits[0])
    assert running.keep(table.size).any()
    output.append(tiny.encode("x")[-1])          # a token the mask did not allow: it broke
    assert only(running) == [signal[wire.BROKE]]
    replayed = cursors.Request({**spec, keys.REPLAY: [tiny.encode("x")[-1]]}, [],
                               builder.build(keys.REGEX, "[0-9]{2}"))
    replayed.build.result(timeout=30)
    assert only(replayed) == [signal[wire.BROKE]]


def test_every_rows_mask_is_applied_at_once_as_row_by_row(served, plugin, builder, tiny):
    table, _, _ = served
    cursors = plugin.module("cursors")
    for kind, text in ((keys.REGEX, "[0-9]{2}"), (keys.REGEX, "(?:yes|no)"),
                       (keys.GRAMMAR, SUM_GRAMMAR)):
        builder.build(kind, text).result(timeout=30)

    def requests():
        """Regex, forced, banned and grammar rows (two grammar rows past a token): the
        grammar rows' masks are filled together in `mask_rows`, one by one in ``keep``."""
        made = {0: cursors.Request(_spec(served, **{keys.REGEX: "[0-9]{2}"}), [],
                                   builder.build(keys.REGEX, "[0-9]{2}")),
                2: cursors.Request(_spec(served, **{keys.FORCE: [5, 6]}), [], None),
                3: cursors.Request(_spec(served, **{keys.BAN: [[0, [1, 2, 3]]]}), [], None),
                4: cursors.Request(_spec(served, **{keys.REGEX: "(?:yes|no)"}), [],
                                   builder.build(keys.REGEX, "(?:yes|no)"))}
        for index, output in ((6, []), (7, tiny.encode("12")), (8, tiny.encode("7+"))):
            made[index] = cursors.Request(_spec(served, **{keys.GRAMMAR: SUM_GRAMMAR}),
                                          output, builder.build(keys.GRAMMAR, SUM_GRAMMAR))
        return made

    logits = torch.randn(10, table.size + 64)                 # a padded vocabulary
    expected = logits.clone()
    for index, request in requests().items():
        keep = request.keep(logits.shape[1])
        expected[index].masked_fill_(~keep, float("-inf"))
    got = cursors.mask_rows(requests(), logits)
    assert torch.equal(got, expected)
    assert torch.isfinite(got[1]).all() and torch.isfinite(got[5]).all()     # free rows
    assert all(torch.isfinite(got[j]).sum() > 1 for j in (6, 7, 8))     # more than EOS
    packed = np.stack([r.packed(logits.shape[1]) for r in requests().values()])
    assert torch.equal(cursors.unpack_tensor(torch.from_numpy(packed.view(np.int32)),
                                             logits.shape[1]),                # a GPU's way
                       cursors.unpack(packed, logits.shape[1], torch.device("cpu")))


# -- both model runners ----------------------------------------------------------------------
RUNNERS = pathlib.Path(__file__).parent / "vllm_runners.py"
CODE = r"[0-9]{3}-(red|blue)"
SUM = r"[0-9]{1,3}[+-][0-9]{1,3}"
SUM_GRAMMAR = 'start: NUMBER OP NUMBER\nOP: "+" | "-"\nNUMBER: /[0-9]{1,3}/\n'


def test_both_runners_processors_mask_alike_through_vllms_own_interfaces(served, tiny,
                                                                        vllm_python):
    """vLLM's V2 loader refuses the V1 processor (why a GPU server would not start) and
    loads the V2 one; over 16 steps of requests joining, leaving, preempted and resumed,
    in a new row order each step, the V2 processor's masks equal the V1 one's on every
    request, and what they let through is what each spec says (Python's ``re`` for the
    regexes and the grammar, the forced tokens, the replayed prefix continued)."""
    table, as_json, signals = served
    path = pathlib.Path(os.environ[wire.VOCAB_ENV])
    ends = [*as_json["eos"], *signals]
    forced = tiny.encode(" forced text")
    replayed = tiny.encode("12")

    def request(name, spec, joins=0, max_tokens=10, **more):
        spec = None if spec is None else _spec(served, **spec)
        return {"name": name, "spec": spec, "joins": joins, "max_tokens": max_tokens,
                "prompt": tiny.encode(f"Request {name}:"), "ends": ends, **more}

    requests = [request("regex", {keys.REGEX: CODE}),
                request("grammar", {keys.GRAMMAR: SUM_GRAMMAR}),
                request("free", None, max_tokens=2),
                request("forced", {keys.FORCE: forced}, joins=1, max_tokens=len(forced)),
                request("resumed", {keys.REGEX: CODE, keys.REPLAY: replayed}, joins=1),
                request("preempted", {keys.REGEX: CODE}, preempted=3),
                request("chunked", {keys.GRAMMAR: SUM_GRAMMAR}, joins=2, chunked=True),
                request("healed", {keys.HEAL: b" th".hex()}, joins=3, max_tokens=3),
                request("late", {keys.REGEX: CODE}, joins=6),
                request("free again", None, joins=7, max_tokens=4)]
    scenario = {"vocab": table.size, "seed": 5, "steps": 16, "requests": requests,
                "builds": [[keys.REGEX, CODE], [keys.GRAMMAR, SUM_GRAMMAR]]}
    env = dict(os.environ, PYTHONPATH=str(PLUGIN_PACKAGE.parent), **{wire.VOCAB_ENV: str(path)})
    run = subprocess.run([str(vllm_python), str(RUNNERS)], input=json.dumps(scenario),
                         capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    assert "not a subclass" in got["loaders"]["v1_on_v2"]
    assert "seqstate spec refused" in got["loaders"]["malformed"]
    unequal = [(k, name) for k, step in enumerate(got["steps"])
               for name, (equal, _) in step.items() if not equal]
    assert not unequal, unequal
    stepped = {name: [allowed for step in got["steps"] if name in step
                      for _, allowed in [step[name]]] for name in got["outputs"]}
    assert all(len(allowed) >= 2 for allowed in stepped.values()), stepped
    assert got["reused"] >= 1                           # a slot another request had held
    assert set(stepped["free"]) == set(stepped["free again"]) == {table.size}   # no mask
    assert stepped["forced"] == [1] * len(forced)
    assert max(stepped["regex"]) < 50 and max(stepped["grammar"]) < 50
    outputs = got["outputs"]
    assert outputs["forced"] == forced
    assert not {t for out in outputs.values() for t in out} & set(signals)

    def text(name: str) -> str:
        """The request's output (which ended by EOS) as text."""
        *tokens, last = outputs[name]
        assert last in as_json["eos"], (name, outputs[name])
        return b"".join(table.tokens[t] for t in tokens).decode()
    for name in ("regex", "preempted", "late"):
        assert re.fullmatch(CODE, text(name)), (name, text(name))
    assert re.fullmatch(CODE, "12" + text("resumed")), text("resumed")
    for name in ("grammar", "chunked"):
        assert re.fullmatch(SUM, text(name)), (name, text(name))
    assert b"".join(table.tokens[t] for t in outputs["healed"]).startswith(b" th")


# -- on a server ---------------------------------------------------------------------------------
def _post(url: str, body: bytes, timeout: float = 60) -> tuple[int, dict]:
    """A raw client's request: (status, the answer's JSON or its text)."""
    request = urllib.request.Request(url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        return exc.code, {"text": exc.read().decode(errors="replace")}


def _raw(vllm, spec: dict | str) -> bytes:
    """A completion request carrying ``spec`` as the plugin's entry, as a raw client writes it."""
    entry = spec if isinstance(spec, str) else json.dumps(spec)
    return json.dumps({"model": vllm.backend.served, "prompt": [1, 2, 3], "max_tokens": 4,
                       "temperature": 0, "stop_token_ids": vllm.backend.signals,
                       "vllm_xargs": {wire.XARGS_KEY: entry}}).encode()


def _vllm_spec(vllm, **entries) -> dict:
    return {wire.VOCAB_KEY: vllm.backend.fingerprint, wire.SIGNALS: vllm.backend.signals, **entries}


@pytest.mark.parametrize("spec, why", [
    ("{", "not JSON"), ({"regexp": "a"}, "unknown keys"), ({keys.REPLAY: ["a"]}, "token id")])
def test_a_malformed_spec_is_refused_at_admission(vllm, vllm_server, spec, why):
    if isinstance(spec, dict):
        spec = {wire.VOCAB_KEY: vllm.backend.fingerprint, **spec}
    status, answer = _post(vllm_server.url, _raw(vllm, spec))
    assert status == 400 and "seqstate spec refused" in answer["text"] and why in answer["text"]
    parsed = spec if isinstance(spec, dict) else None
    if parsed is not None:
        parsed = {k: v for k, v in parsed.items() if k != wire.VOCAB_KEY}
        with pytest.raises(ss.ConstraintError, match=why):
            list(vllm.backend.complete(Completion([1, 2, 3], 2, ss.greedy(), spec=parsed)))


@pytest.mark.parametrize("spec, why", [
    ({keys.REGEX: "("}, "could not build"),
    ({keys.REGEX: "[0-9]+", keys.REPLAY: "x"}, "mid-way")])    # replaying a token it refuses
def test_a_constraint_that_fails_ends_its_request_with_a_constraint_error(vllm, spec, why):
    if keys.REPLAY in spec:
        spec = {**spec, keys.REPLAY: vllm.encode(spec[keys.REPLAY])[-1:]}
    with pytest.raises(ss.ConstraintError, match=why):
        list(vllm.backend.complete(Completion([1, 2, 3], 4, ss.greedy(), spec=spec)))


def test_a_request_sent_while_its_constraint_builds_is_sent_again(vllm, monkeypatch):
    """A regex that takes ~0.2 s to build: the first call's request ends pending and is
    sent again, the second call's is built; both give the same greedy tokens."""
    streams = []
    stream = vllm.backend.client.stream
    monkeypatch.setattr(vllm.backend.client, "stream",
                        lambda *args, **kw: streams.append(args) or stream(*args, **kw))
    generator = ss.regex(vllm, "[0-9]{2}(a|b)*a(a|b){6}")
    first = generator("Code: ", max_tokens=12)
    sent_first = len(streams)
    again = generator("Code: ", max_tokens=12)
    assert sent_first >= 2 and len(streams) == sent_first + 1, (sent_first, len(streams))
    assert again.token_ids == first.token_ids


def _program(model):
    digits, person = ss.regex(model, r"[0-9]{1,3}"), ss.json(model, PERSON)

    def program(name: str) -> str:
        s = ss.text(model)(f"One sentence about {name}:", max_tokens=10)
        s = digits(s + "\nTheir age: ", max_tokens=4)
        return str(person(s + "\nAs JSON: ", max_tokens=24))
    return program


PERSON = {"type": "object", "properties": {"name": {"type": "string"},
                                           "age": {"type": "integer"}},
          "required": ["name", "age"]}
NAMES = ["Ada", "Alan", "Grace", "Edsger", "Barbara", "Donald", "Frances", "Ken"]


def test_a_hostile_client_stalls_no_other_and_the_server_stays_healthy(vllm, vllm_server):
    """8 programs run alone, then beside a raw client sending a pathological regex (again
    while it is pending, as a client does), malformed specs and garbage: the same results,
    about the same time; the pathological regex ends by the bound signal, and a later
    request works."""
    program = _program(vllm)
    ss.run_batch(program, NAMES, concurrency=8)            # constraints built, caches warm
    started = time.monotonic()
    alone = ss.run_batch(program, NAMES, concurrency=8)
    alone_s = time.monotonic() - started
    stop, seen = threading.Event(), []
    hostile = [_raw(vllm, _vllm_spec(vllm, **{keys.REGEX: PATHOLOGICAL})),
               _raw(vllm, "{"), b"\x00garbage", _raw(vllm, _vllm_spec(vllm, **{keys.REGEX: 7}))]

    def attack(body: bytes) -> None:
        while not stop.is_set():
            status, answer = _post(vllm_server.url, body)
            choice = (answer.get("choices") or [{}])[0]
            seen.append((body is hostile[0], status, choice.get("stop_reason")))
            time.sleep(0.2)

    threads = [threading.Thread(target=attack, args=(b,), daemon=True) for b in hostile]
    for thread in threads:
        thread.start()
    started = time.monotonic()
    beside = ss.run_batch(program, NAMES, concurrency=8)
    beside_s = time.monotonic() - started
    bound = vllm.backend.signals[wire.SIGNAL_KINDS.index(wire.BOUND)]
    deadline = time.monotonic() + 60
    while (True, 200, bound) not in seen and time.monotonic() < deadline:
        time.sleep(0.5)
    stop.set()
    for thread in threads:
        thread.join()
    print(f"8 programs: {alone_s:.1f} s alone, {beside_s:.1f} s beside the hostile client")
    assert beside == alone
    assert beside_s < 2 * alone_s + 10, (alone_s, beside_s)
    assert (True, 200, bound) in seen                     # ended by the bound, not a stall
    assert all(400 <= s < 500 for hostile_one, s, _ in seen if not hostile_one)
    assert vllm_server.healthy() and program("Ada") == alone[0]
