"""Post-sampling hooks: look at each sampled token and accept, replace, resample or roll back.

A hook is any callable ``hook(event) -> action``; returning ``None`` accepts the token.  A
subclass of `Hook` also declares how far back it may roll back (``lookback``, read by streams)
and which constraints force its rollbacks (``forced_by``, checked before compute).  Every
resample or rollback counts against the call's ``max_backtracks``; a row that exceeds it finishes
with ``finish_reason="max_backtracks"``.  Rolling back crops the row's KV (the dropped positions
are masked, never recomputed by a prefill), its constraint cursor, log-probs and detokenizer.
"""

from __future__ import annotations

import dataclasses
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from functools import cached_property

import interegular
import torch

from seqstate.errors import CapabilityError, ConstraintError, HookError
from seqstate.finish import FinishReason

__all__ = ["SampleEvent", "Accept", "Replace", "Resample", "Rollback", "Action", "Hook",
           "as_hook", "ban_phrases", "checked", "run_hooks", "Hooked", "DEFAULT_MAX_BACKTRACKS",
           "TOP_TOKENS"]

DEFAULT_MAX_BACKTRACKS = 32      # resamples and rollbacks a row may take in one call
TOP_TOKENS = 5                   # alternatives `SampleEvent.top` lists


@dataclasses.dataclass(frozen=True, slots=True)
class Accept:
    """Keep the sampled token (the same as returning None)."""


@dataclasses.dataclass(frozen=True, slots=True)
class Replace:
    """Use ``token`` instead; it must satisfy the row's active constraint."""

    token: int


@dataclasses.dataclass(frozen=True, slots=True)
class Resample:
    """Sample again at this position with ``ban`` (default: the sampled token) excluded."""

    ban: tuple[int, ...] = ()


@dataclasses.dataclass(frozen=True, slots=True)
class Rollback:
    """Drop the sampled token and the last ``n`` accepted tokens of this call, then resample at
    the first dropped position with the token that stood there banned.

    ``Rollback(0)`` drops only the sampled token: the same as ``Resample()``.  A negative or
    non-int ``n`` is a `HookError`.
    """

    n: int

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 0:
            raise HookError(f"Rollback(n) takes an int n >= 0 (tokens to drop before the sampled "
                            f"one), got {self.n!r}")


Action = Accept | Replace | Resample | Rollback | None


class SampleEvent:
    """What a hook sees: one row's sampled token at one position.

    Attributes
    ----------
    row
        index of the row in the call (batch-major).
    position
        index the token would take in the row.
    token, logprob
        the sampled token and its log-prob under the model.
    logits
        the model's logits (V,) at this position (read-only: a view); None on an engine
        that sends log-probs of a few tokens only (``vllm``: `top` still works there).
    text
        this call's generated text before the token; ``token_text`` is the token's text.
    generated
        this call's accepted tokens so far; ``offsets[i]`` is where token i starts in text.
    prompt
        the row's text before this call (a phrase may begin there and end in ``text``).
    """

    __slots__ = ("row", "position", "token", "logprob", "logits", "text", "token_text",
                 "generated", "offsets", "_prompt", "__dict__")

    def __init__(self, *, row: int, position: int, token: int, logprob: float | None,
                 logits: torch.Tensor | None, text: str, token_text: str, generated: Sequence[int], offsets: Sequence[int],
                 prompt: Callable[[], str] | str = "",
                 top: Sequence[tuple[int, float]] | None = None) -> None:
        self.row, self.position, self.token, self.logprob = row, position, token, logprob
        self.logits, self.text, self.token_text = logits, text, token_text
        self.generated, self.offsets = generated, offsets
        self._prompt = prompt
        if top is not None:                         # sent by the engine (a server)
            self.__dict__["top"] = list(top)

    @cached_property
    def prompt(self) -> str:
        """The row's text before this call (decoded on first access)."""
        return self._prompt() if callable(self._prompt) else self._prompt

    @property
    def prob(self) -> float:
        return float(torch.tensor(self.logprob).exp())

    @cached_property
    def top(self) -> list[tuple[int, float]]:
        """The `TOP_TOKENS` most likely tokens and their probabilities (computed on first
        access; a server sends them with the token)."""
        if self.logits is None:
            raise CapabilityError("event.top needs the next-token distribution, and this event "
                                  "carries neither logits nor the engine's top tokens: read "
                                  "event.logprob instead", "full_logits")
        p = self.logits.float().softmax(-1)
        v, i = p.topk(TOP_TOKENS)
        return list(zip(i.tolist(), v.tolist()))


_ANALYSE_MAX_CHARS = 2000


class Hook(ABC):
    """A post-sampling hook that declares what streams and checks need to know of it.

    Any callable taking a `SampleEvent` is a hook; subclass this one to declare more.  A
    plain function gets the defaults, or the ``lookback`` it carries as an attribute.

    Attributes
    ----------
    lookback : int or None
        How many characters back the hook may roll back (None: anywhere in the call's
        text).  A stream holds back the text a hook may still roll back; ``0`` streams as
        usual.  Set it on the class or on an instance (``hook.lookback = 0``).
    """

    lookback: int | None = None

    @abstractmethod
    def __call__(self, event: SampleEvent) -> Action:
        """The action for ``event``'s sampled token (None accepts it)."""

    def forced_by(self, constraint_regex: str) -> bool:
        """True when every text matching ``constraint_regex`` makes the hook roll back: the
        call is refused before compute.  False when it cannot tell (the default)."""
        return False


class _FunctionHook(Hook):
    """A plain callable seen as a `Hook`, keeping the ``lookback`` a function may carry."""

    def __init__(self, function: Callable[[SampleEvent], Action]) -> None:
        self.function = function
        # the documented way to declare it on a plain function: ``fn.lookback = 0``
        self.lookback = getattr(function, "lookback", None)

    def __call__(self, event: SampleEvent) -> Action:
        return self.function(event)

    def __repr__(self) -> str:
        return repr(self.function)


def as_hook(hook: Callable[[SampleEvent], Action]) -> Hook:
    """``hook`` as a `Hook`: itself when it is one, else a plain callable with the defaults."""
    return hook if isinstance(hook, Hook) else _FunctionHook(hook)


def checked(hook: Hook, action: Action, row, token: int, allowed: Callable[[int], bool],
            max_backtracks: int) -> Replace | Resample | Rollback | None:
    """What ``hook``'s ``action`` on the sampled ``token`` asks of ``row``, checked the same
    way on every engine: None to go on (``None``, `Accept`, or the row finished because it
    exceeded ``max_backtracks``: ``row.done``), a `Replace` whose token ``allowed`` accepts,
    a `Rollback` of ``0 < n <= generated`` tokens, or a `Resample` naming the tokens to ban
    (the sampled one by default; ``Rollback(0)`` is such a resample).  A resample or rollback
    counts as a backtrack; a bad action raises `HookError`."""
    if action is None or isinstance(action, Accept):
        return None
    if isinstance(action, Replace):
        if not allowed(action.token):
            raise HookError(f"hook {hook!r} replaced token {token} with {action.token}, which "
                            "the active constraint (or a ban) does not allow here")
        return action
    if not isinstance(action, (Resample, Rollback)):
        raise HookError(f"hook {hook!r} returned {action!r}; expected None, Accept, Replace, "
                        "Resample or Rollback")
    row.backtracks += 1
    if row.backtracks > max_backtracks:
        row.finish(FinishReason.MAX_BACKTRACKS)
        return None
    if isinstance(action, Rollback):
        if action.n > len(row.generated):
            raise HookError(f"hook {hook!r} asked to roll back {action.n} tokens but this call "
                            f"has generated only {len(row.generated)}")
        if action.n > 0:
            return action
        action = Resample()                     # Rollback(0) drops just the sampled token
    return Resample(tuple(action.ban or (token,)))


@dataclasses.dataclass(frozen=True, slots=True)
class Hooked:
    """What a token's hooks left (`run_hooks`): the ``token`` to accept and its ``logprob``
    (``replaced``: a hook replaced the sampled one), unless the row finished, a rollback
    dropped ``rolled_back`` tokens, or ``send_again``: the position is sampled again
    elsewhere (after a rollback, or a resample on an engine that samples on a server)."""

    token: int
    logprob: float | None
    replaced: bool = False
    rolled_back: int = 0
    send_again: bool = False


def run_hooks(hooks: Sequence[Hook], row, i: int, token: int, logprob: float | None, *,
              logprob_of: Callable[[int], float | None], logits: torch.Tensor | None = None,
              top: Sequence[tuple[int, float]] | None = None, allowed: Callable[[int], bool],
              max_backtracks: int,
              sample_again: Callable[[list[int]], int | None] | None) -> Hooked:
    """Run ``hooks`` in order on row ``i``'s sampled ``token`` (its ``logprob``): the chain
    every engine runs.

    Each hook sees a `SampleEvent` (with ``logits`` or ``top``: what the engine has of the
    position's distribution); its action is `checked` (``allowed``: whether the row's
    constraint and bans allow a replacement).  A `Replace` hands its token on to the later
    hooks (its log-prob: ``logprob_of(token)``); a `Rollback` drops tokens
    (``row.rollback``) and ends the chain; a `Resample` records its bans at the row's
    position, then ``sample_again(banned)`` gives the next token, on which the chain starts
    again at the first hook, or None where nothing is left: the row finishes as a dead end.
    Without ``sample_again`` (a server samples) a resample ends the chain: ``send_again``."""
    k, replaced = 0, False
    while k < len(hooks):
        hook = hooks[k]
        event = SampleEvent(row=i, position=len(row.tokens), token=token, logprob=logprob,
                            logits=logits, text=row.text, token_text=row.vocab.decode([token]),
                            generated=row.generated, offsets=row.offsets,
                            prompt=lambda: row.prompt_text, top=top)
        action = checked(hook, hook(event), row, token, allowed, max_backtracks)
        if row.done:
            return Hooked(token, logprob)
        if action is None or isinstance(action, Replace):
            if action is not None:
                token, logprob, replaced = action.token, logprob_of(action.token), True
            k += 1
            continue
        if isinstance(action, Rollback):
            row.rollback(action.n)
            return Hooked(token, logprob, rolled_back=action.n, send_again=True)
        row.bans.setdefault(len(row.tokens), set()).update(action.ban)
        if sample_again is None:
            return Hooked(token, logprob, send_again=True)
        again = sample_again(list(action.ban))
        if again is None:
            row.finish(FinishReason.DEAD_END)
            return Hooked(token, logprob)
        k, token, logprob, replaced = 0, again, logprob_of(again), False
    return Hooked(token, logprob, replaced)


class _BanPhrases(Hook):
    """The hook behind `ban_phrases()`."""

    def __init__(self, pattern: re.Pattern, lookback: int, banned: str) -> None:
        self.pattern = pattern
        self.lookback = lookback
        self.banned = banned            # every banned text, as one regex interegular reads

    def forced_by(self, constraint_regex: str) -> bool:
        """True when every text matching ``constraint_regex`` contains a banned phrase.

        Decided by regex-automaton difference (interegular); False when it cannot tell
        (unsupported syntax, or a regex too large to analyse quickly).
        """
        if len(constraint_regex) > _ANALYSE_MAX_CHARS:
            return False
        flags = "(?i)" if self.pattern.flags & re.IGNORECASE else ""
        try:
            allowed = interegular.parse_pattern(constraint_regex).to_fsm()
            banned = interegular.parse_pattern(flags + self.banned).to_fsm()
            return (allowed - banned).empty()
        except Exception:                   # interegular does not support every construct
            return False

    def __call__(self, event: SampleEvent) -> Action:
        # the prompt's tail takes part: a phrase may begin there and complete here
        tail = event.prompt[-self.lookback:] if len(event.text) < self.lookback else ""
        before = len(tail) + len(event.text)
        text = tail + event.text + event.token_text
        m = self.pattern.search(text, max(0, before - self.lookback))
        if m is None or m.end() <= before:
            return None
        begin = m.start() - len(tail)
        if begin >= len(event.text) or not event.generated:
            return Resample((event.token,))
        # roll back to the accepted token that contains the start of the phrase
        first = max((i for i, off in enumerate(event.offsets) if off <= begin), default=0)
        return Rollback(len(event.generated) - first)


def ban_phrases(phrases: Sequence[str], *, regex: bool = False, ignore_case: bool = True,
                whole_words: bool = False, lookback: int = 200) -> Hook:
    r"""A hook that never lets the generated text contain any of ``phrases``.

    Matching runs across token boundaries: when a phrase completes, the row rolls back to the
    token where it started (KV and constraint state included) and resamples there with that
    token banned.  A regex, choice or JSON constraint that can only produce banned text is
    reported as a ``ConstraintError`` before generating.

    A phrase matches anywhere, inside words too: ``ban_phrases(["car"])`` also keeps out
    "scar" and "cart".  ``whole_words=True`` bans it only where no letter, digit or ``_``
    touches it on either side.

    Parameters
    ----------
    phrases : list of str
        The phrases (or, with ``regex=True``, regular expressions) to keep out of the text.
    regex : bool, default False
        Read ``phrases`` as regular expressions.
    ignore_case : bool, default True
        Match without regard to case.
    whole_words : bool, default False
        Match a phrase only where it is not part of a longer word (no word character,
        ``\w``, right before or after it).  Whether a word goes on is known only from the
        next character, so the row rolls back when that character comes (a sampled EOS
        counts as one).  A row that ends right after a phrase with no character to come keeps
        it: one cut by ``max_tokens``, or one whose constraint completes there while it
        allowed other text too (a choice of "car" or "scar" may write "car").  A constraint
        whose every text holds the word (``choice(model, ["car"])``) is refused up front.
    lookback : int, default 200
        For regular expressions: how far back (in characters) a match may start.  Plain
        phrases need no more than the longest phrase's length, which is what they use.

    Returns
    -------
    Hook
        The hook; its ``lookback`` tells streams how much text it may still roll back.

    Examples
    --------
    >>> import seqstate as ss
    >>> ss.hooks.ban_phrases(["tapestry", "delve"]).lookback  # longest phrase
    8
    >>> ss.hooks.ban_phrases([r"\bdelv\w*"], regex=True).lookback
    200
    >>> bool(ss.hooks.ban_phrases(["car"]).pattern.search("a scar"))
    True
    >>> words = ss.hooks.ban_phrases(["car"], whole_words=True)
    >>> [bool(words.pattern.search(t)) for t in ("a scar.", "a car.")]
    [False, True]
    """
    if isinstance(phrases, str) or not phrases or not all(isinstance(p, str) and p for p in phrases):
        raise ConstraintError(f"ban_phrases needs a non-empty list of non-empty strings, got {phrases!r}")
    body = "|".join(phrases if regex else sorted(map(re.escape, phrases), key=len, reverse=True))
    anything = "(.|\n)*"
    # up front, the start and the end of the text are word boundaries too
    banned = (f"({anything}\\W)?({body})(\\W{anything})?" if whole_words
              else f"{anything}({body}){anything}")
    if whole_words:
        # the character after the phrase is part of the match: it completes when that comes
        body = f"(?<!\\w)(?:{body})(?:\\W)"
    try:
        pattern = re.compile(body, re.IGNORECASE if ignore_case else 0)
    except re.error as exc:
        raise ConstraintError(f"invalid banned-phrase regex: {exc}") from exc
    return _BanPhrases(pattern, (lookback if regex else max(map(len, phrases))) + whole_words,
                       banned)
