"""The vLLM wire spec: seqstate's client and its server plugin name the same things alike.

The plugin (``plugins/seqstate-vllm``) runs in the server's environment and cannot import
seqstate, so it keeps its own copy of the request's keys, of the variable that names the
vocabulary table and of the table's fingerprint.  These tests read the plugin's modules from
the checkout (conftest's ``plugin``: no server, no vLLM) and fail where the two sides differ.
"""

from __future__ import annotations

import ast
import json
import types

import pytest

from seqstate.backends.vllm import wire
from seqstate.backends.vllm.server import PLUGINS, Server
from seqstate.backends.vllm.vocab import signal_tokens, vocabulary_table
from seqstate.constraints import spec
from seqstate.constraints.compile import cfg, regex
from seqstate.constraints.healing import HealingCursor

from conftest import PLUGIN_PACKAGE as PACKAGE

SPEC_NAMES = ("REGEX", "GRAMMAR", "HEAL", "REPLAY", "FORCE", "BAN", "ALLOW")


@pytest.fixture(scope="module")
def table(tiny):
    return vocabulary_table(tiny.vocab, tiny.eos_token_ids)


def test_request_keys_agree(plugin):
    theirs = plugin.module("wire")
    assert theirs.XARGS_KEY == wire.XARGS_KEY
    assert theirs.VOCAB_KEY == wire.VOCAB_KEY
    assert theirs.VOCAB_ENV == wire.VOCAB_ENV
    for name in SPEC_NAMES:
        assert getattr(theirs, name) == getattr(spec, name), name
    assert theirs.CONSTRAINTS == spec.CONSTRAINTS
    assert theirs.KEYS == spec.KEYS | {wire.VOCAB_KEY, wire.SIGNALS}
    assert theirs.SIGNALS == wire.SIGNALS and theirs.SIGNAL_KINDS == wire.SIGNAL_KINDS


def test_fingerprint_agrees(plugin, table):
    theirs = plugin.module("table")
    assert theirs.Table(table).fingerprint == wire.fingerprint(table)
    # canonical JSON both ways: key order, separators, non-ASCII text
    odd = {"z": "é\u2028", "a": [3, 1], "size": 0}
    assert plugin.module("wire").fingerprint(odd) == wire.fingerprint(odd)
    assert wire.fingerprint(dict(reversed(list(odd.items())))) == wire.fingerprint(odd)


def test_the_plugin_reads_the_request_the_client_builds(plugin, table):
    theirs = plugin.module("wire")
    xargs = wire.vllm_xargs(wire.fingerprint(table), {spec.REGEX: "(?:a)$", spec.REPLAY: [1]})
    sent = json.loads(xargs[theirs.XARGS_KEY])
    assert sent[theirs.VOCAB_KEY] == theirs.fingerprint(table)
    assert set(sent) <= theirs.KEYS


def test_the_server_names_the_table_to_the_plugin(plugin, tmp_path):
    theirs = plugin.module("wire")
    launched = types.SimpleNamespace(folder=tmp_path, api_key=None, runner_v2=False)
    assert Server.environment(launched)[theirs.VOCAB_ENV] == str(tmp_path / wire.VOCAB_FILE)


def test_constraints_send_keys_the_plugin_knows(plugin, tiny):
    theirs = plugin.module("wire")
    sent = [regex(tiny, "[0-9]+").remote(), regex(tiny, "[a-z]*").remote(),
            cfg(tiny, 'start: "yes" | "no"').remote(),
            HealingCursor(tiny.vocab, b" th").remote()]
    for one in sent:
        assert set(one) <= theirs.KEYS and sum(k in one for k in theirs.CONSTRAINTS) == 1, one
    assert theirs.REPLAY in sent[1]                          # the empty-matching regex's sentinel


def test_the_plugin_names_its_keys_once():
    """Outside its ``wire`` module the plugin spells no key as a literal string."""
    source = (PACKAGE / "wire.py").read_text()
    keys = {node.value.value for node in ast.parse(source).body
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)}
    assert {wire.XARGS_KEY, wire.VOCAB_KEY, spec.REGEX} <= keys
    for path in sorted(PACKAGE.glob("*.py")):
        if path.name == "wire.py":
            continue
        literals = {(node.value, node.lineno) for node in ast.walk(ast.parse(path.read_text()))
                    if isinstance(node, ast.Constant) and node.value in keys}
        assert not literals, f"{path.name} spells keys {sorted(literals)}; use seqstate_vllm.wire"


def test_the_entry_points_are_exported():
    """Each of ``server.PLUGINS`` (``module:attribute``, one per model runner) names a class
    the package's ``__init__`` imports, without importing vLLM here."""
    tree = ast.parse((PACKAGE / "__init__.py").read_text())
    bound = {alias.asname or alias.name for node in tree.body if isinstance(node, ast.ImportFrom)
             for alias in node.names}
    exported = next(ast.literal_eval(node.value) for node in tree.body
                    if isinstance(node, ast.Assign) and node.targets[0].id == "__all__")
    assert len(set(PLUGINS.values())) == 2
    for plugin in PLUGINS.values():
        module, _, name = plugin.partition(":")
        assert module == PACKAGE.name
        assert name in bound and name in exported


def test_signal_tokens_are_neither_eos_nor_bos_nor_any_constraints(table, tiny):
    """The four tokens a constrained request names as signals: distinct, not EOS or BOS,
    and no regex allows them (they spell no text); a vocabulary with too few special tokens
    takes the last ids instead."""
    signals = signal_tokens(table)
    assert len(set(signals)) == 4 and not set(signals) & {*table["eos"], table["bos"]}
    assert not regex(tiny, ".*").start().allowed()[signals].any()
    few = {**table, "special": table["eos"]}
    assert signal_tokens(few) == [table["size"] - k for k in range(1, 5)]
