"""Messages from a change source to the change-streamer (spec/source.md §1).

Every message is a JSON array ``[kind, body, trailer?]``:

======================================================  ===========================
``["begin", Begin, {"commitWatermark": W}]``            opens a transaction
``["data", DataChange | SchemaChange]``                 inside a transaction
``["commit", Commit, {"watermark": W}]``                closes it
``["rollback", {"tag": "rollback"}]``                   discards it
``["status", {ack?, lagReport?}, {"watermark": W}]``    position / lag report
``["control", {"tag": "reset-required", ...}]``         replica must be re-synced
======================================================  ===========================

:func:`parse_change_source_message` validates a decoded message and returns one of
the frozen dataclasses below.  Bodies are kept as received (unknown keys included,
in order) except for relation normalization (:mod:`app.protocol.changes`), so
``dumps(msg.as_list())`` is what gets stored and forwarded.  Trailers are rebuilt
from the watermark alone: the change-log codec cuts the stored change out of the
text at the last comma, and catch-up rebuilds exactly ``{"commitWatermark":W}`` /
``{"watermark":W}``, so an extra trailer key would corrupt storage and make live
and catch-up output differ.  Watermarks must be LexiVersions (``major[.minor]``),
since every later comparison relies on their string order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Final, Literal

from app.protocol.changes import BEGIN, COMMIT, DATA_SHAPES, ROLLBACK
from app.protocol.lexi import InvalidWatermarkError, parse_state_version
from app.protocol.validation import (
    Check,
    FieldError,
    MessageValidationError,
    boolean,
    json_object,
    json_type_name,
    number,
    one_of,
    shape,
    string,
)

__all__ = [
    "Begin",
    "ChangeSourceMessage",
    "Commit",
    "Control",
    "Data",
    "DataPlaneMessage",
    "MessageValidationError",
    "Rollback",
    "Status",
    "parse_change_source_message",
    "parse_data_plane",
]


@dataclass(frozen=True, slots=True)
class Begin:
    body: dict[str, Any]
    commit_watermark: str
    skip_ack: bool

    kind: ClassVar[Literal["begin"]] = "begin"

    @property
    def tag(self) -> Literal["begin"]:
        return "begin"

    def as_list(self) -> list[Any]:
        return ["begin", self.body, {"commitWatermark": self.commit_watermark}]


@dataclass(frozen=True, slots=True)
class Data:
    body: dict[str, Any]
    tag: str

    kind: ClassVar[Literal["data"]] = "data"

    def as_list(self) -> list[Any]:
        return ["data", self.body]


@dataclass(frozen=True, slots=True)
class Commit:
    body: dict[str, Any]
    watermark: str

    kind: ClassVar[Literal["commit"]] = "commit"

    @property
    def tag(self) -> Literal["commit"]:
        return "commit"

    def as_list(self) -> list[Any]:
        return ["commit", self.body, {"watermark": self.watermark}]


@dataclass(frozen=True, slots=True)
class Rollback:
    body: dict[str, Any]

    kind: ClassVar[Literal["rollback"]] = "rollback"

    @property
    def tag(self) -> Literal["rollback"]:
        return "rollback"

    def as_list(self) -> list[Any]:
        return ["rollback", self.body]


@dataclass(frozen=True, slots=True)
class Status:
    body: dict[str, Any]
    watermark: str
    ack: bool  # absent in the body means True
    lag_report: dict[str, Any] | None

    kind: ClassVar[Literal["status"]] = "status"

    def as_list(self) -> list[Any]:
        return ["status", self.body, {"watermark": self.watermark}]


@dataclass(frozen=True, slots=True)
class Control:
    body: dict[str, Any]

    kind: ClassVar[Literal["control"]] = "control"

    @property
    def tag(self) -> str:
        return str(self.body["tag"])

    @property
    def message(self) -> str | None:
        m = self.body.get("message")
        return m if isinstance(m, str) else None

    @property
    def error_details(self) -> dict[str, Any] | None:
        d = self.body.get("errorDetails")
        return d if isinstance(d, dict) else None

    def as_list(self) -> list[Any]:
        return ["control", self.body]


DataPlaneMessage = Begin | Data | Commit | Rollback
ChangeSourceMessage = Begin | Data | Commit | Rollback | Status | Control

_LAG_REPORT: Final = shape(
    {
        "lastTimings": shape(
            {"sendTimeMs": number, "commitTimeMs": number, "receiveTimeMs": number}
        ),
        "nextSendTimeMs": number,
    }
)
_STATUS: Final = shape({}, {"ack": boolean, "lagReport": _LAG_REPORT})
_CONTROL: Final = shape(
    {"tag": one_of("reset-required")}, {"message": string, "errorDetails": json_object}
)


def parse_change_source_message(value: Any) -> ChangeSourceMessage:
    """Validate a decoded change-source message; raise :class:`MessageValidationError`."""
    kind = _kind_of(value, "change-source message")
    if kind == "status":
        _expect_length(value, 3, kind)
        body = _checked(_STATUS, value[1], kind)
        watermark = _trailer_watermark(value[2], "watermark", kind)
        ack = body.get("ack", True)
        return Status(body, watermark, ack, body.get("lagReport"))
    if kind == "control":
        _expect_length(value, 2, kind)
        return Control(_checked(_CONTROL, value[1], kind))
    return _parse_data_plane(value, kind, "change-source message")


def parse_data_plane(
    value: Any, what: str = "data-plane message", *, strict_watermarks: bool = True
) -> DataPlaneMessage:
    """Validate a begin/data/commit/rollback message (the part subscribers also see).

    ``strict_watermarks=False`` only requires watermarks to be strings, as zero's
    own schema does; clients use it to accept whatever their server sends.
    """
    return _parse_data_plane(value, _kind_of(value, what), what, strict_watermarks)


def _parse_data_plane(
    value: list[Any], kind: str, what: str, strict_watermarks: bool = True
) -> DataPlaneMessage:
    if kind == "data":
        _expect_length(value, 2, kind)
        body = value[1]
        tag = _body_tag(body, kind)
        check = DATA_SHAPES.get(tag)
        if check is None:
            raise MessageValidationError(kind, "tag", f"is not a known change tag: {tag!r}")
        return Data(_checked(check, body, f"data/{tag}"), tag)
    if kind == "begin":
        _expect_length(value, 3, kind)
        body = _tagged(BEGIN, value[1], kind)
        watermark = _trailer_watermark(value[2], "commitWatermark", kind, strict_watermarks)
        return Begin(body, watermark, body.get("skipAck") is True)
    if kind == "commit":
        _expect_length(value, 3, kind)
        body = _tagged(COMMIT, value[1], kind)
        return Commit(body, _trailer_watermark(value[2], "watermark", kind, strict_watermarks))
    if kind == "rollback":
        _expect_length(value, 2, kind)
        return Rollback(_tagged(ROLLBACK, value[1], kind))
    raise MessageValidationError(what, "", f"unexpected message type {kind!r}")


def _kind_of(value: Any, what: str) -> str:
    if not isinstance(value, (list, tuple)):
        raise MessageValidationError(what, "", f"must be a JSON array, got {json_type_name(value)}")
    if not value:
        raise MessageValidationError(what, "", "is an empty array")
    kind = value[0]
    if not isinstance(kind, str):
        raise MessageValidationError(
            what, "", f"first element must be the message type, got {json_type_name(kind)}"
        )
    if kind not in _KINDS:
        raise MessageValidationError(what, "", f"unknown message type {kind!r}")
    return kind


_KINDS: Final = frozenset({"begin", "data", "commit", "rollback", "status", "control"})


def _expect_length(value: list[Any], n: int, kind: str) -> None:
    if len(value) != n:
        raise MessageValidationError(kind, "", f"expected {n} elements, got {len(value)}")


def _checked(check: Check, body: Any, context: str) -> dict[str, Any]:
    try:
        result: dict[str, Any] = check(body)
    except FieldError as e:
        raise e.to_message_error(context) from None
    return result


def _body_tag(body: Any, kind: str) -> str:
    if not isinstance(body, dict):
        raise MessageValidationError(
            kind, "", f"body must be an object, got {json_type_name(body)}"
        )
    try:
        tag = body["tag"]
    except KeyError:
        raise MessageValidationError(kind, "tag", "", missing=True) from None
    if not isinstance(tag, str):
        raise MessageValidationError(kind, "tag", f"must be a string, got {json_type_name(tag)}")
    return tag


def _tagged(check: Check, body: Any, kind: str) -> dict[str, Any]:
    tag = _body_tag(body, kind)
    if tag != kind:
        raise MessageValidationError(kind, "tag", f"must be {kind!r}, got {tag!r}")
    return _checked(check, body, kind)


def _trailer_watermark(trailer: Any, key: str, kind: str, strict: bool = True) -> str:
    if not isinstance(trailer, dict):
        raise MessageValidationError(
            kind, "", f"third element must be an object, got {json_type_name(trailer)}"
        )
    try:
        watermark = trailer[key]
    except KeyError:
        raise MessageValidationError(kind, key, "", missing=True) from None
    if not isinstance(watermark, str):
        raise MessageValidationError(
            kind, key, f"must be a string, got {json_type_name(watermark)}"
        )
    if not strict:
        return watermark
    try:
        parse_state_version(watermark)
    except InvalidWatermarkError as e:
        raise MessageValidationError(kind, key, f"is not a valid watermark: {e}") from None
    return watermark
