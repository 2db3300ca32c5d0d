"""Incremental detokenization and stop strings, token by token, against tokenizer.decode."""

from __future__ import annotations

import pytest

from kvserve.server.detok import IncrementalDetokenizer, StopStringMatcher

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
