"""Incremental detokenization and stop strings, token by token, against tokenizer.decode."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import given, settings, strategies as st

from kvserve.server.detok import IncrementalDetokenizer, StopStringMatcher, complete_prefix, whole_text

TEXTS = [
    "Joy! 😀🎉🥳 and more 👨‍👩‍👧 family",
    "日本語のテキストと中文文本。",
    "  Leading spaces, tabs\tand newlines\nstay exactly as they were.",
    "Plain prose with words that split into several BPE pieces: antidisestablishmentarianism.",
]


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_join_to_the_decoded_text_without_replacement_chars(smollm2, text):
    tokenizer = smollm2.tokenizer
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    prompt = tokenizer("Say something:")["input_ids"]
    detok = IncrementalDetokenizer(tokenizer, prompt)
    deltas = [detok.add(t) for t in ids] + [detok.flush()]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == tokenizer.decode(ids) == text


def test_an_emoji_split_over_tokens_is_held_back(smollm2):
    tokenizer = smollm2.tokenizer
    ids = tokenizer("😀", add_special_tokens=False)["input_ids"]
    assert len(ids) > 1  # byte-level BPE splits it
    detok = IncrementalDetokenizer(tokenizer, [])
    assert [detok.add(t) for t in ids[:-1]] == [""] * (len(ids) - 1)
    assert detok.add(ids[-1]) == "😀"


def test_truncated_character_is_dropped_not_sent_as_fffd(smollm2):
    tokenizer = smollm2.tokenizer
    ids = tokenizer("ok 😀", add_special_tokens=False)["input_ids"]
    detok = IncrementalDetokenizer(tokenizer, [])
    out = "".join(detok.add(t) for t in ids[:-1]) + detok.flush()
    assert out == "ok " or out == "ok"


def test_a_literal_replacement_character_is_text_and_an_invalid_byte_is_not_held(smollm2):
    """U+FFFD written by the model (or ending a prompt) is a character like any other: the detokenizer reads the
    tokens' bytes, not a trailing U+FFFD, to tell an unfinished character (held) from whole text (sent). A stray
    continuation byte, which no later token completes, is sent as the decode has it."""
    tokenizer = smollm2.tokenizer
    literal = tokenizer("\ufffd", add_special_tokens=False)["input_ids"]
    assert tokenizer.decode(literal) == "\ufffd"
    a, b = (tokenizer(c, add_special_tokens=False)["input_ids"] for c in ("a", "b"))
    emoji = tokenizer(" 😀", add_special_tokens=False)["input_ids"]  # a space and the emoji's bytes
    stray = emoji[-1:]  # the emoji's last (continuation) byte alone
    for prompt, output in ((a, literal * 3), (a + literal, b), (a + literal * 3 + emoji[:-1], emoji[-1:] + b),
                           (a, stray), (a, stray + b)):
        detok = IncrementalDetokenizer(tokenizer, prompt)
        text = "".join([detok.add(t) for t in output] + [detok.flush()])
        assert whole_text(tokenizer, prompt) + text == tokenizer.decode(prompt + output), (prompt, output)
    detok = IncrementalDetokenizer(tokenizer, a)
    assert [detok.add(t) for t in literal * 2] == ["\ufffd", "\ufffd"]  # each sent when it comes, not held


def test_stop_string_spanning_pieces_is_never_emitted():
    matcher = StopStringMatcher(["DEFGHIJ"])
    emitted = []
    for piece in ["AB", "C", "D", "EF", "GH", "IJ", "KL"]:
        out, hit = matcher.feed(piece)
        emitted.append(out)
        if hit:
            break
    assert emitted == ["AB", "C", "", "", "", ""] and hit


def test_text_before_the_stop_in_the_same_piece_is_emitted():
    matcher = StopStringMatcher(["\n\n", "END"])
    assert matcher.feed("Hello wor") == ("Hello wor", False)
    assert matcher.feed("ld.\n") == ("ld.", False)          # "\n" might start "\n\n": held
    assert matcher.feed("\nmore") == ("", True)


def test_held_text_that_never_becomes_a_stop_is_released():
    matcher = StopStringMatcher(["STOP"])
    assert matcher.feed("a ST") == ("a ", False)
    assert matcher.feed("ART") == ("START", False)
    assert matcher.feed("go S") == ("go ", False)
    assert matcher.flush() == "S"


def _first_stop(text: str, stops: list[str], counted_from: int = 0) -> tuple[str, bool]:
    """The reference: the stop string that ends first in ``text`` (at a character past ``counted_from``; of two
    ending together the longer) cuts it; else the whole text."""
    for end in range(max(counted_from, 0) + 1, len(text) + 1):
        ended = [s for s in stops if s and text[:end].endswith(s)]
        if ended:
            return text[:end - max(map(len, ended))], True
    return text, False


def _fed(matcher: StopStringMatcher, pieces: list[str], uncounted: int = 0) -> tuple[str, bool]:
    out = ""
    for n, piece in enumerate(pieces):
        released, hit = matcher.feed(piece, stops_count=n >= uncounted)
        out += released
        if hit:
            return out, True
    return out + matcher.flush(), False


@settings(max_examples=300, deadline=None)
@given(text=st.text("abc", max_size=24), stops=st.lists(st.text("abc", max_size=5), max_size=4),
       cuts=st.lists(st.integers(0, 24), max_size=6))
def test_the_stop_string_that_ends_first_cuts_the_text_however_it_arrives(text, stops, cuts):
    pieces = [text[i:j] for i, j in zip([0, *sorted(cuts)], [*sorted(cuts), len(text)])]
    expected = _first_stop(text, stops)
    assert _fed(StopStringMatcher(stops), pieces) == expected
    assert _fed(StopStringMatcher(stops), list(text)) == expected


@settings(max_examples=300, deadline=None)
@given(text=st.text("ab", min_size=1, max_size=16), stops=st.lists(st.text("ab", min_size=1, max_size=4),
                                                                   min_size=1, max_size=3),
       uncounted=st.integers(0, 16))
def test_a_stop_string_counts_where_it_ends_past_the_uncounted_text(text, stops, uncounted):
    """vLLM's min_tokens: a stop string ending in the first pieces' text is not a stop; one that begins there and
    ends later is, and cuts where it begins."""
    pieces = list(text)
    assert _fed(StopStringMatcher(stops), pieces, uncounted) == _first_stop(text, stops, counted_from=uncounted)


def test_many_long_stop_strings_hold_only_what_could_begin_one():
    stops = ["b" * 5000, "a" * 5000 + "x"] + [f"<stop {i}>" for i in range(62)]
    matcher = StopStringMatcher(stops)
    assert [matcher.feed("a") for _ in range(3)] == [("", False)] * 3
    assert matcher.feed("y") == ("aaay", False)
    assert matcher.feed("a" * 5000 + "x!") == ("", True)
    assert _fed(StopStringMatcher(stops), ["one <stop", " 4", "1> two"]) == ("one ", True)


def _cut_inside_an_emoji(tokenizer, text: str) -> tuple[list[int], list[int]]:
    """``text``'s ids split after the first token that ends inside a character (an emoji's first bytes)."""
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    cut = next(n for n in range(1, len(ids)) if tokenizer.decode(ids[:n]).endswith("\ufffd"))
    return ids[:cut], ids[cut:]


def test_a_character_completed_across_the_prompt_boundary_starts_the_output(smollm2):
    tokenizer = smollm2.tokenizer
    prompt, output = _cut_inside_an_emoji(tokenizer, "Joy! 😀 and more")
    # the cut token holds the space before the emoji's first bytes: the space is the prompt's
    assert tokenizer.decode(prompt[-1:]) == " \ufffd"
    whole = whole_text(tokenizer, prompt)
    assert whole == "Joy! " and complete_prefix(tokenizer, prompt) < len(prompt)
    detok = IncrementalDetokenizer(tokenizer, prompt)
    text = "".join([detok.add(t) for t in output] + [detok.flush()])
    assert text == "😀 and more"
    assert whole + text == tokenizer.decode(prompt + output) == "Joy! 😀 and more"
    # an output that does not complete it: the prompt's dangling bytes are dropped, never sent as U+FFFD
    detok = IncrementalDetokenizer(tokenizer, prompt)
    other = tokenizer(" fine", add_special_tokens=False)["input_ids"]
    text = "".join([detok.add(t) for t in other] + [detok.flush()])
    assert text == " fine" and whole + text == tokenizer.decode(prompt + other).replace("\ufffd", "")


def test_served_a_character_completed_across_the_prompt_boundary_is_the_completions_start(smollm2, server_url):
    """Prompt token ids that end inside an emoji the model then completes: streamed and not, the completion
    starts with the whole emoji, the echoed prompt shows its whole characters only (no U+FFFD; the space its last
    token holds before the emoji's bytes is the prompt's, not repeated in the completion), and the echoed
    logprobs' text offsets never go back: the token completing the emoji starts where the emoji does."""
    tokenizer = smollm2.tokenizer
    prompt, _ = _cut_inside_an_emoji(tokenizer, "Repeat: 😀😀😀😀😀😀")
    assert tokenizer.decode(prompt[-1:]) == " \ufffd"  # a space, then the emoji's first bytes
    texts, offsets = [], []
    for stream, echo in ((False, True), (True, True), (False, False)):
        body = {"prompt": prompt, "max_tokens": 6, "temperature": 0, "echo": echo, "stream": stream, "logprobs": 0}
        with httpx.stream("POST", server_url + "/v1/completions", json=body, timeout=120) as response:
            assert response.status_code == 200
            if stream:
                chunks = [json.loads(line[6:]) for line in response.iter_lines() if line.startswith("data: {")]
                choices = [c["choices"][0] for c in chunks if c["choices"]]
            else:
                choices = json.loads(response.read())["choices"]
            texts.append("".join(c["text"] for c in choices))
            offsets.append([o for c in choices if c["logprobs"] for o in c["logprobs"]["text_offset"]])
    whole = whole_text(tokenizer, prompt)  # the prompt's whole characters
    assert whole == "Repeat: "
    assert texts[0] == texts[1] == whole + texts[2]
    assert "\ufffd" not in texts[0]
    assert offsets[0] == offsets[1] and offsets[0] == sorted(offsets[0])
    assert offsets[0][len(prompt)] == len(whole)  # the first generated token: the emoji it completes
    first = texts[2][0]  # the character the prompt's last bytes begin, completed by the model
    assert ord(first) >= 0x1F000  # an emoji (the model completes it as 😍)
