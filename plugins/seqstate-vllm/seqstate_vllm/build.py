"""Constraints built off the engine's step loop, bounded in time and memory.

A request's regex or grammar is built on a worker thread while the engine keeps stepping
every other request.  A regex (outlines_core, whose build a pathological pattern makes
exponential) is built in a forked child process with an address-space limit, killed at the
time bound; the compiled index comes back pickled through a pipe.  A grammar (llguidance,
which builds its lexer lazily under its own limits) is built on the thread.  Builds are
cached per text, so a constraint that failed or went over a bound answers at once when it
comes again.

Bounds, read from the server's environment when it starts:

``SEQSTATE_VLLM_BUILD_SECONDS``
    seconds one build may take (default 10).
``SEQSTATE_VLLM_BUILD_MIB``
    memory one regex build may add to the server process (default 1024).
"""

from __future__ import annotations

import contextlib
import dataclasses
import faulthandler
import logging
import os
import pickle
import resource
import select
import signal
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from seqstate_vllm.table import table
from seqstate_vllm.wire import BOUND, FAILED, REGEX

__all__ = ["Built", "Builder", "SECONDS_ENV", "MIB_ENV"]

SECONDS_ENV = "SEQSTATE_VLLM_BUILD_SECONDS"
MIB_ENV = "SEQSTATE_VLLM_BUILD_MIB"
_WORKERS = 8             # builds at once: a slow one holds a thread, never the step loop
_KEPT = 256              # finished builds kept (their compiled constraints and failures)

log = logging.getLogger("seqstate_vllm")


@dataclasses.dataclass(frozen=True)
class Built:
    """A finished build: the compiled constraint, or the signal kind (`FAILED`, `BOUND`)
    and the reason it has none."""

    compiled: Any = None
    failure: str | None = None
    reason: str = ""


class Builder:
    """Builds constraints on worker threads; one per logits processor."""

    def __init__(self) -> None:
        self.seconds = float(os.environ.get(SECONDS_ENV, 10))
        self.memory = int(float(os.environ.get(MIB_ENV, 1024)) * 2**20)
        self.pool = ThreadPoolExecutor(_WORKERS, thread_name_prefix="seqstate-build")
        self.builds: OrderedDict[tuple[str, str], Future] = OrderedDict()

    def build(self, kind: str, text: str) -> Future:
        """The build of the ``kind`` (`REGEX` or `GRAMMAR`) constraint ``text``: a future
        whose result is a `Built`; started at its first request."""
        key = (kind, text)
        future = self.builds.get(key)
        if future is None:
            work = _regex if kind == REGEX else _grammar
            future = self.builds[key] = self.pool.submit(self._timed, work, text)
            done = [k for k, f in self.builds.items() if f.done()]
            for old in done[: max(0, len(self.builds) - _KEPT)]:
                del self.builds[old]
        self.builds.move_to_end(key)
        return future

    def _timed(self, work, text: str) -> Built:
        start = time.monotonic()
        try:
            built = work(text, self.seconds, self.memory)
        except Exception as exc:            # the build's own failure is the request's answer
            built = Built(failure=FAILED, reason=f"{type(exc).__name__}: {exc}")
        if built.failure is not None:
            log.warning("seqstate constraint not built (%s, %.1f s): %s", built.failure,
                        time.monotonic() - start, built.reason[:500])
        return built


def _regex(pattern: str, seconds: float, memory: int) -> Built:
    vocabulary = table().regex_vocabulary        # built here once, so children inherit it
    receive, send = os.pipe()
    pid = os.fork()           # not multiprocessing: vLLM's engine is a daemonic process
    if pid == 0:
        os.close(receive)
        _child(pattern, vocabulary, memory, send)
    os.close(send)
    deadline = time.monotonic() + seconds
    chunks: list[bytes] = []
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([receive], [], [], left)[0]:
                return Built(failure=BOUND, reason=f"the regex took over {seconds:g} s to build")
            chunk = os.read(receive, 1 << 20)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(receive)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    if not chunks:                               # the child died: its memory ran out
        return Built(failure=BOUND, reason=f"the regex needed over {memory >> 20} MiB")
    kind, payload = pickle.loads(b"".join(chunks))
    if kind is not None:
        return Built(failure=kind, reason=payload)
    return Built(compiled=(pickle.loads(payload), OrderedDict()))


def _child(pattern: str, vocabulary, memory: int, send: int) -> None:
    """In the forked child: build, write the pickled index (or why not), exit at once."""
    faulthandler.disable()                        # running out of memory here is expected
    # other builds' pipes (forked from other threads) closed here, so each sees its own end
    os.closerange(3, send)
    os.closerange(send + 1, os.sysconf("SC_OPEN_MAX"))
    try:
        from outlines_core import Index

        os.nice(10)                               # the engine's threads come first
        with open("/proc/self/statm") as f:
            size = int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")
        resource.setrlimit(resource.RLIMIT_AS, (size + memory, size + memory))
        answer = (None, pickle.dumps(Index(pattern, vocabulary)))
    except MemoryError:
        answer = (BOUND, f"the regex needed over {memory >> 20} MiB")
    except BaseException as exc:
        answer = (FAILED, f"{type(exc).__name__}: {exc}")
    try:
        with os.fdopen(send, "wb") as out:
            out.write(pickle.dumps(answer))
    finally:
        os._exit(0)


def _grammar(grammar: str, seconds: float, memory: int) -> Built:
    import llguidance

    matcher = llguidance.LLMatcher(table().grammar_tokenizer, grammar, log_level=0)
    if matcher.is_error():
        return Built(failure=FAILED, reason=matcher.get_error())
    return Built(compiled=matcher)

