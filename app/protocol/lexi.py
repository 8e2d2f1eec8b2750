"""Watermarks: LexiVersion, Postgres LSN conversion and replica state versions.

A LexiVersion is a non-negative integer written so that plain string comparison
equals numeric comparison: the base-36 digits (``0-9a-z``) are prefixed by one
base-36 digit holding ``len(digits) - 1``.  Every watermark in the protocol is a
LexiVersion, optionally followed by ``.<minor>`` (a *state version*, used only for
backfill transactions).  See spec/source.md §2.

Decoding is strict: only the canonical encoding of a value is accepted (lower-case
digits, body length matching the prefix, no leading zeros in the body).  A
non-canonical string such as ``"100"`` (zero with a padded body) would sort after
``"0z"`` (35) and silently break the ordering every watermark comparison relies on,
so it is rejected rather than normalised.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Final

__all__ = [
    "MAX_LEXI_VALUE",
    "InvalidWatermarkError",
    "StateVersion",
    "from_lexi",
    "is_state_version",
    "lsn_to_watermark",
    "parse_state_version",
    "to_lexi",
    "watermark_fraction",
    "watermark_to_lsn",
]

_DIGITS: Final = "0123456789abcdefghijklmnopqrstuvwxyz"

# The prefix is a single base-36 digit, so a body has at most 36 digits.
MAX_LEXI_VALUE: Final = 36**36 - 1

_MAX_LSN: Final = 2**64 - 1
_LEXI_RE: Final = re.compile(r"[0-9a-z]+")
_LSN_RE: Final = re.compile(r"([0-9A-Fa-f]{1,8})/([0-9A-Fa-f]{1,8})")


class InvalidWatermarkError(ValueError):
    """A watermark, LexiVersion, state version or LSN that cannot be decoded."""


def to_lexi(n: int) -> str:
    """Encode a non-negative integer as a LexiVersion (``0`` -> ``"00"``)."""
    # bool is an int subclass; True would silently encode as "01".
    if isinstance(n, bool) or not isinstance(n, int):
        raise TypeError(f"LexiVersion value must be an int, got {type(n).__name__}")
    if n < 0:
        raise InvalidWatermarkError(f"cannot encode {n} as a LexiVersion: value is negative")
    if n > MAX_LEXI_VALUE:
        raise InvalidWatermarkError(
            f"cannot encode {n} as a LexiVersion: it needs more than 36 base-36 digits"
        )
    if n < 36:
        return "0" + _DIGITS[n]
    digits: list[str] = []
    while n:
        n, r = divmod(n, 36)
        digits.append(_DIGITS[r])
    digits.append(_DIGITS[len(digits) - 1])
    digits.reverse()
    return "".join(digits)


def from_lexi(s: str) -> int:
    """Decode a canonical LexiVersion; raise :class:`InvalidWatermarkError` otherwise."""
    if not isinstance(s, str):
        raise InvalidWatermarkError(
            f"invalid LexiVersion {s!r}: expected a string, got {type(s).__name__}"
        )
    if len(s) < 2:
        raise InvalidWatermarkError(f"invalid LexiVersion {s!r}: shorter than 2 characters")
    if _LEXI_RE.fullmatch(s) is None:
        raise InvalidWatermarkError(
            f"invalid LexiVersion {s!r}: only lower-case base-36 digits [0-9a-z] are allowed"
        )
    body_len = _DIGITS.index(s[0]) + 1
    if len(s) - 1 != body_len:
        raise InvalidWatermarkError(
            f"invalid LexiVersion {s!r}: prefix {s[0]!r} announces {body_len} digit(s) "
            f"but the body has {len(s) - 1}"
        )
    if body_len > 1 and s[1] == "0":
        raise InvalidWatermarkError(
            f"invalid LexiVersion {s!r}: body has a leading zero (not canonical)"
        )
    return int(s[1:], 36)


def lsn_to_watermark(lsn: str) -> str:
    """Convert a Postgres LSN ``"H/L"`` (hex, 1-8 digits each) to its LexiVersion."""
    m = _LSN_RE.fullmatch(lsn) if isinstance(lsn, str) else None
    if m is None:
        raise InvalidWatermarkError(
            f"invalid LSN {lsn!r}: expected 'H/L' with 1 to 8 hex digits on each side"
        )
    return to_lexi((int(m.group(1), 16) << 32) + int(m.group(2), 16))


def watermark_to_lsn(watermark: str) -> str:
    """Convert a watermark (or state version; only its major part counts) to ``"H/L"``.

    The halves are upper-case hex without padding, e.g. ``"16/B374D848"``.
    """
    value = parse_state_version(watermark).major
    if value > _MAX_LSN:
        raise InvalidWatermarkError(
            f"invalid watermark {watermark!r} for an LSN: {value} exceeds the 64-bit LSN range"
        )
    return f"{value >> 32:X}/{value & 0xFFFFFFFF:X}"


@dataclass(frozen=True, slots=True)
class StateVersion:
    """A replica state version: a major LexiVersion and an optional minor one.

    Ordering follows the string form: ``X < X.00 < X.01 < next-X``.
    """

    major: int
    minor: int | None = None

    def __post_init__(self) -> None:
        # Fail at construction, not later when the version is formatted or compared.
        to_lexi(self.major)
        if self.minor is not None:
            to_lexi(self.minor)

    def format(self) -> str:
        if self.minor is None:
            return to_lexi(self.major)
        return f"{to_lexi(self.major)}.{to_lexi(self.minor)}"

    def __str__(self) -> str:
        return self.format()

    def _key(self) -> tuple[int, int]:
        # "." sorts below every base-36 digit, so a bare major precedes all its minors.
        return (self.major, -1 if self.minor is None else self.minor)

    def __lt__(self, other: StateVersion) -> bool:
        return self._key() < other._key()

    def __le__(self, other: StateVersion) -> bool:
        return self._key() <= other._key()

    def __gt__(self, other: StateVersion) -> bool:
        return self._key() > other._key()

    def __ge__(self, other: StateVersion) -> bool:
        return self._key() >= other._key()


def _canonical_lexi_pattern() -> str:
    # One branch per prefix digit p: a body of exactly p + 1 digits, without a
    # leading zero when it has more than one (what from_lexi accepts, as one regex).
    branches = ["0[0-9a-z]"]
    branches += [f"{_DIGITS[p]}[1-9a-z][0-9a-z]{{{p}}}" for p in range(1, len(_DIGITS))]
    return "(?:" + "|".join(branches) + ")"


_STATE_VERSION_RE: Final = re.compile(
    f"{_canonical_lexi_pattern()}(?:\\.{_canonical_lexi_pattern()})?"
)


def is_state_version(s: object) -> bool:
    """Whether ``parse_state_version`` accepts ``s``: one regex match, for hot paths
    that only need the check (a few hundred ns where the parse costs microseconds)."""
    return isinstance(s, str) and _STATE_VERSION_RE.fullmatch(s) is not None


def parse_state_version(s: str) -> StateVersion:
    """Parse ``major`` or ``major.minor`` (each a canonical LexiVersion)."""
    if not isinstance(s, str):
        raise InvalidWatermarkError(
            f"invalid state version {s!r}: expected a string, got {type(s).__name__}"
        )
    major, dot, minor = s.partition(".")
    if not dot:
        return StateVersion(_part(s, major, "major"))
    if "." in minor:
        raise InvalidWatermarkError(f"invalid state version {s!r}: more than one '.'")
    return StateVersion(_part(s, major, "major"), _part(s, minor, "minor"))


def watermark_fraction(start: str | None, target: str | None, at: str | None) -> float | None:
    """Where ``at`` stands between ``start`` and ``target`` by watermark value, 0..1.

    How far a catch-up has read: Postgres watermarks are LSNs, so this is its share
    of the WAL between the two. None when a bound is unknown or not a watermark.
    """
    if start is None or target is None or at is None:
        return None
    try:
        low, high, now = (parse_state_version(w).major for w in (start, target, at))
    except InvalidWatermarkError:
        return None
    if high <= low:
        return 1.0
    return round(min(1.0, max(0.0, (now - low) / (high - low))), 4)


def _part(whole: str, part: str, name: str) -> int:
    try:
        return from_lexi(part)
    except InvalidWatermarkError as e:
        if part == whole:
            raise
        raise InvalidWatermarkError(f"invalid state version {whole!r}: {name} part: {e}") from None
