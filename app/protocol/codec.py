"""Change-log codec: the stored form of a message and its reconstruction.

The change log stores only the change object (the second tuple element) of each
message, as text (spec/core.md §1.5).  Storing cuts it out of the canonical
message JSON by position, without re-parsing: from after the first comma (the
first element is a short quoted kind) to the last comma for ``begin``/``commit``
(their trailer ``{"commitWatermark":"W"}`` / ``{"watermark":"W"}`` has no comma)
or to the final ``]`` otherwise.  Catch-up rebuilds the message from the row's
watermark, the change's tag and the stored text, byte-for-byte.

A large text (``Pieces``, app/protocol/pieces.py) is cut and rebuilt the same way
at its ends, without touching the pieces in between.
"""

from __future__ import annotations

from typing import Final, overload

from app.protocol.canonical_json import loads
from app.protocol.pieces import Pieces, Text

__all__ = ["change_tag", "data_change", "data_message", "extract_change", "reconstruct"]

# A data message's text is ``["data",<change>]``: built and cut only by the two
# functions below (and their C twin in ``_rowrun.c``).
_DATA_HEAD: Final = '["data",'


@overload
def data_message(change_json: str) -> str: ...
@overload
def data_message(change_json: Text) -> Text: ...


def data_message(change_json: Text) -> Text:
    """The message text of a data change, from the change's JSON text."""
    return _DATA_HEAD + change_json + "]"


@overload
def data_change(message_json: str) -> str: ...
@overload
def data_change(message_json: Text) -> Text: ...


def data_change(message_json: Text) -> Text:
    """The change's JSON text inside a data message's text (unchecked: the caller
    knows it is one; a large one, ``Pieces``, is cut at its ends only)."""
    if isinstance(message_json, str):
        return message_json[len(_DATA_HEAD) : -1]
    return message_json.trim(len(_DATA_HEAD), 1)


@overload
def extract_change(message_json: str) -> str: ...
@overload
def extract_change(message_json: Text) -> Text: ...


def extract_change(message_json: Text) -> Text:
    """The change object's JSON text inside a canonical message's JSON text."""
    if isinstance(message_json, Pieces):
        # Only data messages grow large.
        if message_json.head(len(_DATA_HEAD)) != _DATA_HEAD or message_json.tail(1) != "]":
            raise ValueError(f"not a canonical data message: {message_json.head(40)!r}")
        return data_change(message_json)
    start = message_json.find(",")
    if start < 0 or not message_json.startswith('["') or not message_json.endswith("]"):
        raise ValueError(f"not a canonical message tuple: {message_json[:40]!r}")
    if message_json.startswith(('["begin",', '["commit",')):
        end = message_json.rfind(",")
    else:
        end = len(message_json) - 1
    return message_json[start + 1 : end]


@overload
def reconstruct(watermark: str, tag: str, change_json: str) -> str: ...
@overload
def reconstruct(watermark: str, tag: str, change_json: Text) -> Text: ...


def reconstruct(watermark: str, tag: str, change_json: Text) -> Text:
    """Rebuild the canonical message JSON from a stored change.

    ``watermark`` is inserted verbatim: it is a LexiVersion (``[0-9a-z.]``), which
    needs no JSON escaping.
    """
    if isinstance(change_json, Pieces):
        if tag in ("begin", "commit", "rollback"):
            raise ValueError(f"a {tag} change is never large")
        return data_message(change_json)
    if tag == "begin":
        return f'["begin",{change_json},{{"commitWatermark":"{watermark}"}}]'
    if tag == "commit":
        return f'["commit",{change_json},{{"watermark":"{watermark}"}}]'
    if tag == "rollback":
        return f'["rollback",{change_json}]'
    return data_message(change_json)


def change_tag(change: Text) -> str:
    """The ``tag`` of a stored change object.

    Sources put ``tag`` first in practice, so that case is a slice; any other key
    order falls back to parsing (not for a large text: its tag must come first).
    """
    if isinstance(change, Pieces):
        head = change.head(64)
        end = head.find('"', 8)
        if head.startswith('{"tag":"') and end > 8:
            return head[8:end]
        raise ValueError(f"large stored change without a leading 'tag': {head!r}")
    if change.startswith('{"tag":"'):
        end = change.find('"', 8)
        if end > 8:
            return change[8:end]
    tag = loads(change).get("tag")
    if not isinstance(tag, str):
        raise ValueError(f"stored change has no string 'tag': {change[:80]!r}")
    return tag
