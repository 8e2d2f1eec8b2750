"""Who may open a replication websocket (issue 25): checked before the upgrade.

Two checks, in this order, each answered with an HTTP status to the upgrade
request (the socket is never accepted, so nothing is read or reserved):

- **Origin.** Browsers apply no same-origin policy to websockets, so any page a
  developer or an operator opens could subscribe to ``ws://127.0.0.1:4849`` and
  read every replicated row. Browsers always send ``Origin``; view-syncers (Node's
  ``ws``) and our own client send none. An upgrade carrying an ``Origin`` that is
  not in ``CHANGESTREAMER_ALLOWED_ORIGINS`` (empty by default) gets 403.
- **The replication password** (``CHANGESTREAMER_REPLICATION_PASSWORD``, optional).
  Checked as the password of HTTP Basic auth (the user name is ignored), since that
  is what zero-cache 1.9.0 can send unmodified: it resolves the fixed path against
  ``ZERO_CHANGE_STREAMER_URI`` with ``new URL(path, base)``, which keeps the base's
  user info (and drops its path and query, so a query parameter could not be
  carried), and Node's ``ws`` sends user info as ``Authorization: Basic``. ``ws``
  sends the user info as written in the URL (percent-escapes not decoded), so both
  the raw and the decoded form are compared. Missing or wrong: 401. Wrong
  passwords are slowed per client address as the admin passwords are
  (:class:`~app.server.admin_auth.LoginBackoff`): once an address must wait, its
  upgrades are held until the wait is over, or refused with 429 and
  ``Retry-After``, without their password being compared.

Refusals are logged at INFO, bounded: the first of each status at once, then one
line per interval with the counts (a flood of refused upgrades is not a flood of
lines). Digests are compared in constant time, so the comparison reveals neither
the password nor its length.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import logging
from collections.abc import Iterable
from typing import Final
from urllib.parse import unquote

from starlette.types import Scope

from app.server.admin_auth import LoginBackoff
from app.server.log_lines import RefusalLog

__all__ = ["REFUSAL_LOG_INTERVAL_S", "Refusal", "ReplicationAccess", "normalize_origin"]

log = logging.getLogger(__name__)

REFUSAL_LOG_INTERVAL_S: Final = 60.0
SECRET: Final = "replication"  # the password's name in the back-off


class Refusal:
    """An upgrade refused: the status, the headers and a short body for the client."""

    def __init__(self, status: int, reason: str, headers: dict[str, str] | None = None) -> None:
        self.status = status
        self.reason = reason
        self.headers = headers or {}


def normalize_origin(origin: str) -> str:
    """``Origin`` values compare case-insensitively, without a trailing slash."""
    return origin.strip().rstrip("/").lower()


def _digest(value: str) -> bytes:
    return hashlib.sha256(value.encode("utf-8", "surrogatepass")).digest()


class ReplicationAccess:
    """The checks of one server (``check`` per upgrade). Pass the ``backoff`` of the
    checks this one replaces, so that new options do not forget the guessers."""

    def __init__(
        self,
        allowed_origins: Iterable[str] = (),
        password: str | None = None,
        *,
        log_interval_s: float = REFUSAL_LOG_INTERVAL_S,
        backoff: LoginBackoff | None = None,
    ) -> None:
        self._origins = frozenset(normalize_origin(o) for o in allowed_origins if o.strip())
        self._password = _digest(password) if password else None
        self._log = RefusalLog("replication upgrade", log, log_interval_s)
        self.backoff = backoff or LoginBackoff(logger=log)

    async def check(self, scope: Scope) -> Refusal | None:
        """None if the upgrade may proceed; else the refusal (already logged). Waits
        while a password from a client that must wait is held."""
        headers: dict[bytes, bytes] = {}
        for name, value in scope.get("headers", ()):
            headers.setdefault(name.lower(), value)
        client = scope.get("client")
        refusal = await self._refusal(headers, client[0] if client else "")
        if refusal is not None:
            peer = f"{client[0]}:{client[1]}" if client else "?"
            self._log.refused(refusal.status, peer, refusal.reason)
        return refusal

    async def _refusal(self, headers: dict[bytes, bytes], address: str) -> Refusal | None:
        origin = headers.get(b"origin")
        if origin is not None:
            text = origin.decode("latin-1")
            if normalize_origin(text) not in self._origins:
                # repr: the header is the client's; it may hold control characters.
                return Refusal(403, f"origin {text[:200]!r} is not allowed")
        if self._password is None:
            return None
        authorization = headers.get(b"authorization")
        if authorization is not None:  # a request without one is no guess
            retry_after_s = await self.backoff.turn(address, (SECRET,))
            if retry_after_s:
                return Refusal(
                    429,
                    "too many wrong replication passwords; retry later",
                    {"Retry-After": str(retry_after_s)},
                )
            if self.authorized(authorization):
                self.backoff.succeeded(address, SECRET)
                return None
            self.backoff.failed(address, (SECRET,))
        return Refusal(
            401,
            "missing or wrong replication password",
            {"WWW-Authenticate": 'Basic realm="changestreamer replication"'},
        )

    def authorized(self, header: bytes) -> bool:
        """Whether an ``Authorization`` value carries the replication password."""
        assert self._password is not None
        scheme, _, encoded = header.decode("latin-1").strip().partition(" ")
        if scheme.lower() != "basic":
            return False
        try:
            decoded = base64.b64decode(encoded.strip(), validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError):
            return False
        _user, sep, password = decoded.partition(":")
        if not sep:
            return False
        # Both digests are always compared (no early exit that a timing could reveal).
        raw = hmac.compare_digest(_digest(password), self._password)
        unescaped = hmac.compare_digest(_digest(unquote(password)), self._password)
        return raw | unescaped
