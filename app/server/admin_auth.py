"""Who may open the admin pages: the operator and admin passwords, checked as Basic
auth in constant time, and the back-off on wrong guesses, keyed on the TCP peer
(``app.server.admin`` documents the endpoints and what each needs)."""

from __future__ import annotations

import asyncio
import base64
import binascii
import enum
import hashlib
import hmac
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable

from fastapi import Request
from fastapi.responses import PlainTextResponse, Response

# The admin pages log under one name, whichever module of them writes the line.
log = logging.getLogger("app.server.admin")

STARTUP_ERROR = "ZERO_ADMIN_PASSWORD is required outside development mode (NODE_ENV=development)"


class Role(enum.Enum):
    """What an endpoint requires. The admin password satisfies both."""

    OPERATOR = "operator"  # read-only endpoints
    ADMIN = "admin"  # endpoints that change state


def check_startup(admin_password: str | None, development: bool) -> str | None:
    """The error to refuse to start with, or None (spec/wire.md §4.2)."""
    if not admin_password and not development:
        return STARTUP_ERROR
    return None


class LoginBackoff:
    """Slows password guessing: per client address (the TCP peer, unless
    ``CHANGESTREAMER_TRUSTED_PROXIES`` names the proxy in front), after
    ``FREE_FAILURES`` wrong passwords in a row, a wrong password during the wait
    (1 s, doubling to 60 s) is answered 429 with ``Retry-After``, and that answer is
    held back for up to ``HOLD_S`` (at most ``MAX_HELD`` answers at once, so the
    hold pins nothing). The right password always gets in and clears the
    address: anyone may share the operator's address or proxy, and a back-off that
    refused the right password would let them keep the operator out. At most
    ``MAX_ADDRESSES`` are remembered (the least recently failed are forgotten
    first), each for ``FORGET_S`` after its last failure: bounded memory whatever
    the flood."""

    FREE_FAILURES = 10
    FIRST_WAIT_S = 1.0
    MAX_WAIT_S = 60.0
    FORGET_S = 600.0
    MAX_ADDRESSES = 4096
    HOLD_S = 2.0
    MAX_HELD = 64

    def __init__(
        self, clock: Callable[[], float] = time.monotonic, *, hold_s: float = HOLD_S
    ) -> None:
        self._clock = clock
        self._hold_s = hold_s
        # address -> (failures in a row, monotonic time of the last one)
        self._failures: OrderedDict[str, tuple[int, float]] = OrderedDict()
        self.held = 0  # 429 answers being held back now
        self.wrong_total = 0  # wrong passwords since start

    async def hold(self, wait_s: float) -> None:
        """Holds a 429 back for up to ``HOLD_S`` (not at all past ``MAX_HELD``)."""
        if self.held >= self.MAX_HELD:
            return
        self.held += 1
        try:
            await asyncio.sleep(min(wait_s, self._hold_s))
        finally:
            self.held -= 1

    def wait_s(self, address: str) -> float:
        """Seconds ``address`` must still wait before its password is checked."""
        entry = self._failures.get(address)
        if entry is None:
            return 0.0
        failures, last = entry
        now = self._clock()
        if now - last >= self.FORGET_S:
            del self._failures[address]
            return 0.0
        return max(0.0, last + self._wait_after(failures) - now)

    def failed(self, address: str) -> None:
        self.wrong_total += 1
        failures = self._failures.pop(address, (0, 0.0))[0] + 1
        self._failures[address] = (failures, self._clock())
        if failures == self.FREE_FAILURES + 1:
            log.warning(
                "%d wrong admin passwords in a row from %s: slowing it down", failures, address
            )
        while len(self._failures) > self.MAX_ADDRESSES:
            self._failures.popitem(last=False)

    def succeeded(self, address: str) -> None:
        self._failures.pop(address, None)

    def _wait_after(self, failures: int) -> float:
        extra = failures - self.FREE_FAILURES
        if extra <= 0:
            return 0.0
        return float(min(self.MAX_WAIT_S, self.FIRST_WAIT_S * 2 ** min(extra - 1, 16)))


class AdminAuth:
    """Checks Basic credentials against the admin and operator passwords.

    Empty passwords count as unset (as an empty ``ZERO_ADMIN_PASSWORD`` does).
    Wrong passwords are slowed down per client address (:class:`LoginBackoff`).
    """

    def __init__(
        self,
        admin_password: str | None,
        operator_password: str | None,
        development: bool,
        *,
        backoff: LoginBackoff | None = None,
    ) -> None:
        self._admin = admin_password.encode() if admin_password else None
        self._operator = operator_password.encode() if operator_password else None
        self._development = development
        self._warned = False
        if self._operator is not None and self._admin is None:
            log.warning(
                "ZERO_OPERATOR_PASSWORD has no effect without ZERO_ADMIN_PASSWORD: %s",
                "admin pages are open without credentials (development mode)"
                if development
                else "admin pages are closed",
            )
        self.backoff = backoff or LoginBackoff()

    def allows(self, authorization: str | None, role: Role) -> bool:
        """Whether an ``Authorization`` header value grants an endpoint requiring ``role``."""
        # An empty password is none, as in zero-cache (curl -u ":$UNSET_VARIABLE").
        supplied = _basic_password(authorization) or None
        if supplied is None and self._admin is None and self._development:
            if not self._warned:
                self._warned = True
                log.warning(
                    "no ZERO_ADMIN_PASSWORD set: admin endpoints are open (development mode)"
                )
            return True
        if self._admin is None or supplied is None:
            return False
        candidates = [self._admin]
        if role is Role.OPERATOR and self._operator is not None:
            candidates.append(self._operator)
        granted = False
        for expected in candidates:  # no short cut: every candidate is compared
            granted |= _constant_time_equal(supplied, expected)
        return granted

    async def denial(self, request: Request, realm: str, role: Role) -> Response | None:
        """None if ``request`` may proceed, else the 401 (or, for a wrong password
        while its address must wait after too many, the 429) to answer."""
        address = request.client.host if request.client is not None else ""
        authorization = request.headers.get("authorization")
        if self.allows(authorization, role):
            if authorization is not None:
                self.backoff.succeeded(address)
            return None
        wait_s = self.backoff.wait_s(address)
        if authorization is not None:  # a challenge-less first request is no guess
            self.backoff.failed(address)
        if wait_s > 0:
            await self.backoff.hold(wait_s)
            return PlainTextResponse(
                "Too many wrong passwords; retry later",
                status_code=429,
                headers={"Retry-After": str(math.ceil(wait_s))},
            )
        return PlainTextResponse(
            "Unauthorized",
            status_code=401,
            headers={"WWW-Authenticate": f'Basic realm="{realm}"'},
        )


def _basic_password(authorization: str | None) -> bytes | None:
    """The password of a Basic ``Authorization`` value; None if absent or malformed."""
    if not authorization:
        return None
    scheme, _, token = authorization.strip().partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        decoded = base64.b64decode(token.strip(), validate=True)
    except (binascii.Error, ValueError):
        return None
    user, colon, password = decoded.partition(b":")
    if not colon:
        return None
    del user  # ignored, as in the reference
    return password


def _constant_time_equal(supplied: bytes, expected: bytes) -> bool:
    # Digests are of one length whatever was supplied, so neither the comparison's
    # time nor an early length check says how long the password is.
    return hmac.compare_digest(hashlib.sha256(supplied).digest(), hashlib.sha256(expected).digest())
