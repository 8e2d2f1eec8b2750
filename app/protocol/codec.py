"""Change-log codec: the stored form of a message and its reconstruction.

The change log stores only the change object (the second tuple element) of each
message, as text (spec/core.md §1.5).  Storing cuts it out of the canonical
message JSON by position, without re-parsing: from after the first comma (the
first element is a short quoted kind) to the last comma for ``begin``/``commit``
(their trailer ``{"commitWatermark":"W"}`` / ``{"watermark":"W"}`` has no comma)
or to the final ``]`` otherwise.  Catch-up rebuilds the message from the row's
watermark, the change's tag and the stored text, byte-for-byte.
"""

from __future__ import annotations

from app.protocol.canonical_json import loads

__all__ = ["change_tag", "extract_change", "reconstruct"]


def extract_change(message_json: str) -> str:
    """The change object's JSON text inside a canonical message's JSON text."""
    start = message_json.find(",")
    if start < 0 or not message_json.startswith('["') or not message_json.endswith("]"):
        raise ValueError(f"not a canonical message tuple: {message_json[:40]!r}")
    if message_json.startswith(('["begin",', '["commit",')):
        end = message_json.rfind(",")
    else:
        end = len(message_json) - 1
    return message_json[start + 1 : end]


def reconstruct(watermark: str, tag: str, change_json: str) -> str:
    """Rebuild the canonical message JSON from a stored change.

    ``watermark`` is inserted verbatim: it is a LexiVersion (``[0-9a-z.]``), which
    needs no JSON escaping.
    """
    if tag == "begin":
        return f'["begin",{change_json},{{"commitWatermark":"{watermark}"}}]'
    if tag == "commit":
        return f'["commit",{change_json},{{"watermark":"{watermark}"}}]'
    if tag == "rollback":
        return f'["rollback",{change_json}]'
    return f'["data",{change_json}]'


def change_tag(change: str) -> str:
    """The ``tag`` of a stored change object.

    Sources put ``tag`` first in practice, so that case is a slice; any other key
    order falls back to parsing.
    """
    if change.startswith('{"tag":"'):
        end = change.find('"', 8)
        if end > 8:
            return change[8:end]
    tag = loads(change).get("tag")
    if not isinstance(tag, str):
        raise ValueError(f"stored change has no string 'tag': {change[:80]!r}")
    return tag
