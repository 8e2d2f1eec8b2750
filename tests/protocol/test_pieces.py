"""Large texts in pieces: the same text as the whole string, whatever the cut."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from app.protocol.canonical_json import JsonPieces, dumps, dumps_text, json_string_piece
from app.protocol.codec import change_tag, extract_change, reconstruct
from app.protocol.pieces import Pieces, decode_pieces, join_text, text_pieces

# What escaping and UTF-8 can trip on: quotes, backslashes, controls, DEL,
# U+2028, two-, three- and four-byte characters.
TRICKY = st.text(alphabet=st.sampled_from(list('ab"\\\n\t\x00\x1f\x7fé€😀\u2028 ,]}')), max_size=40)


def cut(text: str, sizes: list[int]) -> Pieces:
    """``text`` cut at the given piece sizes (the rest in one last piece)."""
    parts, at = [], 0
    for n in sizes:
        parts.append(text[at : at + n])
        at += n
    parts.append(text[at:])
    return Pieces(parts)


@given(TRICKY.filter(bool), st.lists(st.integers(1, 7), max_size=8))
def test_length_head_tail_and_join_are_the_texts(text: str, sizes: list[int]) -> None:
    pieces = cut(text, sizes)
    assert len(pieces) == len(text)
    assert pieces.join() == text
    assert pieces.head(5) == text[:5]
    assert pieces.tail(5) == text[-5:]
    assert b"".join(pieces.utf8()) == text.encode()
    assert pieces.utf8_length() == len(text.encode())


@given(TRICKY, st.lists(st.integers(1, 7), max_size=8), st.integers(0, 5), st.integers(0, 5))
def test_trim_is_the_slice(text: str, sizes: list[int], start: int, end: int) -> None:
    text = "<<<<<" + text + ">>>>>"
    trimmed = cut(text, sizes).trim(start, end)
    assert join_text(trimmed) == text[start : len(text) - end]


def test_trim_refuses_more_than_the_text() -> None:
    with pytest.raises(ValueError, match="cannot trim"):
        Pieces(["ab", "c"]).trim(2, 2)


def test_concatenation_with_strings_keeps_the_pieces() -> None:
    pieces = Pieces(["bc", "de"])
    assert ("a" + pieces + "f").join() == "abcdef"
    assert len(("a" + pieces + "f").parts) == 2
    with pytest.raises(ValueError, match="non-empty"):
        Pieces(["", ""])


@given(TRICKY, st.integers(1, 9))
def test_utf8_cut_anywhere_decodes_to_the_text(text: str, size: int) -> None:
    data = text.encode()
    chunks = [data[i : i + size] for i in range(0, len(data), size)]
    assert join_text(decode_pieces(chunks)) == text


def test_invalid_utf8_is_refused() -> None:
    with pytest.raises(UnicodeDecodeError):
        decode_pieces([b"ab\xc3", b"("])


def test_text_pieces_cuts_only_large_texts() -> None:
    assert text_pieces("small") == "small"
    big = "x" * (5 * 1024 * 1024)
    pieces = text_pieces(big)
    assert isinstance(pieces, Pieces)
    assert max(map(len, pieces.parts)) == 256 * 1024
    assert pieces.join() == big


@given(TRICKY, st.lists(st.integers(1, 7), max_size=8))
def test_a_string_escaped_piece_by_piece_is_its_canonical_json(text: str, sizes: list[int]) -> None:
    pieces = cut(text, sizes) if text else None
    escaped = "" if pieces is None else "".join(json_string_piece(p) for p in pieces.parts)
    assert '"' + escaped + '"' == dumps(text)


@given(TRICKY, TRICKY, st.lists(st.integers(1, 7), max_size=8))
def test_dumps_text_splices_json_pieces_into_the_canonical_text(
    big: str, other: str, sizes: list[int]
) -> None:
    body: dict[str, Any] = {"tag": "insert", "new": {"id": 1.5, "v": big, "w": other}}
    pieces = cut(big, sizes) if big else None
    quoted = ['"', *(json_string_piece(p) for p in pieces.parts), '"'] if pieces else ['""']
    spliced = {**body, "new": {**body["new"], "v": JsonPieces(Pieces(quoted))}}
    text = dumps_text(spliced)
    assert isinstance(text, Pieces)
    assert text.join() == dumps(body)


def test_dumps_refuses_json_pieces_and_dumps_text_other_types() -> None:
    with pytest.raises(TypeError, match="JsonPieces"):
        dumps({"v": JsonPieces(Pieces(['"a"']))})
    with pytest.raises(TypeError, match="object"):
        dumps_text({"v": JsonPieces(Pieces(['"a"'])), "w": object()})
    assert dumps_text({"a": [1.0, None]}) == dumps({"a": [1.0, None]})


def test_a_large_data_message_is_stored_and_rebuilt_by_its_ends() -> None:
    change = '{"tag":"insert","new":{"v":"' + "x" * 50 + '"}}'
    message = cut('["data",' + change + "]", [3, 9, 20])
    stored = extract_change(message)
    assert isinstance(stored, Pieces)
    assert stored.join() == change
    assert change_tag(stored) == "insert"
    rebuilt = reconstruct("0a", "insert", stored)
    assert isinstance(rebuilt, Pieces)
    assert rebuilt.join() == message.join()
    with pytest.raises(ValueError, match="never large"):
        reconstruct("0a", "commit", stored)
    with pytest.raises(ValueError, match="leading 'tag'"):
        change_tag(Pieces(['{"new":1,', '"tag":"insert"}']))


def test_a_lone_surrogate_in_a_piece_is_escaped_as_js_does() -> None:
    assert json_string_piece("a\ud800b") == "a\\ud800b"
    assert '"' + json_string_piece("é\x1f\u2028") + '"' == dumps("é\x1f\u2028")
