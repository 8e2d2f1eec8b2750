"""Websocket envelopes shared by every change-streamer socket (wire.md §1.1, §5.3).

Server -> client frames are ``{"id":N,"msg":<message>}`` or, on connections that
opted into batching (v7), ``{"id":N,"batch":[<m1>,<m2>,...]}``; they are spelled
in one place, ``app.protocol.wsframes.envelope_texts``. This module reads them
(``parse_envelope``) and spells and reads acks.

Acks (``{"ack":N}``) are parsed strictly: a text frame holding a JSON object with
exactly the key ``ack`` and a non-negative integer value.  Anything else is a
protocol violation (:class:`AckError`) and the server closes the stream.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from app.protocol.canonical_json import loads
from app.protocol.validation import json_type_name

__all__ = [
    "AckError",
    "Envelope",
    "EnvelopeError",
    "ack_frame",
    "ack_from_value",
    "envelope_from_value",
    "parse_ack",
    "parse_envelope",
    "quick_ack",
]


class AckError(ValueError):
    """A client frame that is not a valid ``{"ack": N}``."""


class EnvelopeError(ValueError):
    """A server frame that is not a valid ``{"id": N, "msg"|"batch": ...}`` envelope."""


def ack_frame(id: int) -> str:
    return '{"ack":' + str(id) + "}"


def quick_ack(text: str) -> int | None:
    """The id of an ack in the exact form every client sends, ``{"ack":N}``; else None.

    One per message per subscriber, so no JSON parse; None sends the frame to
    ``parse_ack``, which accepts other valid spellings or names the error.
    """
    if text.startswith('{"ack":') and text.endswith("}"):
        digits = text[7:-1]
        # At most 20 digits (any 64-bit id): int() refuses runs past 4300 digits with a
        # ValueError, which parse_ack's JSON path turns into an AckError.
        if (
            digits.isascii()
            and digits.isdigit()
            and len(digits) <= 20
            and (digits == "0" or digits[0] != "0")
        ):
            return int(digits)
    return None


def parse_ack(data: str | bytes) -> int:
    """The id acknowledged by a client frame; :class:`AckError` if it is anything else."""
    if not isinstance(data, str):
        raise AckError("binary frames are not accepted; an ack must be a text frame")
    ack = quick_ack(data)
    if ack is not None:
        return ack
    try:
        value = loads(data)
    except ValueError as e:
        raise AckError(f"ack frame is not valid JSON: {e}") from None
    return ack_from_value(value)


def ack_from_value(value: Any) -> int:
    """Validate an already-decoded ack (for sockets that demultiplex acks and messages)."""
    if not isinstance(value, dict):
        raise AckError(f"ack frame must be a JSON object, got {json_type_name(value)}")
    if "ack" not in value:
        raise AckError(f"ack frame has no 'ack' key (keys: {_keys(value)})")
    if len(value) != 1:
        extra = {k: v for k, v in value.items() if k != "ack"}
        raise AckError(f"ack frame has unexpected keys: {_keys(extra)}")
    ack = value["ack"]
    if isinstance(ack, bool):
        raise AckError(f"'ack' must be a non-negative integer, got boolean {str(ack).lower()}")
    if isinstance(ack, float):
        # JSON.parse would read 1.0 as 1; we do not: our peers only ever send integers.
        raise AckError(f"'ack' must be a non-negative integer, got float {ack!r}")
    if not isinstance(ack, int):
        raise AckError(f"'ack' must be a non-negative integer, got {json_type_name(ack)}")
    if ack < 0:
        raise AckError(f"'ack' must be a non-negative integer, got {ack}")
    return ack


@dataclass(frozen=True, slots=True)
class Envelope:
    """A decoded ``{"id", "msg"|"batch"}`` frame; ``messages`` has one element for msg."""

    id: int
    messages: list[Any]
    batch: bool
    body: dict[str, Any]  # the whole envelope, extra keys included


def parse_envelope(data: str | bytes) -> Envelope:
    """Decode a server frame on the client side (extra envelope keys are tolerated)."""
    if not isinstance(data, str):
        raise EnvelopeError("binary frames are not accepted; envelopes are text frames")
    try:
        value = loads(data)
    except ValueError as e:
        raise EnvelopeError(f"frame is not valid JSON: {e}") from None
    return envelope_from_value(value)


def envelope_from_value(value: Any) -> Envelope:
    if not isinstance(value, dict):
        raise EnvelopeError(f"envelope must be a JSON object, got {json_type_name(value)}")
    if "id" not in value:
        raise EnvelopeError("envelope has no 'id'")
    id_ = value["id"]
    if isinstance(id_, bool) or not isinstance(id_, int) or id_ < 0:
        raise EnvelopeError(f"envelope 'id' must be a non-negative integer, got {id_!r}")
    has_msg = "msg" in value
    has_batch = "batch" in value
    if has_msg == has_batch:
        which = "both" if has_msg else "neither"
        raise EnvelopeError(f"envelope must have exactly one of 'msg' and 'batch', has {which}")
    if has_msg:
        return Envelope(id_, [value["msg"]], False, value)
    batch = value["batch"]
    if not isinstance(batch, list):
        raise EnvelopeError(f"envelope 'batch' must be an array, got {json_type_name(batch)}")
    return Envelope(id_, batch, True, value)


def _keys(d: dict[str, Any]) -> str:
    return ", ".join(repr(k) for k in d) or "none"
