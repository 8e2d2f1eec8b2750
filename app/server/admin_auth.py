"""Who may open the admin pages: the operator and admin passwords, checked as Basic
auth in constant time (``app.server.admin`` documents the endpoints and what each
needs), and the back-off on wrong guesses that the replication password shares
(``LoginBackoff``, keyed on the TCP peer and the password guessed)."""

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
from collections.abc import Callable, Iterable, Sequence
from typing import Final

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
    """Slows password guessing, per client address (the TCP peer, unless
    ``CHANGESTREAMER_TRUSTED_PROXIES`` names the proxy in front) and per password
    guessed (``secret``: "admin", "operator", "replication").

    After ``FREE_FAILURES`` wrong passwords in a row, the address must wait (1 s,
    doubling to 60 s) before its next password for that secret is checked; a
    request that comes during the wait is held until the wait is over (at most
    ``MAX_HELD_PER_ADDRESS`` per address, ``MAX_HELD`` in all) or, past those,
    refused at once. Either way the password is not compared until the wait is
    over, so parallel requests buy no guesses: an address gets about one check
    per wait. When a wait ends, the first password checked decides: a wrong one
    starts the next wait, and the others held beside it are refused unchecked. The
    right password clears only its own secret's failures (an operator login does
    not reset guesses at the admin password). Nobody is locked out for longer than
    the wait, but a guesser sharing the operator's address delays the operator too.
    At most ``MAX_ADDRESSES`` (address, secret) pairs are remembered (the least
    recently failed are forgotten first), each for ``FORGET_S`` after its last
    failure: bounded memory whatever the flood."""

    FREE_FAILURES = 10
    FIRST_WAIT_S = 1.0
    MAX_WAIT_S = 60.0  # also the longest a request is held
    FORGET_S = 600.0
    MAX_ADDRESSES = 4096
    MAX_HELD = 64
    MAX_HELD_PER_ADDRESS = 4

    def __init__(
        self, clock: Callable[[], float] = time.monotonic, *, logger: logging.Logger = log
    ) -> None:
        self._clock = clock
        self._log = logger
        # (address, secret) -> (failures in a row, monotonic time of the last one)
        self._failures: OrderedDict[tuple[str, str], tuple[int, float]] = OrderedDict()
        self._held_by: dict[str, int] = {}  # address -> requests held now (no zeros)
        self.held = 0  # requests held now, all addresses
        self.wrong_total = 0  # wrong passwords since start

    async def turn(self, address: str, secrets: Sequence[str]) -> int:
        """Waits until a password from ``address`` that may be any of ``secrets``
        may be checked: 0 then, else the whole seconds to wait (``Retry-After``),
        to be answered without checking the password."""
        until = self._wait_ends(address, secrets)
        wait_s = until - self._clock()
        if wait_s <= 0:
            return 0
        held_here = self._held_by.get(address, 0)
        if self.held >= self.MAX_HELD or held_here >= self.MAX_HELD_PER_ADDRESS:
            return math.ceil(wait_s)
        self.held += 1
        self._held_by[address] = held_here + 1
        try:
            await asyncio.sleep(wait_s)  # at most MAX_WAIT_S
        finally:
            self.held -= 1
            self._held_by[address] -= 1
            if not self._held_by[address]:
                del self._held_by[address]
        # A password checked meanwhile failed and started a new wait: this one is
        # not checked either (compared with the wait held for, not with the clock,
        # which the sleep may end a hair before).
        later = self._wait_ends(address, secrets)
        wait_s = later - self._clock()
        return math.ceil(wait_s) if later > until and wait_s > 0 else 0

    def wait_s(self, address: str, secrets: Sequence[str]) -> float:
        """Seconds ``address`` must still wait before its password is checked."""
        return max(0.0, self._wait_ends(address, secrets) - self._clock())

    def failed(self, address: str, secrets: Sequence[str]) -> None:
        """A wrong password from ``address``: a guess at each of ``secrets``."""
        self.wrong_total += 1
        now = self._clock()
        slowed = None
        for secret in secrets:
            failures = self._failures.pop((address, secret), (0, 0.0))[0] + 1
            self._failures[(address, secret)] = (failures, now)
            if failures == self.FREE_FAILURES + 1 and slowed is None:
                slowed = secret
        if slowed is not None:  # one line when the address starts waiting
            self._log.warning(
                "%d wrong %s passwords in a row from %s: slowing it down",
                self.FREE_FAILURES + 1,
                slowed,
                address,
            )
        while len(self._failures) > self.MAX_ADDRESSES:
            self._failures.popitem(last=False)

    def succeeded(self, address: str, secret: str) -> None:
        self._failures.pop((address, secret), None)

    def _wait_ends(self, address: str, secrets: Sequence[str]) -> float:
        """When the longest wait of ``address`` for ``secrets`` ends (0: none)."""
        ends = 0.0
        now = self._clock()
        for secret in secrets:
            entry = self._failures.get((address, secret))
            if entry is None:
                continue
            failures, last = entry
            if now - last >= self.FORGET_S:
                del self._failures[(address, secret)]
                continue
            ends = max(ends, last + self._wait_after(failures))
        return ends

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
        allowed_hosts: Iterable[str] = (),
    ) -> None:
        """``allowed_hosts``: host names besides the loopback ones that the pages
        answer while they are open without a password (``_host_allowed``)."""
        self._admin = admin_password.encode() if admin_password else None
        self._hosts = LOOPBACK_HOSTS | {_bare(h) for h in allowed_hosts}
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

    def granted(self, authorization: str | None, role: Role) -> Role | None:
        """Which password an ``Authorization`` header value carries that grants an
        endpoint requiring ``role`` (None: none does)."""
        # An empty password is none, as in zero-cache (curl -u ":$UNSET_VARIABLE").
        supplied = _basic_password(authorization) or None
        if supplied is None and self._admin is None and self._development:
            if not self._warned:
                self._warned = True
                log.warning(
                    "no ZERO_ADMIN_PASSWORD set: admin endpoints are open (development mode)"
                )
            return Role.ADMIN
        if self._admin is None or supplied is None:
            return None
        # No short cut: every candidate is compared, whichever matched.
        admin = _constant_time_equal(supplied, self._admin)
        operator = False
        if role is Role.OPERATOR and self._operator is not None:
            operator = _constant_time_equal(supplied, self._operator)
        if admin:
            return Role.ADMIN
        return Role.OPERATOR if operator else None

    async def denial(self, request: Request, realm: str, role: Role) -> Response | None:
        """None if ``request`` may proceed, else the 401, or the 429 for a password
        its address must wait to have checked (it was not checked)."""
        if self._admin is None and self._development and not self._host_allowed(request):
            # Open pages and a browser: a page of any site whose name resolves to this
            # address (DNS rebinding) would read them with the browser's blessing. The
            # Host header it sends is its own name.
            return PlainTextResponse(
                "Host not allowed: the admin pages are open without a password, so they "
                "answer only localhost, the loopback addresses and CHANGESTREAMER_ALLOWED_HOSTS",
                status_code=403,
            )
        authorization = request.headers.get("authorization")
        if authorization is None:  # a challenge-less first request is no guess
            return None if self.granted(None, role) is not None else _challenge(realm)
        address = request.client.host if request.client is not None else ""
        secrets = self._secrets(role)
        retry_after_s = await self.backoff.turn(address, secrets)
        if retry_after_s:
            return PlainTextResponse(
                "Too many wrong passwords; retry later",
                status_code=429,
                headers={"Retry-After": str(retry_after_s)},
            )
        granted = self.granted(authorization, role)
        if granted is None:
            self.backoff.failed(address, secrets)
            return _challenge(realm)
        self.backoff.succeeded(address, granted.value)
        return None

    def _host_allowed(self, request: Request) -> bool:
        host = request.headers.get("host")
        if host is None:  # HTTP/1.0: no browser sends that
            return True
        return _bare(host.rsplit(":", 1)[0] if not host.endswith("]") else host) in self._hosts

    def _secrets(self, role: Role) -> tuple[str, ...]:
        """The passwords a guess at an endpoint requiring ``role`` may find: the
        admin password opens the operator's endpoints too."""
        if role is Role.OPERATOR and self._operator is not None:
            return (Role.ADMIN.value, Role.OPERATOR.value)
        return (Role.ADMIN.value,)


# Host names the open admin pages always answer.
LOOPBACK_HOSTS: Final = frozenset({"localhost", "127.0.0.1", "::1"})


def _bare(host: str) -> str:
    """A host name as compared: lower case, an IPv6 address without its brackets."""
    host = host.strip().lower()
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def _challenge(realm: str) -> Response:
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
