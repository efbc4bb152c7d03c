"""Every runner a model can pick offers the `Runner` protocol's methods, signature for signature.

The scheduler (engines that step rows) and the request runner (servers) are written apart;
generators call whichever the model picked with the same arguments, so a parameter renamed,
added or defaulted differently in one of them would break calls on one engine only.  Every
class in the package that offers the protocol's methods is held to it, so a third runner
cannot drift either.
"""

from __future__ import annotations

import importlib
import inspect
import pathlib

import seqstate
from seqstate.engine.requests import RequestRunner
from seqstate.engine.runner import Runner
from seqstate.engine.scheduler import Scheduler

METHODS = sorted(name for name, member in vars(Runner).items()
                 if inspect.isfunction(member) and not name.startswith("_"))


def _runner_classes() -> set[type]:
    """Classes of the package that define every method of the protocol themselves."""
    root = pathlib.Path(seqstate.__file__).parent
    found = set()
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(root.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        module = importlib.import_module(".".join(parts))
        for cls in vars(module).values():
            if (inspect.isclass(cls) and cls is not Runner and cls.__module__ == module.__name__
                    and all(inspect.isfunction(vars(cls).get(m)) for m in METHODS)):
                found.add(cls)
    return found


def test_the_protocol_declares_the_six_methods():
    assert METHODS == ["beam", "generate", "next_logprobs", "run", "score", "stored"]


def test_the_walk_finds_both_runners():
    assert _runner_classes() >= {Scheduler, RequestRunner}


def test_every_runner_has_the_protocols_signatures():
    for cls in _runner_classes():
        for name in METHODS:
            want = inspect.signature(getattr(Runner, name))
            got = inspect.signature(getattr(cls, name))
            assert got == want, f"{cls.__name__}.{name}{got} differs from Runner.{name}{want}"


def test_a_models_runner_is_a_runner(tiny):
    assert isinstance(tiny.runner, Runner) and type(tiny.runner) is Scheduler
