"""COPY text rows, parsed back to exactly what was stored (real Postgres output)."""

from __future__ import annotations

import psycopg
import pytest

from app.sources.postgres.copy_text import CopyFormatError, parse_copy_line

AWKWARD = [
    "a\tb",
    "line\nnext",
    "back\\slash",
    "é ü 😀",
    "\\N",  # the text backslash-N, not NULL
    "",
    None,
    "x\\y\r\x0b\x08\x0c",
]


async def test_postgres_copy_output_round_trips(pg_url: str) -> None:
    async with await psycopg.AsyncConnection.connect(pg_url) as c:
        cur = c.cursor()
        await cur.execute("CREATE TEMP TABLE t (i int, v text, n int)")
        for i, v in enumerate(AWKWARD):
            await cur.execute("INSERT INTO t VALUES (%s, %s, %s)", (i, v, i * 10))
        async with cur.copy("COPY (SELECT v, n FROM t ORDER BY i) TO STDOUT") as copy:
            rows = [parse_copy_line(data, 2) async for data in copy]
    assert [r[0] for r in rows] == AWKWARD
    assert [r[1] for r in rows] == [str(i * 10) for i in range(len(AWKWARD))]


def test_octal_and_hex_escapes_are_utf8_bytes() -> None:
    # COPY FROM accepts these; our parser reads them too (é is \303\251 in UTF-8).
    assert parse_copy_line(b"caf\\303\\251\t\\x41\\\\x\n", 2) == ["café", "A\\x"]


def test_wrong_field_count_is_a_clear_error() -> None:
    with pytest.raises(CopyFormatError, match="COPY row has 3 fields, expected 2"):
        parse_copy_line(b"a\tb\tc\n", 2)


def test_invalid_utf8_after_unescaping_is_a_clear_error() -> None:
    with pytest.raises(CopyFormatError, match="not UTF-8"):
        parse_copy_line(b"\\377\n", 1)
