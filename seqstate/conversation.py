"""Chat states: turns rendered by the tokenizer's own chat template, KV kept between turns.

A chat row remembers its closed turns (role, content) and, while the assistant is speaking,
where the open assistant turn's content begins.  A new turn renders the whole conversation
with ``apply_chat_template`` and appends only what the rendering adds after the row's text:
the row's tokens, KV, log-probs and captures stay, and only the new turn's tokens are
prefilled at the next call.  The assistant's content is whatever the row holds after the
opened turn (generated tokens, or text appended to it).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from seqstate.errors import ChatTemplateError
from seqstate.models.base import require_model
from seqstate.rows import Chat, Row, not_a_conversation
from seqstate.state import SequenceState

__all__ = ["Conversation", "chat", "add_turn", "add_reply"]

ROLES = ("system", "user", "assistant")


@dataclasses.dataclass(frozen=True, slots=True)
class Conversation(Chat):
    """The chat record of rows made by `chat()`: turns rendered by the tokenizer's template."""

    def turn(self, state: SequenceState, role: str,
             content: str | Sequence[str]) -> SequenceState:
        return add_turn(state, role, content)

    def reply(self, state: SequenceState, reply: Any, call: dict[str, Any]) -> SequenceState:
        return add_reply(state, reply, call)


def chat(model: Any) -> SequenceState:
    """An empty conversation on ``model``: continue it with ``.system()``, ``.user()`` and
    ``.assistant()``, which render turns with the tokenizer's own chat template.

    Examples
    --------
    >>> import seqstate as ss
    >>> model = ss.models.testing.tiny()
    >>> s = ss.chat(model).system("You are terse.").user("Name a fruit.")
    >>> s = s.assistant(ss.text(model), max_tokens=3, name="fruit")
    >>> s.shape, isinstance(s["fruit"], str)
    ((1, 1), True)
    """
    require_model(model, "ss.chat()")
    _render(model, [], False)              # a model without a template fails here, not later
    return SequenceState(model, (Row((), None, (), (), (), Conversation()),), 1, 1)


def _render(model: Any, messages: Sequence[tuple[str, str]], opened: bool) -> str:
    tok = model.hf_tokenizer
    if getattr(tok, "chat_template", None) is None:
        raise ChatTemplateError(f"{model.name!r}'s tokenizer has no chat template, so seqstate "
                                "cannot render turns; use an instruct/chat model, set "
                                "hf_tokenizer.chat_template, or build prompts as text")
    if not messages:
        if opened:
            raise ChatTemplateError("the assistant's turn needs a turn before it: add "
                                    ".system(...) or .user(...) first")
        return ""
    return tok.apply_chat_template([{"role": r, "content": c} for r, c in messages],
                                   tokenize=False, add_generation_prompt=opened)


def _texts(state: SequenceState, content: str | Sequence[str], what: str) -> list[str]:
    """One text per row: a str for all, or one per batch item / per row."""
    if isinstance(content, str):
        return [content] * len(state.rows)
    if isinstance(content, (list, tuple)) and content and all(isinstance(c, str) for c in content):
        return state._per_row_texts(content, f"{what} turns")
    raise ChatTemplateError(f"a {what} turn's content is a str or a list of str, got {content!r}")


def _chat_of(row: Row) -> Chat:
    if row.chat is None:
        raise not_a_conversation()
    return row.chat


def _append(model: Any, row: Row, pieces: list[tuple[str, str | None]], messages: tuple,
            opened: bool) -> Row:
    """Append the rendering's new text to ``row``: ``pieces`` are (text, role) chunks in
    order; each one with a role closes that turn (its end is recorded when the tokens of
    the text so far are a prefix of the whole delta's tokens)."""
    delta = "".join(text for text, _ in pieces)
    tokens = model.encode(delta)
    base = len(row.tokens)
    ends = list(row.chat.ends)
    upto = ""
    for text, role in pieces:
        upto += text
        if role is not None:
            part = model.encode(upto)
            ends.append(base + len(part) if tokens[:len(part)] == part else -1)
    chat = Conversation(messages, tuple(ends), base + len(tokens) if opened else None)
    return dataclasses.replace(row.extended(tokens), chat=chat)


def _grown(before: str, after: str, what: str) -> str:
    """The text a rendering adds after ``before``; an error when it rewrites ``before``."""
    if not after.startswith(before):
        raise ChatTemplateError(
            "the chat template renders this conversation differently once a new turn follows "
            "(it rewrites or trims earlier turns, or text was appended outside a turn), so "
            f"{what} cannot be appended to the state's tokens; rebuild the conversation with "
            "ss.chat(model) instead")
    return after[len(before):]


def _replied(row: Row) -> bool:
    """Whether the open assistant turn has a reply: tokens, a generator call (even one that
    made no token) or text given to ``.assistant()``."""
    chat = row.chat
    return (len(row.tokens) > chat.open_at or chat.answered
            or any(span.start >= chat.open_at for span in row.spans))


def _unopen(model: Any, row: Row) -> Row:
    """The row without the assistant turn that ``.user()`` opened and nobody answered: its
    generation prompt is taken back (KV kept), so ``.user(a).user(b)`` renders two user
    turns, as ``apply_chat_template`` does, not an empty assistant turn between them."""
    chat = row.chat
    closed = _render(model, chat.messages, False)
    k, rest = model.vocab.char_prefix_tokens(row.tokens, len(closed))
    extra = model.encode(rest) if rest else []
    kept = row.select(range(k), keep_kv=True).extended(extra)
    return dataclasses.replace(kept, chat=Conversation(chat.messages,
                                               chat.ends[:-1] + (k + len(extra),)))


def _turn(model: Any, row: Row, role: str, content: str) -> Row:
    if _chat_of(row).open_at is not None and not _replied(row):
        row = _unopen(model, row)
    chat = row.chat
    messages = chat.messages
    have = model.vocab.decode(row.tokens)
    pieces: list[tuple[str, str | None]] = []
    if chat.open_at is not None:               # close the assistant's turn first
        messages += (("assistant", model.vocab.decode(row.tokens[chat.open_at:])),)
        closed = _render(model, messages, False)
        pieces.append((_grown(have, closed, "the assistant's reply"), "assistant"))
        have = closed
    messages += ((role, content),)
    closed = _render(model, messages, False)
    pieces.append((_grown(have, closed, f"the {role} turn"), role))
    opened = role == "user"
    if opened:
        pieces.append((_grown(closed, _render(model, messages, True), "the assistant turn"), None))
    return _append(model, row, pieces, messages, opened)


def _open(model: Any, row: Row) -> Row:
    """The row with the assistant's turn opened (unchanged when it already is)."""
    chat = _chat_of(row)
    if chat.open_at is not None:
        return row
    have = model.vocab.decode(row.tokens)
    opened = _grown(have, _render(model, chat.messages, True), "the assistant turn")
    return _append(model, row, [(opened, None)], chat.messages, True)


def add_turn(state: SequenceState, role: str, content: str | Sequence[str]) -> SequenceState:
    """``state.system(...)`` / ``state.user(...)``: a new turn on every row.  A list gives
    one text per batch item: a one-item conversation branches into one batch item per text
    (each keeping its samples); a larger batch takes one text per batch item or per row."""
    if role not in ROLES:
        raise ChatTemplateError(f"role must be one of {ROLES}, got {role!r}")
    state = state._branched(content)
    texts = _texts(state, content, role)
    return state._with_rows([_turn(state.model, r, role, t) for r, t in zip(state.rows, texts)])


def _answered(row: Row) -> Row:
    return dataclasses.replace(row, chat=dataclasses.replace(row.chat, answered=True))


def add_reply(state: SequenceState, reply: Any, call: dict[str, Any]) -> SequenceState:
    """``state.assistant(reply, **call)``: open the assistant's turn on every row, then append
    ``reply`` (text) or call it (a generator) on the state."""
    opened = state._with_rows([_open(state.model, r) for r in state.rows])
    if isinstance(reply, (str, list, tuple)):
        if call:
            raise ChatTemplateError(f"keywords {sorted(call)} apply to a generator reply, not to "
                                    "text")
        texts = _texts(opened, reply, "assistant")
        return opened._with_rows([_answered(r.extended(state.model.encode(t)))
                                  for r, t in zip(opened.rows, texts)])
    if not callable(reply):
        raise ChatTemplateError(f"an assistant reply is text or a generator, got {reply!r}")
    return reply(opened, **call)
