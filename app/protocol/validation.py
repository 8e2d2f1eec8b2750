"""A tiny passthrough validator for protocol messages, and its error type.

A *check* is a function that receives a decoded JSON value and returns it (or a
normalized copy) or raises :class:`FieldError`.  Objects are validated in
passthrough mode: required and optional keys are type-checked, unknown keys are
kept untouched and in order, so a validated message re-serializes to the same
bytes.  No schema library: validating an insert costs a handful of function calls.

The path to a bad field is collected while the error unwinds (``shape`` and
``array`` prepend their key or index), so the success path never builds strings.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any, Final

__all__ = [
    "Check",
    "FieldError",
    "MessageValidationError",
    "any_value",
    "array",
    "boolean",
    "json_object",
    "json_type_name",
    "nullable",
    "number",
    "one_of",
    "record",
    "shape",
    "string",
]

Check = Callable[[Any], Any]

# Tuples, not X | Y unions: isinstance is several times faster with a tuple.
_NUMBERS: Final = (int, float)
_SEQUENCES: Final = (list, tuple)


class MessageValidationError(ValueError):
    """A protocol message that does not match its schema.

    ``context`` is the message kind and tag (``"data/insert"``), ``field`` the dotted
    path of the offending field (empty for the message itself), ``reason`` the problem.
    """

    def __init__(self, context: str, field: str, reason: str, *, missing: bool = False) -> None:
        self.context = context
        self.field = field
        self.reason = reason
        if missing:
            text = f"{context}: missing required field '{field}'"
            if reason:
                text += f" ({reason})"
        elif field:
            text = f"{context}: field '{field}' {reason}"
        else:
            text = f"{context}: {reason}"
        # The text becomes a close reason and a log line, and a field path is made
        # of the peer's keys: control characters in it are written as escapes.
        super().__init__(text.translate(_ESCAPES))


# Control characters (C0, DEL, C1) and the two Unicode line separators as the
# escapes JSON would write for them: nothing that splits a line is left.
_ESCAPES: Final = {
    **{c: f"\\u{c:04x}" for c in (*range(0x20), *range(0x7F, 0xA0), 0x2028, 0x2029)},
    0x0A: "\\n",
    0x0D: "\\r",
    0x09: "\\t",
}


class FieldError(Exception):
    """Raised by checks; the caller turns it into a :class:`MessageValidationError`."""

    def __init__(self, reason: str, *, missing_key: str | None = None) -> None:
        super().__init__(reason)
        self.reason = reason
        self.missing = missing_key is not None
        # Innermost first; reversed when formatting.
        self.path: list[str | int] = [] if missing_key is None else [missing_key]

    def to_message_error(self, context: str) -> MessageValidationError:
        return MessageValidationError(
            context, format_path(reversed(self.path)), self.reason, missing=self.missing
        )


def format_path(parts: Iterable[str | int]) -> str:
    text = ""
    for part in parts:
        if isinstance(part, int):
            text += f"[{part}]"
        else:
            text += f".{part}" if text else part
    return text


def json_type_name(v: Any) -> str:
    """The JSON name of a decoded value's type, for error messages."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "boolean"
    if isinstance(v, _NUMBERS):
        return "number"
    if isinstance(v, str):
        return "string"
    if isinstance(v, _SEQUENCES):
        return "array"
    if isinstance(v, dict):
        return "object"
    return type(v).__name__


def _wrong_type(expected: str, v: Any) -> FieldError:
    return FieldError(f"must be {expected}, got {json_type_name(v)}")


# --- leaf checks ------------------------------------------------------------------


def any_value(v: Any) -> Any:
    return v


def string(v: Any) -> Any:
    if isinstance(v, str):
        return v
    raise _wrong_type("a string", v)


def boolean(v: Any) -> Any:
    if v is True or v is False:
        return v
    raise _wrong_type("a boolean", v)


def number(v: Any) -> Any:
    if isinstance(v, _NUMBERS) and not isinstance(v, bool):
        return v
    raise _wrong_type("a number", v)


def json_object(v: Any) -> Any:
    """Any JSON object (a row, a BackfillID, error details): keys are not checked."""
    if isinstance(v, dict):
        return v
    raise _wrong_type("an object", v)


def one_of(*allowed: str) -> Check:
    choices = frozenset(allowed)
    listed = ", ".join(repr(a) for a in allowed)

    def check(v: Any) -> Any:
        if isinstance(v, str) and v in choices:
            return v
        if isinstance(v, str):
            raise FieldError(f"must be one of {listed}, got {v!r}")
        raise _wrong_type(f"one of {listed}", v)

    return check


# --- combinators ------------------------------------------------------------------


def nullable(inner: Check) -> Check:
    def check(v: Any) -> Any:
        return None if v is None else inner(v)

    return check


def array(item: Check) -> Check:
    def check(v: Any) -> Any:
        if not isinstance(v, list):
            raise _wrong_type("an array", v)
        if item is any_value:
            return v
        replaced: list[Any] | None = None
        for i, element in enumerate(v):
            try:
                checked = item(element)
            except FieldError as e:
                e.path.append(i)
                raise
            if checked is not element:
                if replaced is None:
                    replaced = list(v)
                replaced[i] = checked
        return v if replaced is None else replaced

    return check


def record(value: Check) -> Check:
    """An object used as a map: every value is checked (not normalized), keys are free."""

    def check(v: Any) -> Any:
        if not isinstance(v, dict):
            raise _wrong_type("an object", v)
        for key, element in v.items():
            try:
                value(element)
            except FieldError as e:
                e.path.append(key)
                raise
        return v

    return check


def shape(required: Mapping[str, Check], optional: Mapping[str, Check] | None = None) -> Check:
    """A passthrough object with required and optional typed keys.

    An optional key may be absent but not ``null`` unless its check is ``nullable``.
    If a nested check returns a normalized value the object is copied (keys keep
    their positions); otherwise the original object is returned unchanged.
    """
    req = tuple(required.items())
    opt = tuple((optional or {}).items())

    def check(v: Any) -> Any:
        if not isinstance(v, dict):
            raise _wrong_type("an object", v)
        replaced: dict[str, Any] | None = None
        for key, spec in req:
            try:
                element = v[key]
            except KeyError:
                raise FieldError("", missing_key=key) from None
            try:
                checked = spec(element)
            except FieldError as e:
                e.path.append(key)
                raise
            if checked is not element:
                if replaced is None:
                    replaced = {}
                replaced[key] = checked
        for key, spec in opt:
            if key not in v:
                continue
            element = v[key]
            try:
                checked = spec(element)
            except FieldError as e:
                e.path.append(key)
                raise
            if checked is not element:
                if replaced is None:
                    replaced = {}
                replaced[key] = checked
        if replaced is None:
            return v
        return {**v, **replaced}

    return check
