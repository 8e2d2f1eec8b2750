"""Messages from the change-streamer to a subscriber (spec/core.md §1.6, wire.md §2.3).

The catalog is ``status`` | ``begin`` / ``data`` / ``commit`` / ``rollback`` |
``error``.  Data-plane messages are forwarded as the canonical JSON the source
produced, so the server side only needs builders for ``status`` and the synthetic
rollback; errors are built in :mod:`app.protocol.errors`.  The parser is for Python
clients (and tests) consuming a subscription.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar, Final, Literal

from app.protocol.canonical_json import dumps
from app.protocol.errors import ErrorType
from app.protocol.messages import (
    Begin,
    Commit,
    Data,
    MessageValidationError,
    Rollback,
    parse_data_plane,
)
from app.protocol.validation import FieldError, number, one_of, shape, string

__all__ = [
    "SYNTHETIC_ROLLBACK_JSON",
    "DownstreamError",
    "DownstreamMessage",
    "DownstreamStatus",
    "parse_downstream_message",
    "status_json",
]

# Sent to live subscribers when the upstream stream breaks mid-transaction.
SYNTHETIC_ROLLBACK_JSON: Final = '["rollback",{"tag":"rollback"}]'


@dataclass(frozen=True, slots=True)
class DownstreamStatus:
    body: dict[str, Any]
    lag_report: dict[str, Any] | None

    kind: ClassVar[Literal["status"]] = "status"

    def as_list(self) -> list[Any]:
        return ["status", self.body]


@dataclass(frozen=True, slots=True)
class DownstreamError:
    body: dict[str, Any]
    type: int  # an int, not ErrorType: newer servers may send codes we do not know
    message: str

    kind: ClassVar[Literal["error"]] = "error"

    @property
    def error_type(self) -> ErrorType | None:
        try:
            return ErrorType(self.type)
        except ValueError:
            return None

    def describe(self) -> str:
        """``"<ReadableName>: <message>"``, the text zero's replicator stops with."""
        known = self.error_type
        name = known.readable_name if known is not None else f"Error{self.type}"
        return f"{name}: {self.message}"

    def as_list(self) -> list[Any]:
        return ["error", self.body]


DownstreamMessage = DownstreamStatus | Begin | Data | Commit | Rollback | DownstreamError


def status_json(lag_report: dict[str, Any] | None = None) -> str:
    """``["status",{"tag":"status"}]``, with the latest lag report if there is one."""
    body: dict[str, Any] = {"tag": "status"}
    if lag_report is not None:
        body["lagReport"] = lag_report
    return dumps(["status", body])


_TIMINGS: Final = shape({"sendTimeMs": number, "commitTimeMs": number, "receiveTimeMs": number})
_STATUS: Final = shape(
    {"tag": one_of("status")},
    {"lagReport": shape({"lastTimings": _TIMINGS, "nextSendTimeMs": number})},
)


def _integer(v: Any) -> Any:
    if isinstance(v, int) and not isinstance(v, bool):
        return v
    raise FieldError("must be an integer")


_ERROR: Final = shape({"type": _integer, "message": string})


def parse_downstream_message(value: Any) -> DownstreamMessage:
    """Validate a decoded subscription message; raise :class:`MessageValidationError`."""
    if isinstance(value, (list, tuple)) and value and value[0] in ("status", "error"):
        kind = value[0]
        if len(value) != 2:
            raise MessageValidationError(kind, "", f"expected 2 elements, got {len(value)}")
        try:
            body = (_STATUS if kind == "status" else _ERROR)(value[1])
        except FieldError as e:
            raise e.to_message_error(kind) from None
        if kind == "status":
            return DownstreamStatus(body, body.get("lagReport"))
        return DownstreamError(body, body["type"], body["message"])
    # Watermarks from the server are opaque strings to a client (zero's schema too).
    return parse_data_plane(value, "subscription message", strict_watermarks=False)
