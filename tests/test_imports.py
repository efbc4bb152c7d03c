"""The package's import graph: no circles, no upward imports, no module hidden by a name.

Every ``import`` counts, wherever it stands: at the top, inside a function, or under
``TYPE_CHECKING`` (a type-only import still ties the two modules together).
"""

import ast
import importlib
import pathlib

import pytest

import seqstate
from conftest import request_llamacpp
from seqstate.backends import registry

ROOT = pathlib.Path(seqstate.__file__).parent

# The modules of an engine's folder that build models (above the engine layer, beside
# `seqstate.models`); the rest of the folder is the backend.
ENGINE_MODEL_LAYER = ("model", "loader", "server", "serve", "gateway")
# Every engine folder's shape.
ENGINE_SHAPE = ("backend", "model", "loader")

# The layers, from the bottom: a module imports only modules of its own layer or below
# (docs/concepts/architecture.md: values -> generation -> engine -> backends -> radix tree,
# with the pluggable parts of a step and the protocols beside the tree, and the public
# surface on top).
LAYERS = [
    ("foundation", ["seqstate.errors", "seqstate.finish", "seqstate.radix",
                    "seqstate.detokenize", "seqstate.progress", "seqstate.indexing"]),
    ("protocols and step parts", ["seqstate.backends.base", "seqstate.backends.registry",
                                  "seqstate.constraints", "seqstate.sampling",
                                  "seqstate.hooks"]),
    ("backends", ["seqstate.backends"]),
    ("engine", ["seqstate.engine"]),
    ("models", ["seqstate.models", *[f"{e.package}.{m}" for e in registry.engines()
                                     for m in ENGINE_MODEL_LAYER]]),
    ("values", ["seqstate.rows", "seqstate.scores", "seqstate.accessors", "seqstate.viz",
                "seqstate.persist", "seqstate.state", "seqstate.activations"]),
    ("generation", ["seqstate.call", "seqstate.generation", "seqstate.conversation",
                    "seqstate.restore"]),
    ("public surface", ["seqstate", "seqstate.programs", "seqstate.checkpoint",
                        "seqstate.checkpoint_identity", "seqstate.demo",
                        "seqstate.__main__"]),
]

# Import edges allowed to close a cycle (none: a batch describes its backend by a protocol).
KNOWN_CYCLES: set[tuple[str, str]] = set()


def _modules() -> dict[str, tuple[pathlib.Path, bool]]:
    found = {}
    for path in ROOT.rglob("*.py"):
        parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
        package = parts[-1] == "__init__"
        if package:
            parts = parts[:-1]
        found[".".join(parts)] = (path, package)
    return found


MODULES = _modules()


def _owner(name: str) -> str | None:
    """The module ``name`` is, or the innermost module that defines it (a package's name)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def imports_in(source: str, module: str, package: bool = False) -> set[tuple[str, int]]:
    """(imported module, line) of every seqstate import in ``source`` (the text of
    ``module``), wherever it stands."""
    here = module if package else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {(_owner(a.name), node.lineno) for a in node.names
                      if a.name.split(".")[0] == "seqstate"}
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = here.split(".")[: len(here.split(".")) - node.level + 1]
                base = ".".join(parts + ([base] if base else []))
            if base.split(".")[0] != "seqstate":
                continue
            for alias in node.names:                   # `from pkg import submodule`
                full = f"{base}.{alias.name}"
                found.add((full if full in MODULES else _owner(base), node.lineno))
    return {(m, line) for m, line in found if m is not None and m != module}


def imports_of(module: str) -> set[tuple[str, int]]:
    path, package = MODULES[module]
    return imports_in(path.read_text(), module, package)


GRAPH = {m: imports_of(m) for m in MODULES}


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_the_walk_sees_every_kind_of_import():
    source = """
from typing import TYPE_CHECKING
import seqstate.hooks
from seqstate.sampling import params
from . import rows
if TYPE_CHECKING:
    from seqstate.state import SequenceState
def later():
    from seqstate.engine.step import Stepper
"""
    found = {m for m, _ in imports_in(source, "seqstate.generation.x")}
    assert found == {"seqstate.hooks", "seqstate.sampling.params", "seqstate.generation",
                     "seqstate.state", "seqstate.engine.step"}
    found = {m for m, _ in imports_in("from ..rows import Row", "seqstate.generation.x")}
    assert found == {"seqstate.rows"}


def test_no_import_cycles():
    edges = {m: {t for t, _ in found if (m, t) not in KNOWN_CYCLES}
             for m, found in GRAPH.items()}
    cycles = _cycles(edges)
    lines = []
    for comp in cycles:
        for m in comp:
            lines += [f"  {m}:{line} imports {t}" for t, line in sorted(GRAPH[m], key=str)
                      if t in comp]
    assert not cycles, "modules importing each other:\n" + "\n".join(lines)


def _layer(module: str) -> int:
    best = None
    for rank, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > len(best[1]):
                    best = (rank, prefix)
    assert best is not None, f"{module} is in no layer of LAYERS; add it"
    return best[0]


def test_every_module_is_in_a_layer():
    for m in MODULES:
        _layer(m)


def test_no_upward_imports():
    upward = [f"{m}:{line} ({LAYERS[_layer(m)][0]}) imports {t} ({LAYERS[_layer(t)][0]})"
              for m, found in sorted(GRAPH.items()) for t, line in sorted(found)
              if _layer(t) > _layer(m)]
    assert not upward, "imports of a higher layer:\n" + "\n".join(upward)


def test_state_does_not_import_the_chat_layer():
    assert {m for m, _ in GRAPH["seqstate.state"]} <= {
        "seqstate.errors", "seqstate.indexing", "seqstate.rows", "seqstate.scores",
        "seqstate.accessors", "seqstate.viz", "seqstate.activations", "seqstate.persist"}


def test_generation_is_a_package_of_small_modules():
    sizes = {p.name: len(p.read_text().splitlines())
             for p in (ROOT / "generation").glob("*.py")}
    assert "continuous.py" not in {p.name for p in ROOT.glob("*.py")}
    assert max(sizes.values()) <= 400, sizes


@pytest.mark.parametrize("name", sorted(m for m in MODULES if "." in m))
def test_no_module_is_hidden_by_a_name(name):
    """``import seqstate.x.y as m`` gives the module: no package binds ``y`` to something
    else (``ss.continuous`` the function once hid ``seqstate.continuous`` the module)."""
    try:
        module = importlib.import_module(name)
    except ModuleNotFoundError as exc:              # an optional engine's library
        if exc.name.split(".")[0] != "llama_cpp":
            raise
        request_llamacpp()          # skips, or fails loudly where make test requires it
        raise
    parent, _, leaf = name.rpartition(".")
    bound = getattr(importlib.import_module(parent), leaf, module)
    assert bound is module, f"{parent}.{leaf} is {bound!r}, not the module {name}"


def _bound_names(package: str) -> dict[str, str]:
    """Top-level names of ``package``'s ``__init__`` and what binds each (an import of
    something other than the submodule of that name, a def, a class or an assignment)."""
    path, _ = MODULES[package]
    bound = {}
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1]
                                + ([base] if base else []))
            for alias in node.names:
                name = alias.asname or alias.name
                if f"{base}.{alias.name}" != f"{package}.{name}":
                    bound[name] = f"from {base} import {alias.name}"
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            bound[node.name] = f"{type(node).__name__} {node.name}"
        elif isinstance(node, ast.Assign):
            bound.update({t.id: "an assignment" for t in node.targets
                          if isinstance(t, ast.Name)})
    return bound


def test_no_package_binds_the_name_of_its_own_submodule():
    """A package that exports a name its submodule also has loses one of the two: the
    module hides the export once anything imports it, or the export hides the module."""
    clashes = []
    for package, (_, is_package) in MODULES.items():
        if not is_package:
            continue
        submodules = {m.rpartition(".")[2] for m in MODULES if m.rpartition(".")[0] == package}
        clashes += [f"{package}.{name}: {how}, and the module {package}.{name}"
                    for name, how in _bound_names(package).items() if name in submodules]
    assert not clashes, "names that clash with submodules:\n" + "\n".join(clashes)


# Modules outside an engine's folder allowed to import from it, and why.
ENGINE_DOORS = {
    "seqstate.vllm": "the `python -m seqstate.vllm serve` entry point, the vLLM launcher's",
    "seqstate.vllm.__main__": "the same entry point",
    "seqstate.models.testing": "testing.tiny() is a random-weight model on the hf engine",
}


def _engine_of(module: str) -> str | None:
    for engine in registry.engines():
        if module == engine.package or module.startswith(engine.package + "."):
            return engine.name
    return None


def test_every_engine_is_one_registered_folder_of_one_shape():
    folders = {p.name for p in (ROOT / "backends").iterdir()
               if p.is_dir() and (p / "__init__.py").is_file()}
    registered = {e.package.rpartition(".")[2] for e in registry.engines()}
    assert folders == registered, f"engine folders {folders}, registered {registered}"
    for engine in registry.engines():
        missing = [m for m in ENGINE_SHAPE if f"{engine.package}.{m}" not in MODULES]
        assert not missing, f"the {engine.name} engine's folder lacks {missing}"


def test_engines_are_reached_through_the_registry_alone():
    """No module outside an engine's folder imports it (the registry imports it by name when
    a model of it is built), and no engine imports another."""
    crossing = [f"{m}:{line} imports {t}" for m, found in sorted(GRAPH.items())
                for t, line in sorted(found)
                if _engine_of(t) is not None and _engine_of(t) != _engine_of(m)
                and m not in ENGINE_DOORS]
    assert not crossing, "imports of an engine from outside its folder:\n" + "\n".join(crossing)


def test_each_engine_exports_its_loaders_and_one_model_class():
    import seqstate as ss

    names = set()
    for engine in registry.engines():
        source = MODULES[f"{engine.package}.loader"][0].read_text()
        defined = {n.name for n in ast.parse(source).body if isinstance(n, ast.FunctionDef)}
        assert set(engine.loaders) <= defined, (engine.name, engine.loaders, defined)
        tree = ast.parse(MODULES[f"{engine.package}.model"][0].read_text())
        models = [n.name for n in tree.body if isinstance(n, ast.ClassDef)
                  and any(getattr(b, "id", None) == "BaseModel" for b in n.bases)]
        assert len(models) == 1 and models[0].endswith("Model"), (engine.name, models)
        names.add(models[0])
        assert all(callable(getattr(ss.models, n)) for n in engine.loaders)
    assert len(names) == len(registry.engines())
    assert set(registry.loader_names()) <= set(ss.models.__all__)


MAX_MODULE_LINES = 450


def test_no_module_is_over_the_size_limit():
    sizes = {m: len(path.read_text().splitlines()) for m, (path, _) in MODULES.items()}
    large = {m: n for m, n in sizes.items() if n > MAX_MODULE_LINES}
    assert not large, f"modules over {MAX_MODULE_LINES} lines: {large}"
