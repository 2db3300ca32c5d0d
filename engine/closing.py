"""Constrained replies that close: bounded JSON numbers, and the closing path when the token budget runs out.

A grammar says what may come next, not when to stop; a small model given ``"population": 3121`` may add digits
(or string characters) until ``max_tokens`` and hand the client JSON that does not parse. Two layers prevent it:

1. **Bounded literals.** In a JSON grammar (a JSON schema, a forced tool call) a number has at most
   ``MAX_MANTISSA_DIGITS`` digits before its exponent (leading zeros count, so ``0.000...`` is bounded too) and at
   most ``MAX_EXPONENT_DIGITS`` exponent digits: a double's 17 significant digits and 3-digit exponent fit. The
   mask drops the tokens that would go past either bound. A schema whose own numbers need more (a ``const``,
   ``enum``, bound or ``multipleOf`` past them) is refused by name (server.structured).
2. **Closing within the budget.** Each step, a *closing path* is walked on the sequence's matcher: from its
   state, the grammar's forced tokens where there are any, else the first of a few closing tokens the grammar
   accepts (in a string ``"``; in a number ``}``, ``]``, ``,``; elsewhere ``}``, ``]``, a ``0``, ...), else the
   lowest allowed token, until the matcher accepts; then EOS. Its length D (EOS included) bounds the tokens the
   grammar needs to reach an accepting state (greedy, so an upper bound, never under). When the tokens left
   (``max_tokens`` minus the tokens generated; the server caps ``max_tokens`` at the context) come down to
   D + slack, the mask allows only the path's next token, so the reply closes and ends with EOS:
   finish_reason ``stop``. If even the path does not fit, nothing is forced and the reply ends ``length``.
   The slack is room for a sampled token that lengthens the path: at least ``CLOSING_SLACK``, and as much as
   one of the tokens that open something new (``OPENERS``: a comma that starts the next item or key, ``},``
   that ends an object and starts another, an opened array or object) would add, taken where the grammar allows
   it at any point along the path (``opener_slack``): in an array of objects one ``},`` adds a whole item's
   closing (a key, a value, braces: a dozen tokens), more than any fixed slack. The walk costs microseconds per path token
   (llguidance's forced-token and try-consume calls, then a rollback) and is capped at the tokens left. It is
   walked again after a quarter of the gap between the tokens left and the point of forcing (path + slack), at
   most ``RECHECK_EVERY`` tokens, and every step in the last few tokens before it. A walk that found no path
   within the tokens left is repeated on the same schedule: the path is a greedy one, an upper bound, and a
   later state (a string's pattern satisfied, an item closed) may have a much shorter one. Figures in
   BENCHMARKS.md, "closing within the budget".
"""

from __future__ import annotations

import re
from enum import IntEnum

import llguidance
import numpy as np

MAX_MANTISSA_DIGITS = 20   # digits of a JSON number before its exponent
MAX_EXPONENT_DIGITS = 3    # digits of its exponent
CLOSING_SLACK = 4          # tokens of room left when the closing path is forced (see the module docstring)
RECHECK_EVERY = 64         # most tokens between two walks (while the budget is far)
MAX_RUN = 4                # a closing token taken this often in a row inside a string is not taken again there


class Part(IntEnum):
    """Where the JSON text so far ends, lexically."""

    OUTSIDE = 0   # between values, or in text that is not JSON (a tool call's wrapper)
    STRING = 1
    ESCAPE = 2    # after a backslash in a string
    MANTISSA = 3  # in a number, before any exponent
    EXPONENT = 4  # in a number's exponent


# (part, mantissa digits, exponent digits) after the text so far
LexState = tuple[Part, int, int]
START: LexState = (Part.OUTSIDE, 0, 0)
_DIGITS = frozenset(b"0123456789")


def advance(state: LexState, data: bytes) -> LexState:
    """The lexical state after ``data`` (a token's bytes) follows ``state``. The grammar has already checked the
    text, so this only tracks strings and numbers; text outside JSON is ``OUTSIDE`` unless it holds a quote."""
    part, mantissa, exponent = state
    for byte in data:
        if part is Part.STRING:
            part = Part.ESCAPE if byte == 0x5C else Part.OUTSIDE if byte == 0x22 else part
            continue
        if part is Part.ESCAPE:
            part = Part.STRING
            continue
        if part is Part.MANTISSA:
            if byte in _DIGITS:
                mantissa += 1
                continue
            if byte == 0x2E:  # "."
                continue
            if byte in b"eE":
                part = Part.EXPONENT
                continue
        elif part is Part.EXPONENT:
            if byte in _DIGITS:
                exponent += 1
                continue
            if byte in b"+-" and exponent == 0:
                continue
        part = Part.OUTSIDE
        if byte == 0x22:
            part = Part.STRING
        elif byte in _DIGITS or byte == 0x2D:  # a number starts
            part, mantissa, exponent = Part.MANTISSA, int(byte in _DIGITS), 0
    return part, mantissa, exponent


# tokens after which the closing path may be much longer (a new item, key or container): the slack covers them
OPENERS = [",", "},", "],", ", ", " ,", '",', '", "', "[", "{", " [", " {", "[{", '{"', '["']
# the closing tokens tried, by where the text ends; in order of preference (a closing bracket before a comma)
_CANDIDATES = {Part.STRING: ['"', "a", "0", "@", ".", "-", ":", " "], Part.ESCAPE: ["n", '"', "u"],
               Part.MANTISSA: ["}", "]", ",", "1", ".", "0"], Part.EXPONENT: ["}", "]", ",", "0"],
               Part.OUTSIDE: ["}", "]", "0", '"', "null", ",", " 0", ' "', " null", " ", "[", "{"]}


class TokenTable:
    """What closing needs to know about every token of a vocabulary.

    Args:
        tokenizer: llguidance's tokenizer of the served model.
        vocab_size: tokens in the mask (``ceil(vocab_size / 32)`` words).
        eos_id: the token that ends a closed reply.
    """

    def __init__(self, tokenizer: llguidance.LLTokenizer, vocab_size: int, eos_id: int) -> None:
        self.eos_id = eos_id
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self.token_bytes = [tokenizer.decode_bytes([t]) for t in range(vocab_size)]
        # digits a token adds to a number's mantissa (its leading run of digits and points) or exponent
        self._mantissa_lead = np.array([_lead(b, rb"[0-9.]*") for b in self.token_bytes])  # [vocab]
        self._exponent_lead = np.array([_lead(b, rb"[+-]?[0-9]*") for b in self.token_bytes])  # [vocab]
        self._starts_point = np.array([b.startswith(b".") for b in self.token_bytes])  # [vocab]
        self._bans: dict[tuple[Part, int], np.ndarray | None] = {}
        self.candidates = {part: _single_tokens(tokenizer, texts) for part, texts in _CANDIDATES.items()}
        self.openers = _single_tokens(tokenizer, OPENERS)

    def digit_ban(self, state: LexState) -> np.ndarray | None:
        """``[words]`` uint32 bitmask of the tokens that would take a number past its bounds, or None."""
        part, mantissa, exponent = state
        if part is Part.MANTISSA:
            key = (part, MAX_MANTISSA_DIGITS - mantissa)
        elif part is Part.EXPONENT:
            key = (part, MAX_EXPONENT_DIGITS - exponent)
        else:
            return None
        if key not in self._bans:
            room = key[1]
            if part is Part.MANTISSA:  # at the bound a point would need another digit, so it goes too
                banned = (self._mantissa_lead > room) | (self._starts_point if room <= 0 else False)
            else:
                banned = self._exponent_lead > room
            self._bans[key] = _pack(banned, self.words) if banned.any() else None
        return self._bans[key]


def _single_tokens(tokenizer: llguidance.LLTokenizer, texts: list[str]) -> list[int]:
    """The tokens of those ``texts`` that are one token each, in order."""
    return [ids[0] for ids in (tokenizer.tokenize_str(t) for t in texts) if len(ids) == 1]


def _lead(data: bytes, pattern: bytes) -> int:
    return sum(byte in _DIGITS for byte in re.match(pattern, data).group())


def _pack(flags: np.ndarray, words: int) -> np.ndarray:
    """``[vocab]`` bool -> ``[words]`` uint32, bit j of word w = token 32 * w + j (llguidance's layout)."""
    packed = np.packbits(flags, bitorder="little")
    return np.pad(packed, (0, words * 4 - packed.size)).view("<u4").astype(np.uint32)


def only(token: int, words: int) -> np.ndarray:
    """``[words]`` uint32 bitmask allowing ``token`` alone."""
    mask = np.zeros(words, dtype=np.uint32)
    mask[token // 32] = np.uint32(1 << (token % 32))
    return mask


def closing_path(matcher: llguidance.LLMatcher, state: LexState | None, table: TokenTable,
                 limit: int) -> list[int] | None:
    """The tokens that close the reply from the matcher's state, EOS last, or None when more than ``limit`` are
    needed (or the walk finds no way on). The matcher is left as it was (the walk's tokens are rolled back).

    Args:
        matcher: the sequence's matcher, synced to its output.
        state: the lexical state of a JSON grammar's text, or None for other grammars (the candidates of
            ``OUTSIDE`` are tried).
        table: the vocabulary's closing facts.
        limit: the most tokens the path may have (the tokens left).
    """
    path: list[int] = []
    # a string whose format or pattern refuses the closing quote (an email, a date) takes any character the
    # grammar allows, but one repeated without end would never close: after MAX_RUN in a row it is left out
    run, left_out = 0, set()
    try:
        while len(path) < limit:
            if matcher.is_accepting():
                return path + [table.eos_id]
            if matcher.is_error():
                return None
            step = matcher.compute_ff_tokens()[:limit - 1 - len(path)]
            if not step:
                step = _one_closing_token(matcher, state, table, left_out)
                run = run + 1 if step and path and step[0] == path[-1] else 1
                if run >= MAX_RUN and state is not None and state[0] is Part.STRING:
                    left_out.add(step[0])
            taken = matcher.try_consume_tokens(step) if step else 0
            if taken == 0:
                return None
            for token in step[:taken]:
                path.append(token)
                if state is not None:
                    state = advance(state, table.token_bytes[token])
            if state is not None and state[0] is not Part.STRING:
                left_out.clear()
        return None
    finally:
        if path:
            matcher.rollback(len(path))


def opener_slack(matcher: llguidance.LLMatcher, state: LexState | None, table: TokenTable, path: list[int],
                 limit: int) -> int:
    """Tokens of room to keep beyond the closing ``path``: ``CLOSING_SLACK``, or more where, at some point along
    the path, one of ``table.openers`` the grammar allows there would lengthen it by more (the path's tokens up
    to that point, the opener, the path walked after it, less ``len(path)``; walks capped at ``limit`` tokens).
    Along the path, because the opener may come a token or two later: after ``"qty": 3`` in an array of
    objects, not before the number. The matcher is left as it was."""
    room, followed = CLOSING_SLACK, 0
    try:
        for i, step in enumerate(path):
            for token in table.openers:
                if matcher.validate_tokens([token]) != 1 or not matcher.try_consume_tokens([token]):
                    continue
                try:
                    after = closing_path(matcher, None if state is None else advance(state, table.token_bytes[token]),
                                         table, limit)
                finally:
                    matcher.rollback(1)
                if after is not None:
                    room = max(room, i + 1 + len(after) - len(path))
            if step == table.eos_id or not matcher.try_consume_tokens([step]):
                break
            followed += 1
            if state is not None:
                state = advance(state, table.token_bytes[step])
    finally:
        if followed:
            matcher.rollback(followed)
    return room


def _one_closing_token(matcher: llguidance.LLMatcher, state: LexState | None, table: TokenTable,
                       left_out: set[int]) -> list[int]:
    part = Part.OUTSIDE if state is None else state[0]
    for token in table.candidates[part]:
        if token not in left_out and matcher.validate_tokens([token]) == 1:
            return [token]
    words = np.frombuffer(matcher.compute_bitmask(), dtype="<u4").copy()  # [words], llguidance's layout
    for token in (table.eos_id, *left_out):
        words[token // 32] &= ~np.uint32(1 << (token % 32))
    nonzero = np.flatnonzero(words)
    if not nonzero.size:
        return []
    word = int(words[nonzero[0]])
    return [int(nonzero[0]) * 32 + (word & -word).bit_length() - 1]  # its lowest set bit
