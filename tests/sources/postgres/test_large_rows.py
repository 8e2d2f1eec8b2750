"""Row changes decoded from a large frame's chunks (app/sources/postgres/large_rows.py)
against the whole-frame path: the same change text, whatever the cut."""

from __future__ import annotations

import random
import struct
from typing import Any

import pytest

from app.protocol.canonical_json import JsonPieces, dumps, dumps_text
from app.protocol.messages import Data
from app.protocol.pieces import Pieces, join_text
from app.sources.postgres import large_rows
from app.sources.postgres.large_rows import LargeValue, decode_row_chunks, json_string_pieces
from app.sources.postgres.mapper import ChangeMapper, MappingError, ShardId
from app.sources.postgres.pgoutput import UNCHANGED_TOAST, decode_message
from app.sources.postgres.values import TypeRegistry
from tests.sources.postgres.test_pgrows import (
    REL_OID,
    python_path,
    random_payload,
    relation_payload,
    tuple_data,
)

HEADER = b"w" + bytes(24)  # an XLogData frame's header: the mapper skips it


@pytest.fixture
def mapper() -> ChangeMapper:
    m = ChangeMapper(ShardId("app", 0), TypeRegistry())
    assert m.map(decode_message(relation_payload())) == []
    return m


def chunked(data: bytes, rng: random.Random, most: int) -> list[bytes]:
    out, at = [], 0
    while at < len(data):
        n = rng.randint(1, most)
        out.append(data[at : at + n])
        at += n
    return out


def texts(out: list[Any] | Exception) -> list[str] | type[Exception]:
    """The change texts of mapped messages (JsonPieces spliced in), or the error's type."""
    if isinstance(out, Exception):
        return MappingError
    assert all(type(d) is Data for d in out)
    return [join_text(dumps_text(d.body)) for d in out]


async def test_generated_row_changes_match_the_whole_frame_path(
    mapper: ChangeMapper, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Every text value over 3 bytes is "large", so each row takes the pieces path.
    monkeypatch.setattr(large_rows, "LARGE_VALUE_BYTES", 3)
    rng = random.Random(46)
    large = 0
    for _ in range(1500):
        payload = random_payload(rng)
        expected = texts(python_path(mapper, payload))
        try:
            mapped = await mapper.map_large_row(chunked(HEADER + payload, rng, 9), len(HEADER))
            assert mapped is not None
            actual = texts(mapped)
            large += sum(
                isinstance(v, JsonPieces)
                for d in mapped
                for part in ("new", "old", "key")
                for v in (d.body.get(part) or {}).values()
            )
        except MappingError:
            actual = MappingError
        assert actual == expected, payload
    assert large > 200  # the pieces path did run (391 with this seed)


async def test_a_large_text_value_is_json_pieces_of_bounded_size(mapper: ChangeMapper) -> None:
    value = ('é😀"\\\n' + "x" * 1000) * 3000  # ~3 MB, every escape, multi-byte chars
    payload = (
        b"I"
        + struct.pack(">I", REL_OID)
        + b"N"
        + tuple_data(["1", "2", None, None, value, None, None, None, None, None])
    )
    chunks = chunked(HEADER + payload, random.Random(1), 1 << 20)
    mapped = await mapper.map_large_row(chunks, len(HEADER))
    assert mapped is not None
    (data,) = mapped
    title = data.body["new"]["title"]
    assert isinstance(title, JsonPieces)
    assert max(map(len, title.text.parts)) <= 2 * 256 * 1024  # escapes at most double
    whole = python_path(mapper, payload)
    assert not isinstance(whole, Exception)
    assert join_text(dumps_text(data.body)) == dumps(whole[0].body)


async def test_other_messages_and_malformed_rows(mapper: ChangeMapper) -> None:
    commit = b"C" + bytes(25)
    assert await mapper.map_large_row([HEADER, commit], len(HEADER)) is None
    truncated = (
        b"I" + struct.pack(">I", REL_OID) + b"N" + struct.pack(">h", 1) + b"t\x00\x00\x00\x09ab"
    )
    with pytest.raises(MappingError, match="truncated"):
        await mapper.map_large_row([HEADER + truncated[:8], truncated[8:]], len(HEADER))
    unknown = b"I" + struct.pack(">I", 7) + b"N" + struct.pack(">h", 0)
    with pytest.raises(MappingError, match="before its Relation"):
        await mapper.map_large_row([HEADER + unknown], len(HEADER))


async def test_json_string_pieces_replaces_invalid_utf8_as_the_whole_path_does() -> None:
    raw = "añ€😀".encode() * 3 + b"\xff\xfe" + b"z"
    chunks = [memoryview(raw[i : i + 2]) for i in range(0, len(raw), 2)]
    pieces = await json_string_pieces(LargeValue(chunks, len(raw)))
    assert isinstance(pieces.text, Pieces)
    assert pieces.text.join() == dumps(raw.decode("utf-8", "replace"))


def test_decode_row_chunks_keeps_small_values_whole() -> None:
    payload = b"I" + struct.pack(">I", REL_OID) + b"N" + tuple_data(["ab", "x" * 40, None, "TOAST"])
    row = decode_row_chunks([payload[:3], payload[3:20], payload[20:]], 0, large_over=10)
    assert row is not None
    assert row.kind == "I"
    assert row.new is not None
    small, big, null, toast = row.new
    assert small == "ab"
    assert isinstance(big, LargeValue)
    assert big.join() == "x" * 40
    assert null is None
    assert toast is UNCHANGED_TOAST
