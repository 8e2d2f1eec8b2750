"""Row changes decoded from a large frame's chunks (``pgoutput.decode_chunks`` with
``large_over``, then ``ChangeMapper.materialize``, app/sources/postgres/large_values.py)
against the whole-frame path: the same change text, whatever the cut."""

from __future__ import annotations

import random
import struct
from collections.abc import Callable
from functools import partial
from typing import Any

import pytest

from app.protocol.canonical_json import JsonPieces, dumps, dumps_text
from app.protocol.messages import ChangeSourceMessage, Data
from app.protocol.pieces import Pieces, join_text
from app.sources.postgres.large_values import LARGE_VALUE_BYTES, json_string_pieces
from app.sources.postgres.mapper import ChangeMapper, MappingError, ShardId
from app.sources.postgres.pgoutput import (
    UNCHANGED_TOAST,
    Insert,
    LargeValue,
    PgOutputError,
    decode_chunks,
    decode_message,
)
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


async def map_chunks(
    mapper: ChangeMapper, chunks: list[bytes], *, large_over: int = LARGE_VALUE_BYTES
) -> list[ChangeSourceMessage]:
    """What the source makes of a frame too large to join (``_large_frame_messages``)."""
    message = decode_chunks(chunks, len(HEADER), large_over=large_over)
    return mapper.map(await mapper.materialize(message))


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


async def test_generated_row_changes_match_the_whole_frame_path(mapper: ChangeMapper) -> None:
    rng = random.Random(46)
    large = 0
    for _ in range(1500):
        payload = random_payload(rng)
        expected = texts(python_path(mapper, payload))
        try:
            # Every text value over 3 bytes is "large": each row takes the pieces path.
            mapped = await map_chunks(mapper, chunked(HEADER + payload, rng, 9), large_over=3)
            actual = texts(mapped)
            large += sum(
                isinstance(v, JsonPieces)
                for d in mapped
                for part in ("new", "old", "key")
                for v in (d.body.get(part) or {}).values()
            )
        except (MappingError, PgOutputError):
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
    (data,) = await map_chunks(mapper, chunks)
    title = data.body["new"]["title"]
    assert isinstance(title, JsonPieces)
    assert max(map(len, title.text.parts)) <= 2 * 256 * 1024  # escapes at most double
    whole = python_path(mapper, payload)
    assert not isinstance(whole, Exception)
    assert join_text(dumps_text(data.body)) == dumps(whole[0].body)


async def test_other_messages_and_malformed_rows(mapper: ChangeMapper) -> None:
    commit = b"C" + bytes(25)
    assert await map_chunks(mapper, [HEADER, commit[:3], commit[3:]]) == python_path(mapper, commit)
    truncated = (
        b"I" + struct.pack(">I", REL_OID) + b"N" + struct.pack(">h", 1) + b"t\x00\x00\x00\x09ab"
    )
    with pytest.raises(PgOutputError, match="'I' message truncated: column value of 9 bytes"):
        await map_chunks(mapper, [HEADER + truncated[:8], truncated[8:]])
    unknown = b"I" + struct.pack(">I", 7) + b"N" + struct.pack(">h", 0)
    with pytest.raises(MappingError, match="before its Relation"):
        await map_chunks(mapper, [HEADER + unknown])


async def test_json_string_pieces_replaces_invalid_utf8_as_the_whole_path_does() -> None:
    raw = "añ€😀".encode() * 3 + b"\xff\xfe" + b"z"
    chunks = [memoryview(raw[i : i + 2]) for i in range(0, len(raw), 2)]
    pieces = await json_string_pieces(LargeValue(chunks, len(raw)))
    assert isinstance(pieces.text, Pieces)
    assert pieces.text.join() == dumps(raw.decode("utf-8", "replace"))


def test_decode_chunks_keeps_small_values_whole() -> None:
    payload = b"I" + struct.pack(">I", REL_OID) + b"N" + tuple_data(["ab", "x" * 40, None, "TOAST"])
    row = decode_chunks([payload[:3], payload[3:20], payload[20:]], 0, large_over=10)
    assert isinstance(row, Insert)
    small, big, null, toast = row.new
    assert small == "ab"
    assert isinstance(big, LargeValue)
    assert big.join() == "x" * 40
    assert null is None
    assert toast is UNCHANGED_TOAST


def outcome(decode: Callable[[], object]) -> object:
    """A decoded message, or its error's text."""
    try:
        return decode()
    except PgOutputError as e:
        return str(e)


def test_any_cut_decodes_as_the_whole_frame() -> None:
    """One decoder over chunks: whatever the cut, every message (row changes valid
    and broken, and the other kinds) decodes to what the whole frame gives, the
    same error text included."""
    rng = random.Random(26)
    others = [
        relation_payload(),
        b"B" + struct.pack(">Qqi", 1 << 40, 5, -7),
        b"C" + struct.pack(">BQQq", 0, 9, 10, 11),
        b"M\x01" + struct.pack(">Q", 3) + b"zero/ddl\x00" + struct.pack(">i", 5) + b"hello",
        b"T" + struct.pack(">iB", 2, 3) + struct.pack(">II", 7, 8),
        b"O" + struct.pack(">Q", 1) + b"origin\x00",
        b"Y" + struct.pack(">I", 99) + b"public\x00mood\x00",
    ]
    errors = 0
    for i in range(3000):
        payload = random_payload(rng) if i % 4 else rng.choice(others)
        if rng.random() < 0.2:  # cut short or lengthened: the error texts must agree too
            payload = payload[: rng.randrange(len(payload))] + b"\x00" * rng.randint(0, 1)
        whole = outcome(partial(decode_message, payload))
        errors += isinstance(whole, str)
        chunks = chunked(HEADER + payload, rng, 7)
        assert outcome(partial(decode_chunks, chunks, len(HEADER))) == whole, payload
    assert errors > 300  # broken messages were among them
