"""The engines seqstate knows, registered once: every list of engines is read from here.

An engine is one folder under ``seqstate/backends/`` of one shape (``backend.py``: its
backend; ``model.py``: its model class; ``loader.py``: the public functions that build one,
and ``default()`` where the engine can run the default model), plus one `register` line
below.  Nothing here imports an engine: its folder is imported when a model of it is built,
so an engine whose library is missing (llama.cpp's, say) costs nothing until it is asked for.

Examples
--------
>>> from seqstate.backends import registry
>>> registry.names()
('hf', 'llama.cpp', 'vllm')
>>> registry.get("llama.cpp").package
'seqstate.backends.llamacpp'
>>> registry.loader_names()["vllm"]
'vllm'
"""

from __future__ import annotations

import dataclasses
import importlib
from types import ModuleType

from seqstate.errors import ArgumentError, ModelNotAvailable

__all__ = ["Engine", "register", "get", "names", "engines", "loader_names"]


@dataclasses.dataclass(frozen=True, slots=True)
class Engine:
    """One registered engine.

    Attributes
    ----------
    name
        the engine's name: ``model.engine``, ``backend.capabilities.name``, the ``engine=``
        argument of `seqstate.models.default` and of the lm-eval model.
    package
        its folder, as a module (``seqstate.backends.<folder>``).
    loaders
        the names of the public functions its ``loader`` module exports, which
        ``seqstate.models`` offers (``ss.models.llamacpp``, ...).
    library
        the importable name of the third-party library the engine needs (None: none beyond
        seqstate's own dependencies).
    install
        what to do where ``library`` is missing.
    """

    name: str
    package: str
    loaders: tuple[str, ...]
    library: str | None = None
    install: str = ""

    def loader(self) -> ModuleType:
        """The engine's ``loader`` module (`module`)."""
        return self.module("loader")

    def module(self, name: str) -> ModuleType:
        """One module of the engine's folder (``"loader"``, ``"backend"``, ...);
        `ModelNotAvailable` saying how to install the engine's library where it is missing."""
        try:
            return importlib.import_module(f"{self.package}.{name}")
        except ImportError as exc:
            missing = (exc.name or "").split(".")[0]
            if self.library is not None and missing == self.library:
                raise ModelNotAvailable(f"the {self.name} engine needs {self.library!r}, which "
                                        f"is not installed: {self.install}") from exc
            raise


_ENGINES: dict[str, Engine] = {}


def register(engine: Engine) -> None:
    """Add an engine (a name registered twice is a mistake, refused)."""
    if engine.name in _ENGINES:
        raise ArgumentError(f"an engine named {engine.name!r} is registered already")
    _ENGINES[engine.name] = engine


def get(name: str) -> Engine:
    """The engine called ``name``; `ArgumentError` naming the registered ones otherwise."""
    try:
        return _ENGINES[name]
    except (KeyError, TypeError):
        raise ArgumentError(f"engine must be one of {names()}, got {name!r}") from None


def names() -> tuple[str, ...]:
    """The registered engines' names, in registration order."""
    return tuple(_ENGINES)


def engines() -> tuple[Engine, ...]:
    """The registered engines, in registration order."""
    return tuple(_ENGINES.values())


def loader_names() -> dict[str, str]:
    """Each public loader function's name and the engine that exports it."""
    return {loader: e.name for e in _ENGINES.values() for loader in e.loaders}


register(Engine("hf", "seqstate.backends.hf", ("transformers", "from_hf", "from_outlines")))
register(Engine("llama.cpp", "seqstate.backends.llamacpp", ("llamacpp",), library="llama_cpp",
                install="`pip install \"seqstate[llama-cpp]\"` (it compiles llama.cpp: cmake and "
                        "a C++ compiler), or `make llamacpp` in a checkout"))
register(Engine("vllm", "seqstate.backends.vllm", ("vllm",)))
