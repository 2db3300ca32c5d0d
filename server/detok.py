"""Token ids to text deltas: incremental detokenization and stop strings.

Both streamed and non-streamed responses are built from the same deltas, so they agree by construction;
the tests also compare with ``tokenizer.decode`` of all the output ids.
"""

from __future__ import annotations

import functools
import os
import re

from transformers import PreTrainedTokenizerBase
from transformers.convert_slow_tokenizer import bytes_to_unicode

_CONTEXT_TOKENS = 5  # prompt tokens decoded alongside the output so a first word keeps its leading space
_INCOMPLETE = "\ufffd"
_MAX_CHAR_TOKENS = 3  # a UTF-8 character has at most 4 bytes: at most 3 of its tokens can end a text unfinished


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")  # SentencePiece's byte fallback: one byte a piece
_SPACE = "\u2581"  # SentencePiece's word boundary, a space in the text


@functools.cache
def _byte_of() -> dict[str, int]:
    """Byte-level BPE (GPT-2, Llama 3, SmolLM2) spells each byte as one printable character; this inverts it."""
    return {char: byte for byte, char in bytes_to_unicode().items()}


@functools.lru_cache(maxsize=8)
def _sentencepiece(tokenizer) -> frozenset[int] | None:
    """Where ``tokenizer`` spells bytes SentencePiece's way (``<0xF0>`` pieces, Llama 2 and Mistral) rather than
    byte-level BPE's: its special tokens' ids (their pieces are not text with spaces); else None."""
    try:
        return frozenset(tokenizer.all_special_ids) if "<0x00>" in tokenizer.get_vocab() else None
    except (AttributeError, NotImplementedError):
        return None


def token_bytes(tokenizer, token_id: int) -> bytes:
    """The raw bytes of one token, also when it holds only part of a UTF-8 character: a byte-level BPE piece
    mapped back to its bytes, a SentencePiece byte piece (``<0xF0>``) its byte and a word piece with its
    boundary as a space; otherwise (a special or added token) its decoded text."""
    own = _own_bytes(tokenizer, token_id)
    return own if own is not None else tokenizer.decode([token_id]).encode()


def _own_bytes(tokenizer, token_id: int) -> bytes | None:
    """``token_bytes`` where they are the token's own (a byte-level or SentencePiece piece), None where only its
    decoded text is at hand (a special or added token)."""
    piece = tokenizer.convert_ids_to_tokens(token_id)
    special = _sentencepiece(tokenizer) if piece else None
    if special is not None:
        byte = _BYTE_PIECE.fullmatch(piece)
        if byte is not None:
            return bytes([int(byte.group(1), 16)])
        if token_id not in special:
            return piece.replace(_SPACE, " ").encode()
    byte_of = _byte_of()
    if piece and all(char in byte_of for char in piece):
        return bytes(byte_of[char] for char in piece)
    return None


def _bytes_unfinished(data: bytes) -> bool:
    """Whether ``data`` ends inside a UTF-8 character: a lead byte followed by fewer continuation bytes than it
    announces (at most 3 bytes of a 4-byte character). A stray continuation byte or an invalid lead is not
    unfinished: no later byte makes it a character (it decodes to U+FFFD whatever follows)."""
    for back in range(1, min(3, len(data)) + 1):
        byte = data[-back]
        if 0x80 <= byte < 0xC0:
            continue
        need = 2 if 0xC2 <= byte <= 0xDF else 3 if 0xE0 <= byte <= 0xEF else 4 if 0xF0 <= byte <= 0xF4 else 1
        return need > back
    return False


@functools.lru_cache(maxsize=8)
def _special_ids(tokenizer) -> frozenset[int]:
    return frozenset(tokenizer.all_special_ids)


def ends_unfinished(tokenizer, ids: list[int], skip_special_tokens: bool = False) -> bool:
    """Whether ``ids``' text ends inside a character whose last bytes a later token would bring: read on the
    tokens' bytes (``token_bytes``), so a literal U+FFFD character, or an invalid byte that nothing completes, is
    text like any other. Special tokens count as their text, or as nothing where ``skip_special_tokens`` (as a
    reply's decode leaves them out). A token known only by its decode (an added token) that holds U+FFFD: its
    bytes are unknown, and the decode ending in U+FFFD decides, as for every token before."""
    data, specials = b"", _special_ids(tokenizer)
    for token in reversed(ids):
        if skip_special_tokens and token in specials:
            continue
        piece = _known_bytes(tokenizer, token)
        if piece is None:
            return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens).endswith(_INCOMPLETE)
        data = piece + data
        if len(data) >= 3 or (data and data[-1] < 0x80):  # an ASCII last byte ends a character
            break
    return _bytes_unfinished(data)


@functools.lru_cache(maxsize=1 << 16)  # a step's tokens, every step: the lookup is most of ends_unfinished's time
def _known_bytes(tokenizer, token_id: int) -> bytes | None:
    """``token_bytes``, or None where they are only its decode and that holds U+FFFD (its own bytes unknown)."""
    own = _own_bytes(tokenizer, token_id)
    if own is not None:
        return own
    text = tokenizer.decode([token_id]).encode()
    return None if _INCOMPLETE.encode() in text else text


def complete_prefix(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> int:
    """How many of ``ids``, from the start, decode to text that ends on a whole character: ``len(ids)`` unless
    the last tokens hold the first bytes of a character that a later token would complete (``ends_unfinished``;
    a literal U+FFFD at the end is a whole character)."""
    for cut in range(min(_MAX_CHAR_TOKENS, len(ids)) + 1):
        if not ends_unfinished(tokenizer, ids[:len(ids) - cut]):
            return len(ids) - cut
    return len(ids)


def whole_text(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> str:
    """The text of ``ids``' whole characters: their decode, less a character their last tokens only begin (its
    U+FFFD). A last token that holds whole characters before such a character's first bytes (``" \xf0\x9f"``: a
    space, then an emoji's first two bytes) keeps them: they are the prompt's, and an output that completes the
    character starts with the character itself (``IncrementalDetokenizer``)."""
    cut = complete_prefix(tokenizer, ids)
    whole = tokenizer.decode(ids[:cut])
    if cut == len(ids):
        return whole
    text = tokenizer.decode(ids)
    return whole + text[len(whole):].rstrip(_INCOMPLETE) if text.startswith(whole) else whole


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas, holding back incomplete UTF-8 characters.

    Method: decode a small window before and after the newest token and emit only the new suffix once the
    tokens' bytes no longer end inside a character (``ends_unfinished``; vLLM's ``detokenize_incrementally``, after
    TGI, reads a trailing U+FFFD instead, which also holds back a literal U+FFFD). A byte-level BPE token can
    hold part of a multi-byte character (an emoji is often split over 2-4 tokens); SentencePiece drops a
    word's leading space when a token is decoded alone, hence the prompt context.

    A prompt whose last tokens hold the first bytes of a character (token ids cut inside an emoji) leaves them to
    the output: the completed character is the start of the first text returned; if the output does not
    complete it, those bytes are dropped (never sent as U+FFFD). Whole characters in those tokens before the
    unfinished one (a space) stay the prompt's. So the prompt's whole characters (``whole_text``) and the
    returned text join to the decode of prompt and output together.

    Several tokens can release their text at once (the first bytes of a character release nothing until a later
    token ends the text on a whole character; an invalid byte, which nothing completes, releases its U+FFFD at
    once, as the decode of all the tokens has it); ``starts`` then says where each one's text begins in
    what was released: where the decode of the tokens before it stops agreeing with the decode of them all
    (the tokenizer's own decoding, so an invalid byte's U+FFFD, a SentencePiece byte's, a dropped space count as
    they do in the text).

    Args:
        tokenizer: the model's tokenizer.
        prompt_ids: the prompt (its last tokens give context).
        skip_special_tokens: leave special tokens' text out (a reply's text), or keep it (an echoed prompt's).

    Attributes:
        starts: after ``add`` or ``flush`` released text: for each token added since the text before it was
            released (the last ones added), the character in the released text where its text starts.
    """

    def __init__(self, tokenizer: PreTrainedTokenizerBase, prompt_ids: list[int],
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.starts: list[int] = []
        self.ids: list[int] = list(prompt_ids[-_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = complete_prefix(tokenizer, self.ids)
        # the prompt's unfinished tail (the tokens after read_offset) as the first text will hold it: `lead`
        # whole characters of the prompt's own (dropped: whole_text has them), then `dangling` characters (its
        # U+FFFD) that the output completes or that are dropped; both 0 where the prompt ends whole
        self.lead = self.dangling = 0
        if self.read_offset < len(self.ids):
            whole, text = self._decode(self.ids[:self.read_offset]), self._decode(self.ids)
            tail = text[len(whole):] if text.startswith(whole) else self._decode(self.ids[self.read_offset:])
            self.lead = len(tail.rstrip(_INCOMPLETE)) if text.startswith(whole) else 0
            self.dangling = len(tail) - self.lead

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def add(self, token_id: int) -> str:
        """Add one token; return the text it completes (possibly empty)."""
        self.ids.append(token_id)
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:])
        # an unfinished character decodes to a trailing U+FFFD: only then are the bytes read (a literal one too)
        if len(new_text) <= len(prefix_text) or (new_text.endswith(_INCOMPLETE) and ends_unfinished(
                self.tokenizer, self.ids, self.skip_special_tokens)):
            return ""
        return self._release(prefix_text, new_text)

    def _release(self, prefix_text: str, new_text: str) -> str:
        """The text of the tokens after ``read_offset`` (``new_text`` past ``prefix_text``), each token's start
        in it into ``starts``; the window moves past them."""
        released = len(new_text) - len(prefix_text)
        starts, floor = [0], 0
        for end in range(self.read_offset + 1, len(self.ids)):  # one decode a token only where several release
            before = self._decode(self.ids[self.prefix_offset:end])
            agreed = len(os.path.commonprefix([before, new_text])) - len(prefix_text)
            floor = min(max(agreed, floor), released)
            starts.append(floor)
        self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        text = self._first(new_text[len(prefix_text):])
        cut = released - len(text)  # a prompt's unfinished character's U+FFFD, dropped from the front
        self.starts = [max(start - cut, 0) for start in starts]
        return text

    def _first(self, text: str) -> str:
        """The first text after a prompt that ended inside a character: without the prompt's whole characters
        before it, and without that character's U+FFFD when the output did not complete it."""
        if self.dangling and text:
            text = text[self.lead:]
            head, text, self.lead, self.dangling = text[:self.dangling], text[self.dangling:], 0, 0
            return head.replace(_INCOMPLETE, "") + text
        return text

    def flush(self) -> str:
        """Text still held at the end, without a trailing incomplete character (never sent as U+FFFD)."""
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:])
        if new_text.endswith(_INCOMPLETE) and ends_unfinished(self.tokenizer, self.ids, self.skip_special_tokens):
            new_text = new_text.rstrip(_INCOMPLETE)
        if len(new_text) <= len(prefix_text):
            self.prefix_offset = self.read_offset = len(self.ids)
            return ""
        return self._release(prefix_text, new_text)


def text_offsets(tokenizer: PreTrainedTokenizerBase, ids: list[int]) -> list[int]:
    """Where each of ``ids``' texts starts in the decode of them all, special tokens' text kept (an echoed
    prompt's ``text_offset``): a token holding part of a character starts where that character starts, as a
    reply's tokens do (``IncrementalDetokenizer.starts``); tokens whose text never completes start at the end."""
    detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    offsets: list[int] = []
    done = 0
    for position, token in enumerate(ids):
        text = detok.add(token)
        if text:
            offsets += [done + start for start in detok.starts[-(position + 1 - len(offsets)):]]
            done += len(text)
    text = detok.flush()
    if text:
        offsets += [done + start for start in detok.starts[-(len(ids) - len(offsets)):]]
    return offsets + [done + len(text)] * (len(ids) - len(offsets))


class _StopString:
    """One stop string's state over the text fed so far: the length of the longest suffix of the text that
    begins it (Knuth-Morris-Pratt: ``border[i]`` is the longest proper prefix of ``stop[:i + 1]`` that is also a
    suffix of it), so each character fed costs O(1) amortized however long the stop string and the held text."""

    __slots__ = ("stop", "border", "state")

    def __init__(self, stop: str) -> None:
        self.stop, self.state = stop, 0
        self.border = [0] * len(stop)
        k = 0
        for i in range(1, len(stop)):
            while k and stop[i] != stop[k]:
                k = self.border[k - 1]
            if stop[i] == stop[k]:
                k += 1
            self.border[i] = k

    def step(self, char: str) -> bool:
        """Feed one character; return whether the text now ends with the whole stop string (the state then
        falls back to its longest border, so an overlapping next occurrence is still found)."""
        stop, state = self.stop, self.state
        while state and stop[state] != char:
            state = self.border[state - 1]
        if stop[state] == char:
            state += 1
        if state == len(stop):
            self.state = self.border[state - 1]
            return True
        self.state = state
        return False


class StopStringMatcher:
    """Holds back text that could begin a stop string; cuts the text at the first stop string.

    No part of a stop string is ever emitted, even across several tokens; the text before it in the same
    token is. Works on characters, after detokenization. The first stop string is the one that ends first in the
    text (of two ending at the same character, the longer), so the cut does not depend on how the text arrives
    in pieces. Each character costs O(1) amortized per stop string (``_StopString``), whatever their lengths.

    Args:
        stops: the stop strings (empty ones are dropped: they stop nothing).
    """

    def __init__(self, stops: list[str]) -> None:
        self._stops = [_StopString(s) for s in dict.fromkeys(stops) if s]
        self.buffer = ""

    def feed(self, text: str, stops_count: bool = True) -> tuple[str, bool]:
        """Add detokenized text; return (text safe to emit, whether a stop string was found).

        With ``stops_count`` False (a request's first ``min_tokens`` tokens) a stop string that ends in ``text``
        is not a stop, but one that begins there and ends in later text is (vLLM's ``min_tokens``), so text
        that could begin one is held back all the same."""
        base = len(self.buffer)
        self.buffer += text
        if not self._stops:
            out, self.buffer = self.buffer, ""
            return out, False
        # a stop string not begun (state 0) whose first character is not in the text stays at 0: not stepped
        active = [s for s in self._stops if s.state or s.stop[0] in text]
        for at, char in enumerate(text if active else ""):
            ended = [s for s in active if s.step(char)]
            if ended and stops_count:
                start = base + at + 1 - max(len(s.stop) for s in ended)
                out, self.buffer = self.buffer[:start], ""
                return out, True
        keep = max(s.state for s in self._stops)
        cut = len(self.buffer) - keep
        out, self.buffer = self.buffer[:cut], self.buffer[cut:]
        return out, False

    def flush(self) -> str:
        """At the end of generation without a stop string, the held text is real output."""
        out, self.buffer = self.buffer, ""
        return out
