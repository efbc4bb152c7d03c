"""MaskBench (development split): grammar engines judged by their token masks alone.

Each schema is compiled (TTFM: compile plus the first mask, wall time) and each test instance
is tokenized by the model's HF tokenizer (no BOS) and walked token by token: the mask is
computed (TBM: the time of that call alone), the token must be allowed by it, then the engine
advances; at the end the mask must allow EOS.  A valid instance must get through, an invalid
one must be refused somewhere.  A schema passes when it compiles and all its tests hold.

The data's README names two conventions: an engine writes object keys in an order of its own
(llguidance and seqstate: the schema's ``properties`` order), and whitespace is its choice.
So every instance is tried as it comes and reordered into the schema's order
(`schema_order`), each with compact separators and with ``", "`` / ``": "``: a valid instance
holds when any of these forms gets through, an invalid one when every form is refused.

Engines, side by side on each schema, one thread, the same tokenizer:

- seqstate: ``compile.json_schema(..., additional_properties=True)`` (JSON Schema's own
  semantics), its masks read through the decode step's path for a row (`allowed_masks`);
  a complete value is then checked by ``constraint.validate`` (the post-check), counted apart;
- llguidance, raw: the version seqstate imports, given the schema as it is with the options
  seqstate gives it (compact whitespace, ``coerce_one_of``) but none of seqstate's
  preparation; masks by ``unsafe_compute_mask_ptr`` into one buffer (its single-row path);
- XGrammar: ``compile_json_schema`` in its compliant mode (``strict_mode=False``, any
  whitespace), compiler on one thread and uncached, ``fill_next_token_bitmask``;
- outlines-core: ``build_regex_from_schema`` then ``Index``, ``Guide.write_mask_into``.

seqstate and llguidance run in this process (a schema over the time limit is interrupted by
an alarm where Python code runs); XGrammar and outlines-core, whose compilers can run for
minutes in native code, run in a forked child that is killed and forked again when a schema
passes the limit.  An engine's exception on a schema counts as its compile error.
"""

from __future__ import annotations

import collections
import contextlib
import gzip
import importlib.metadata
import itertools
import json
import multiprocessing
import os
import re
import resource
import signal
import tempfile
import time
import types
from pathlib import Path

import llguidance
import llguidance.hf
import numpy as np
import torch

from seqstate.constraints import compile as compiled
from seqstate.constraints.json_constraint import WHITESPACE
from seqstate.constraints.json_pointer import resolve
from seqstate.constraints.regex_constraint import byte_vocabulary
from seqstate.engine.masks import allowed_masks

DATA = Path(__file__).resolve().parents[2] / "shared/data/maskbench/dev.jsonl.gz"
SEPARATORS = ((",", ":"), (", ", ": "))
MEMORY = 6 << 30        # bytes a forked engine may add to its address space


# --- the instances' forms ---------------------------------------------------------------------

def _branches(node: object, root: object, seen: set[int]) -> list[dict]:
    """``node`` and the schemas it is combined with (``$ref``, ``allOf``, ``anyOf``, ``oneOf``),
    each once, in the order they appear."""
    if not isinstance(node, dict) or id(node) in seen:
        return []
    seen.add(id(node))
    out = [node]
    target = resolve(root, node.get("$ref")) if "$ref" in node else None
    if target is not None:
        out += _branches(target[1], root, seen)
    for key in ("allOf", "anyOf", "oneOf"):
        if isinstance(node.get(key), list):
            for sub in node[key]:
                out += _branches(sub, root, seen)
    return out


def _member(branches: list[dict], key: str) -> object:
    """The schema of an object's member ``key`` not listed in ``properties``."""
    for node in branches:
        for pattern, sub in (node.get("patternProperties") or {}).items():
            with contextlib.suppress(re.error, TypeError):
                if re.search(pattern, key):
                    return sub
        if isinstance(node.get("additionalProperties"), dict):
            return node["additionalProperties"]
    return {}


def _item(branches: list[dict], i: int) -> object:
    """The schema of an array's ``i``-th item."""
    for node in branches:
        prefix = node.get("prefixItems", node.get("items"))
        if isinstance(prefix, list):
            if i < len(prefix):
                return prefix[i]
            rest = node.get("items") if "prefixItems" in node else node.get("additionalItems")
            return rest if isinstance(rest, dict) else {}
        if isinstance(node.get("items"), dict):
            return node["items"]
    return {}


def schema_order(value: object, schema: object, root: object = None) -> object:
    """``value`` with each object's keys in its schema's ``properties`` order (those of the
    schemas combined with it after its own), the keys no schema lists after them as they came."""
    root = schema if root is None else root
    branches = _branches(schema, root, set())
    if isinstance(value, dict):
        listed: dict[str, object] = {}
        for node in branches:
            if isinstance(node.get("properties"), dict):
                for name, sub in node["properties"].items():
                    listed.setdefault(name, sub)
        keys = [k for k in listed if k in value] + [k for k in value if k not in listed]
        return {k: schema_order(value[k], listed[k] if k in listed else _member(branches, k),
                                root) for k in keys}
    if isinstance(value, list):
        return [schema_order(v, _item(branches, i), root) for i, v in enumerate(value)]
    return value


def forms(value: object, schema: object) -> list[str]:
    """The texts an instance is tried as: as it comes and in the schema's key order, each with
    compact and with spaced separators (duplicates once)."""
    out: list[str] = []
    for v in (value, schema_order(value, schema)):
        for separators in SEPARATORS:
            text = json.dumps(v, ensure_ascii=False, separators=separators)
            if text not in out:
                out.append(text)
    return out


def load(tokenizer, n: int | None = None) -> list[dict]:
    """The first ``n`` rows of the split (all when None); each row's ``cases`` are its tests
    as ``(valid, [(form, tokens), ...])``, tokenized by the HF ``tokenizer`` without BOS."""
    with gzip.open(DATA, "rt") as f:
        rows = [json.loads(line) for line in itertools.islice(f, n)]
    for row in rows:
        row["cases"] = [(t["valid"], [(text, tokenizer.encode(text, add_special_tokens=False))
                                      for text in forms(t["data"], row["schema"])])
                        for t in row["tests"]]
    return rows


# --- the engines ------------------------------------------------------------------------------

class _Bits:
    """A packed int32 bitmask buffer for one row, and the test of one token's bit."""

    def __init__(self, vocab_size: int) -> None:
        self.words = np.zeros((vocab_size + 31) // 32, dtype=np.int32)
        self.ptr, self.nbytes = self.words.ctypes.data, self.words.nbytes

    def allows(self, token: int) -> bool:
        return bool((int(self.words[token >> 5]) >> (token & 31)) & 1)


class Engine:
    """What `measure` drives: ``build(schema)`` a handle, ``start(handle)`` a row's state,
    ``mask(state)``, ``allows(mask, token)``, ``advance(state, token)`` (the state after it),
    and ``validate(handle, text)``, a post-check of a complete text (None: valid).  The
    engines below but seqstate fill a packed bitmask (`_Bits`) and have no post-check."""

    name = version = ""

    def compile(self, schema):
        """The schema's handle, its first mask computed (TTFM times this call)."""
        handle = self.build(schema)
        self.mask(self.start(handle))
        return handle

    @staticmethod
    def allows(mask, token: int) -> bool:
        return mask.allows(token)

    @staticmethod
    def validate(handle, text: str) -> str | None:
        return None


class Seqstate(Engine):
    """seqstate's JSON constraint, masks through the decode step's path for one row."""

    name = "seqstate"

    def __init__(self, model) -> None:
        self.model, self.vocab_size, self.cpu = model, model.vocab.size, torch.device("cpu")
        self.version = f"seqstate {importlib.metadata.version('seqstate')}"

    def build(self, schema):
        self.model.constraint_cache.clear()      # a schema seen before compiles again
        return compiled.json_schema(self.model, schema, additional_properties=True)

    @staticmethod
    def start(constraint):
        return types.SimpleNamespace(cursor=constraint.start(), bans={}, tokens=[])

    def mask(self, row):
        return allowed_masks([row], self.vocab_size, self.cpu)[0]

    @staticmethod
    def allows(mask, token: int) -> bool:
        return bool(mask[token])

    @staticmethod
    def advance(row, token: int):
        row.cursor = row.cursor.advance(token)
        return row

    @staticmethod
    def validate(constraint, text: str) -> str | None:
        return constraint.validate(text)


class LLGuidance(Engine):
    """Raw llguidance: the schema as it is, seqstate's options, its single-row mask path."""

    name = "llguidance"
    OPTIONS = {**WHITESPACE["compact"], "coerce_one_of": True}

    def __init__(self, model) -> None:
        self.tokenizer = llguidance.hf.from_tokenizer(model.hf_tokenizer, n_vocab=model.vocab.size)
        self.bits = _Bits(model.vocab.size)
        self.version = f"llguidance {importlib.metadata.version('llguidance')}"

    def build(self, schema):
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=self.OPTIONS)
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.get_error():
            raise ValueError(matcher.get_error())
        return matcher

    @staticmethod
    def start(matcher):
        return matcher.deep_copy()

    def mask(self, matcher):
        matcher.unsafe_compute_mask_ptr(self.bits.ptr, self.bits.nbytes)
        return self.bits

    @staticmethod
    def advance(matcher, token: int):
        if not matcher.consume_token(token):
            raise ValueError(f"token {token} not consumed: {matcher.get_error()}")
        return matcher


class XGrammar(Engine):
    """XGrammar in its compliant mode (JSON Schema's semantics, any whitespace), one thread."""

    name = "XGrammar"

    def __init__(self, model) -> None:
        import xgrammar
        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo.from_huggingface(
            model.hf_tokenizer, vocab_size=model.vocab.size,
            stop_token_ids=sorted(model.eos_token_ids))
        self.compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.buffer = xgrammar.allocate_token_bitmask(1, model.vocab.size)     # (1, W) int32
        self.bits = _Bits(model.vocab.size)
        self.bits.words = self.buffer[0].numpy()                                # shared memory
        self.version = f"xgrammar {importlib.metadata.version('xgrammar')}"

    def build(self, schema):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=True,
                                                 strict_mode=False)

    def start(self, grammar):
        return self.xgr.GrammarMatcher(grammar)

    def mask(self, matcher):
        matcher.fill_next_token_bitmask(self.buffer)
        return self.bits

    @staticmethod
    def advance(matcher, token: int):
        if not matcher.accept_token(token):
            raise ValueError(f"token {token} not accepted")
        return matcher


class OutlinesCore(Engine):
    """outlines-core: the schema's regex indexed over the vocabulary's exact token bytes."""

    name = "outlines-core"

    def __init__(self, model) -> None:
        import outlines_core
        from outlines_core.json_schema import build_regex_from_schema
        self.oc, self.regex_of = outlines_core, build_regex_from_schema
        self.vocabulary = byte_vocabulary(model)
        self.bits = _Bits(model.vocab.size)
        self.version = f"outlines-core {importlib.metadata.version('outlines-core')}"

    def build(self, schema):
        return self.oc.Index(self.regex_of(json.dumps(schema)), self.vocabulary)

    def start(self, index):
        return self.oc.Guide(index)

    def mask(self, guide):
        guide.write_mask_into(self.bits.ptr, self.bits.words.size, 4)
        return self.bits

    @staticmethod
    def advance(guide, token: int):
        guide.advance(token)
        return guide


# --- measuring --------------------------------------------------------------------------------

class SchemaTimeout(BaseException):
    """The schema's time limit passed (a BaseException: no engine's ``except`` swallows it)."""


def _alarm(signum, frame):
    raise SchemaTimeout


def walk(engine, handle, tokens: list[int], eos: int, times: list[float]) -> bool:
    """Whether the masks allow every token of ``tokens`` and then EOS; each mask timed."""
    state = engine.start(handle)
    for token in tokens:
        t0 = time.perf_counter()
        mask = engine.mask(state)
        times.append(time.perf_counter() - t0)
        if not engine.allows(mask, token):
            return False
        state = engine.advance(state, token)
    t0 = time.perf_counter()
    mask = engine.mask(state)
    times.append(time.perf_counter() - t0)
    return engine.allows(mask, eos)


def measure(engine, row: dict, eos: int) -> dict:
    """One schema on one engine: compile (TTFM), then every test's forms walked.

    ``valid_refused`` / ``invalid_accepted`` are by the masks; ``post_*`` by the masks and
    the engine's post-check; ``walk_errors`` counts forms whose walk raised (refused).
    """
    out = {"id": row["id"], "error": None, "ttfm": None, "masks": np.zeros(0), "walk_errors": 0,
           "valid_refused": [], "invalid_accepted": [], "post_valid_refused": [],
           "post_invalid_accepted": []}
    t0 = time.perf_counter()
    try:
        handle = engine.compile(row["schema"])
    except Exception as exc:  # noqa: BLE001 - any engine failure is its compile error
        out["error"] = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
        return out
    out["ttfm"] = time.perf_counter() - t0
    times: list[float] = []
    for i, (valid, cases) in enumerate(row["cases"]):
        masks_ok = post_ok = False
        for text, tokens in cases:
            try:
                through = walk(engine, handle, tokens, eos, times)
            except Exception:  # noqa: BLE001 - an engine raising on a token refuses the form
                out["walk_errors"] += 1
                through = False
            masks_ok |= through
            post_ok |= through and engine.validate(handle, text) is None
            if valid and post_ok:
                break
        if valid and not masks_ok:
            out["valid_refused"].append(i)
        if valid and not post_ok:
            out["post_valid_refused"].append(i)
        if not valid and masks_ok:
            out["invalid_accepted"].append(i)
        if not valid and post_ok:
            out["post_invalid_accepted"].append(i)
    out["masks"] = np.array(times)
    return out


def _timed_out(row: dict) -> dict:
    return {"id": row["id"], "timeout": True}


class InProcess:
    """An engine run here; a schema over ``limit`` seconds is stopped by SIGALRM."""

    def __init__(self, engine, limit: float) -> None:
        self.engine, self.limit = engine, limit

    def run(self, row: dict, eos: int) -> dict:
        previous = signal.signal(signal.SIGALRM, _alarm)
        signal.setitimer(signal.ITIMER_REAL, self.limit)
        try:
            return measure(self.engine, row, eos)
        except SchemaTimeout:
            return _timed_out(row)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, previous)

    def close(self) -> None:
        pass


def _serve(engine, conn, memory: int) -> None:
    """The child's loop; its address space may grow by ``memory`` bytes at most (an engine
    that needs more fails its schema rather than pushing the machine into swap).  Its stderr
    (XGrammar logs a warning per schema) goes to a file in the temporary folder."""
    log = Path(tempfile.gettempdir()) / f"maskbench-{engine.name}.log"
    with open(log, "a") as f:
        os.dup2(f.fileno(), 2)
    with open("/proc/self/status") as f:
        size = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    resource.setrlimit(resource.RLIMIT_AS, (size + memory, size + memory))
    while True:
        job = conn.recv()
        if job is None:
            return
        conn.send(measure(engine, *job))


class Forked:
    """An engine run in a forked child (built here first, so the child inherits it); a schema
    over ``limit`` seconds kills the child, and the next schema forks a new one."""

    def __init__(self, engine, limit: float) -> None:
        self.engine, self.limit = engine, limit
        self.name, self.version = engine.name, engine.version
        self.child = self.conn = None

    def run(self, row: dict, eos: int) -> dict:
        if self.child is None:
            context = multiprocessing.get_context("fork")
            self.conn, theirs = context.Pipe()
            self.child = context.Process(target=_serve, args=(self.engine, theirs, MEMORY),
                                         daemon=True)
            self.child.start()
            theirs.close()
        self.conn.send((row, eos))
        if self.conn.poll(self.limit):
            with contextlib.suppress(EOFError):
                return self.conn.recv()
            result = {"id": row["id"], "error": "the engine's process died (killed by the "
                      f"system?), exit code {self.child.exitcode}"}
        else:
            result = _timed_out(row)
        self.close()
        return result

    def close(self) -> None:
        if self.child is not None:
            self.child.kill()
            self.child.join()
            self.conn.close()
            self.child = self.conn = None


# --- the table --------------------------------------------------------------------------------

def _q(values: list[float], q: float) -> float:
    return values[min(len(values) - 1, int(q * len(values)))] if len(values) else float("nan")


def summary(results: list[dict], n_valid: int, n_invalid: int) -> dict[str, str]:
    """One engine's column of the table."""
    done = [r for r in results if not r.get("timeout") and r.get("error") is None]
    ttfm = sorted(r["ttfm"] for r in done)
    masks = np.sort(np.concatenate([r["masks"] for r in done] or [np.zeros(0)]))
    n = len(results)

    def count(key: str) -> int:
        return sum(len(r[key]) for r in done)

    def passing(*keys: str) -> str:
        k = sum(1 for r in done if not any(r[key] for key in keys))
        return f"{k} ({k / n:.1%})"

    return {
        "passing (masks)": passing("valid_refused", "invalid_accepted"),
        "passing (post-check too)": passing("post_valid_refused", "post_invalid_accepted"),
        "compile errors": str(sum(1 for r in results if r.get("error") is not None)),
        "timeouts": str(sum(1 for r in results if r.get("timeout"))),
        "valid refused (masks)": f"{count('valid_refused')} / {n_valid}",
        "valid refused (post-check too)": f"{count('post_valid_refused')} / {n_valid}",
        "invalid accepted (masks)": f"{count('invalid_accepted')} / {n_invalid}",
        "invalid accepted (post-check)": f"{count('post_invalid_accepted')} / {n_invalid}",
        "walks that raised": str(sum(r["walk_errors"] for r in done)),
        "TTFM p50 (ms)": f"{_q(ttfm, 0.5) * 1e3:.2f}",
        "TTFM p90 (ms)": f"{_q(ttfm, 0.9) * 1e3:.2f}",
        "TTFM p99 (ms)": f"{_q(ttfm, 0.99) * 1e3:.1f}",
        "TTFM max (ms)": f"{(ttfm[-1] if ttfm else float('nan')) * 1e3:.0f}",
        "TBM mean (us)": f"{(masks.mean() if len(masks) else float('nan')) * 1e6:.1f}",
        "TBM p50 (us)": f"{_q(masks, 0.5) * 1e6:.1f}",
        "TBM p99 (us)": f"{_q(masks, 0.99) * 1e6:.1f}",
        "masks": str(len(masks)),
    }


def table(columns: dict[str, dict[str, str]]) -> str:
    names = list(columns)
    width = [max(len(n), *(len(v) for v in columns[n].values())) + 2 for n in names]
    lines = ["".ljust(32) + "".join(n.rjust(w) for n, w in zip(names, width))]
    for label in next(iter(columns.values())):
        lines.append(label.ljust(32) + "".join(columns[n][label].rjust(w)
                                               for n, w in zip(names, width)))
    return "\n".join(lines)


def details(rows: list[dict], results: list[dict]) -> None:
    """seqstate's findings, for fixing: refused valid instances, compile errors, slow TTFM."""
    by_id = {row["id"]: row for row in rows}
    refused = [(r["id"], i) for r in results if "post_valid_refused" in r
               for i in r["post_valid_refused"]]
    print(f"\n  seqstate: valid instances refused ({len(refused)}; * = by the post-check only)")
    for rid, i in refused:
        only_post = i not in next(r for r in results if r["id"] == rid)["valid_refused"]
        text = by_id[rid]["cases"][i][1][0][0]
        print(f"    {'*' if only_post else ' '} {rid} test {i}: {text[:100]}")
    errors = collections.Counter(re.sub(r"#/\S*|'[^']*'|\"[^\"]*\"|\d+", "_", r["error"])[:150]
                                 for r in results if r.get("error"))
    print(f"\n  seqstate: compile errors ({sum(errors.values())}), by message")
    for message, k in errors.most_common():
        print(f"    x{k}: {message}")
    for r in results:
        if r.get("error"):
            print(f"      {r['id']}: {r['error'][:160]}")
    slow = sorted((r for r in results if r.get("ttfm") is not None), key=lambda r: -r["ttfm"])
    print("\n  seqstate: slowest TTFM")
    for r in slow[:10]:
        print(f"    {r['ttfm'] * 1e3:9.1f} ms  {r['id']}")
    for r in results:
        if r.get("timeout"):
            print(f"    timeout    {r['id']}")


def main(model, schemas: int | None = None, time_limit: float = 20.0,
         out: str | None = None) -> None:
    if not DATA.exists():
        print(f"\n== MaskBench: {DATA} is missing; suite skipped")
        return
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rows = load(model.hf_tokenizer, schemas)
    n_valid = sum(valid for row in rows for valid, _ in row["cases"])
    n_tests = sum(len(row["cases"]) for row in rows)
    eos = min(model.eos_token_ids)
    engines = {}
    for cls, runner in ((Seqstate, InProcess), (LLGuidance, InProcess), (XGrammar, Forked),
                        (OutlinesCore, Forked)):
        try:
            engine = cls(model)
            engine.compile({"type": "object", "properties": {"a": {"type": "integer"}}})
        except ImportError as exc:
            print(f"  {cls.__name__} unavailable ({exc}): pip install 'seqstate[bench]'")
            continue
        engines[engine.version] = runner(engine, time_limit)
    results: dict[str, list[dict]] = {name: [] for name in engines}
    t_start = time.time()
    try:
        for k, row in enumerate(rows):
            for name, runner in engines.items():
                results[name].append(runner.run(row, eos))
            if (k + 1) % 100 == 0:
                print(f"  {k + 1}/{len(rows)} schemas, {time.time() - t_start:.0f} s", flush=True)
    finally:
        for runner in engines.values():
            runner.close()
        torch.set_num_threads(threads)
    print(f"\n== MaskBench dev split: {len(rows)} schemas, {n_tests} tests ({n_valid} valid), "
          f"{model.name}'s tokenizer, one thread, {time_limit:g} s a schema per engine "
          f"(load {os.getloadavg()[0]:.1f})")
    print(table({name: summary(res, n_valid, n_tests - n_valid)
                 for name, res in results.items()}))
    seqstate = next(iter(results.values()))
    details(rows, seqstate)
    if out:
        with open(out, "w") as f:
            for name, res in results.items():
                for r in res:
                    masks = r.pop("masks", np.zeros(0))
                    f.write(json.dumps({"engine": name, **r, "n_masks": len(masks),
                                        "mask_s": float(masks.sum())}) + "\n")
        print(f"\n  per-schema results: {out}")
