"""Large text values of a frame too large to join, made JSON text a chunk at a time.

A replication frame over ``connection.CHUNK_BYTES`` arrives as the chunks it came
off the socket in (``FramePieces``), never joined (decision 44), and
``pgoutput.decode_chunks`` reads it as it reads any frame, except that a text
value over ``LARGE_VALUE_BYTES`` stays a ``LargeValue`` (views of the chunks).
``ChangeMapper.materialize`` then makes each large value of a text column its JSON
string text in pieces (:func:`json_string_pieces`: UTF-8 decoded and escaped a
chunk at a time, the event loop free between chunks), which the row's change text
splices in (``canonical_json.dumps_text``). A large value of any other type (an
array, a number) is joined and parsed as usual: no such column holds hundreds of
MB in practice, and parsing it in pieces would need a parser per type.
"""

from __future__ import annotations

import asyncio
import codecs
from typing import Final

from app.protocol.canonical_json import JsonPieces, json_string_piece
from app.protocol.pieces import PIECE_CHARS, Pieces
from app.sources.postgres.pgoutput import LargeValue

__all__ = ["LARGE_VALUE_BYTES", "json_string_pieces"]

# A text value over this many bytes in a large frame becomes pieces; smaller ones
# are decoded whole, which costs well under a millisecond.
LARGE_VALUE_BYTES: Final = 64 * 1024


async def json_string_pieces(value: LargeValue) -> JsonPieces:
    """The JSON string text of a large text value, a chunk per turn of the loop:
    UTF-8 decoded as the small path does (invalid bytes replaced) and escaped as
    ``JSON.stringify`` escapes, in pieces of at most ``PIECE_CHARS``."""
    decoder = codecs.getincrementaldecoder("utf-8")("replace")
    parts = ['"']
    for chunk in value.chunks:
        text = decoder.decode(chunk)
        for i in range(0, len(text), PIECE_CHARS):
            parts.append(json_string_piece(text[i : i + PIECE_CHARS]))
        del text
        await asyncio.sleep(0)
    rest = decoder.decode(b"", final=True)
    if rest:
        parts.append(json_string_piece(rest))
    parts.append('"')
    return JsonPieces(Pieces(parts))
