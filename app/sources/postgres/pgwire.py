"""Getting a replication connection established: TLS, startup and authentication.

Everything here is sans-I/O (``connection`` does the reading and writing; the
connection string is ``conninfo``'s): the TLS context (:func:`ssl_context`), the
password file (:func:`password_from_file`), SCRAM (:class:`ScramSha256`) and the
startup conversation as a state machine (:class:`Startup`: each server message in,
the bytes to answer out). The one thing it schedules is SCRAM's key derivation, in
a worker thread (``asyncio.to_thread``), so that a slow one never stalls the loop.

The options and what each does are in docs/postgres-connection.md. In short, as
libpq does it, and where this client is stricter, why:

* ``sslmode`` disable / allow / prefer / require / verify-ca / verify-full with
  ``sslrootcert`` (``system``: the default CA store), ``sslcert``, ``sslkey``
  (refused when others may read it), ``ssl_min_protocol_version`` and
  ``ssl_max_protocol_version``; a root certificate that exists makes even
  ``require`` verify the server's chain;
* the password file (``passfile`` / ``PGPASSFILE`` / ``~/.pgpass``, ignored when
  group- or world-readable);
* authentication: trust, cleartext password, MD5, SCRAM-SHA-256 and, over TLS,
  SCRAM-SHA-256-PLUS (``channel_binding`` disable / prefer / require, with
  ``tls-server-end-point``); ``require_auth`` (a list of methods, or of ``!``
  methods to refuse). Stricter than libpq: a cleartext or MD5 password is only
  sent over a Unix socket, to a loopback address or over TLS whose server was
  verified, unless ``require_auth`` names the method; a SCRAM exchange of more
  than :data:`MAX_SCRAM_ITERATIONS` iterations is refused.

Refused with a clear :class:`~app.sources.postgres.conninfo.ConnectError`:
Kerberos, GSSAPI, SSPI or SCM authentication. A server message that does not parse
is a ``ConnectError`` too, so the next host is tried.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import logging
import os
import secrets
import ssl
import stat
import stringprep
import struct
import unicodedata
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from app.sources.postgres.conninfo import (
    ConnectError,
    ConnParams,
    default_socket_dir,
    is_local,
)

__all__ = [
    "SSL_REQUEST",
    "TERMINATE",
    "ScramSha256",
    "Startup",
    "TlsSession",
    "describe",
    "error_fields",
    "md5_password",
    "message",
    "password_from_file",
    "server_end_point",
    "ssl_context",
]

log = logging.getLogger(__name__)

PROTOCOL_3_0: Final = 196608
SSL_REQUEST: Final = struct.pack("!II", 8, 80877103)
TERMINATE: Final = b"X\x00\x00\x00\x04"

# A server may ask for this many PBKDF2 iterations at most (Postgres' default is
# 4,096): each costs the client ~0.25 µs here, and a hostile server must not make a
# connection attempt cost minutes of CPU (INT_MAX would).
MAX_SCRAM_ITERATIONS: Final = 1_000_000

_AUTH_NAMES: Final[Mapping[int, str]] = {
    2: "Kerberos V5",
    6: "SCM credentials",
    7: "GSSAPI",
    8: "GSSAPI",
    9: "SSPI",
}


def password_from_file(passfile: str, host: str, port: int, dbname: str, user: str) -> str | None:
    """libpq's password file lookup: the first ``host:port:db:user:password`` line
    that matches (``*`` matches anything; ``\\`` escapes ``:`` and ``\\``)."""
    if host.startswith("/") and host == default_socket_dir():
        host = "localhost"
    try:
        st = os.stat(passfile)
        if not stat.S_ISREG(st.st_mode):
            log.warning('password file "%s" is not a plain file', passfile)
            return None
        if st.st_mode & 0o077:
            log.warning(
                'password file "%s" has group or world access; permissions should be '
                "u=rw (0600) or less",
                passfile,
            )
            return None
        with open(passfile, encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    wanted = (host, str(port), dbname, user)
    for line in lines:
        if not line or line.startswith("#"):
            continue
        fields = _pgpass_fields(line)
        if len(fields) == 5 and all(f in ("*", w) for f, w in zip(fields[:4], wanted, strict=True)):
            return fields[4]
    return None


def _pgpass_fields(line: str) -> list[str]:
    fields = [""]
    escaped = False
    for c in line:
        if escaped:
            fields[-1] += c
            escaped = False
        elif c == "\\":
            escaped = True
        elif c == ":" and len(fields) < 5:
            fields.append("")
        else:
            fields[-1] += c
    return fields


def ssl_context(params: ConnParams) -> ssl.SSLContext:
    """The TLS context ``params.sslmode`` asks for (libpq's choices, see the docstring)."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ctx.minimum_version = params.ssl_min_version
    if params.ssl_max_version is not None:
        ctx.maximum_version = params.ssl_max_version
    root = params.sslrootcert
    try:
        if root == "system":
            ctx.load_default_certs()
        elif os.path.exists(root):
            ctx.load_verify_locations(root)
        elif params.sslmode in ("verify-ca", "verify-full"):
            raise ConnectError(
                None,
                f'root certificate file "{root}" does not exist; either provide the file, '
                "use the system's trusted roots with sslrootcert=system, or change sslmode "
                "to disable server certificate verification",
            )
        else:
            ctx.check_hostname = False
            ctx.verify_mode = ssl.CERT_NONE
        if ctx.verify_mode != ssl.CERT_NONE:
            ctx.check_hostname = params.sslmode == "verify-full"
        if os.path.exists(params.sslcert):
            _check_key_file(params.sslkey)
            ctx.load_cert_chain(params.sslcert, params.sslkey)
    except (OSError, ssl.SSLError) as e:
        raise ConnectError(None, f"could not set up TLS: {e}") from e
    return ctx


def _check_key_file(path: str) -> None:
    """libpq's rule for the client's private key: a plain file that only its owner
    may read (0600), or root and its group (0640, for a key shared with a service
    account)."""
    try:
        st = os.stat(path)
    except OSError:
        raise ConnectError(
            None, f'certificate present, but not private key file "{path}"'
        ) from None
    if not stat.S_ISREG(st.st_mode):
        raise ConnectError(None, f'private key file "{path}" is not a regular file')
    mode = st.st_mode
    if (st.st_uid == os.geteuid() and mode & 0o077) or (st.st_uid == 0 and mode & 0o037):
        raise ConnectError(
            None,
            f'private key file "{path}" has group or world access; file must have '
            "permissions u=rw (0600) or less if owned by the current user, or permissions "
            "u=rw,g=r (0640) or less if owned by root",
        )


# The hash of a certificate's signature algorithm (DER-encoded OIDs), for
# tls-server-end-point (RFC 5929 §4.1: MD5 and SHA-1 mean SHA-256).
_SIGNATURE_HASHES: Final[Mapping[bytes, str]] = {
    bytes.fromhex("2a864886f70d010104"): "sha256",  # md5WithRSAEncryption
    bytes.fromhex("2a864886f70d010105"): "sha256",  # sha1WithRSAEncryption
    bytes.fromhex("2a864886f70d01010b"): "sha256",
    bytes.fromhex("2a864886f70d01010c"): "sha384",
    bytes.fromhex("2a864886f70d01010d"): "sha512",
    bytes.fromhex("2a864886f70d01010e"): "sha224",
    bytes.fromhex("2a8648ce3d0401"): "sha256",  # ecdsa-with-SHA1
    bytes.fromhex("2a8648ce3d040301"): "sha224",
    bytes.fromhex("2a8648ce3d040302"): "sha256",
    bytes.fromhex("2a8648ce3d040303"): "sha384",
    bytes.fromhex("2a8648ce3d040304"): "sha512",
}


def server_end_point(certificate: bytes) -> bytes | None:
    """The ``tls-server-end-point`` channel binding data of the server's certificate
    (DER): its hash by the hash of its signature algorithm. None when that algorithm
    has no such hash (Ed25519, RSASSA-PSS) or the certificate does not parse; the
    server then cannot compute it either."""
    try:
        body, _ = _der(certificate, 0, 0x30)  # Certificate ::= SEQUENCE {
        _, pos = _der(certificate, body, 0x30)  # tbsCertificate, skipped
        algorithm, _ = _der(certificate, pos, 0x30)  # signatureAlgorithm {
        start, end = _der(certificate, algorithm, 0x06)  # algorithm OID
    except (IndexError, ValueError):
        return None
    name = _SIGNATURE_HASHES.get(certificate[start:end])
    return None if name is None else hashlib.new(name, certificate).digest()


def _der(data: bytes, pos: int, tag: int) -> tuple[int, int]:
    """The DER element with ``tag`` at ``pos``: where its content starts and ends."""
    if data[pos] != tag:
        raise ValueError(f"expected DER tag {tag:#x} at {pos}")
    length = data[pos + 1]
    pos += 2
    if length & 0x80:
        n = length & 0x7F
        length = int.from_bytes(data[pos : pos + n], "big")
        pos += n
    if pos + length > len(data):
        raise ValueError("DER element runs past the end")
    return pos, pos + length


# -- messages ---------------------------------------------------------------


def message(kind: bytes, body: bytes) -> bytes:
    """One frontend message: its type byte, its length, its body."""
    return kind + struct.pack("!I", len(body) + 4) + body


def _cstring(text: str) -> bytes:
    return text.encode() + b"\x00"


def error_fields(body: bytes) -> dict[str, str]:
    """An ErrorResponse's or NoticeResponse's fields by code (``C`` SQLSTATE, ``M``
    message, ``V`` severity...)."""
    fields: dict[str, str] = {}
    for part in body.split(b"\x00"):
        if part:
            fields[chr(part[0])] = part[1:].decode(errors="replace")
    return fields


def describe(fields: Mapping[str, str]) -> str:
    """One line, as libpq starts its error messages: ``FATAL: the message``."""
    severity = fields.get("V") or fields.get("S") or "ERROR"
    return f"{severity}: {fields.get('M', 'no message')}"


def md5_password(user: str, password: str, salt: bytes) -> bytes:
    """The answer to AuthenticationMD5Password: ``md5`` + md5(md5(password + user) + salt)."""
    inner = hashlib.md5((password + user).encode()).hexdigest().encode()
    return b"md5" + hashlib.md5(inner + salt).hexdigest().encode()


# -- SCRAM-SHA-256 (RFC 5802, RFC 7677) ------------------------------------------


class ScramSha256:
    """The client side of SCRAM-SHA-256, and of SCRAM-SHA-256-PLUS when given the
    TLS channel's ``tls-server-end-point`` data (``binding``).

    The GS2 header says what the client did: ``p=tls-server-end-point`` (bound),
    ``y`` (it could bind but the server did not offer to: a server that can sees a
    man in the middle who took SCRAM-SHA-256-PLUS off its list) or ``n`` (no TLS).
    Postgres takes the user from the startup message and ignores SCRAM's, so it is
    empty unless given (RFC 7677's example names one)."""

    MECHANISM: Final = "SCRAM-SHA-256"
    MECHANISM_PLUS: Final = "SCRAM-SHA-256-PLUS"

    def __init__(
        self,
        password: str,
        *,
        user: str = "",
        nonce: str | None = None,
        binding: bytes | None = None,
        could_bind: bool = False,
    ) -> None:
        self._password = _saslprep(password).encode()
        self._nonce = nonce or base64.b64encode(secrets.token_bytes(18)).decode()
        name = user.replace("=", "=3D").replace(",", "=2C")
        self._first_bare = f"n={name},r={self._nonce}"
        self._binding = binding
        self._gs2 = "p=tls-server-end-point,," if binding else "y,," if could_bind else "n,,"
        self._server_signature: bytes | None = None
        self._verified = False

    @property
    def mechanism(self) -> str:
        return self.MECHANISM_PLUS if self._binding else self.MECHANISM

    @property
    def bound(self) -> bool:
        """Whether this exchange binds the TLS channel (SCRAM-SHA-256-PLUS)."""
        return self._binding is not None

    @property
    def started_final(self) -> bool:
        return self._server_signature is not None

    def client_first(self) -> bytes:
        return (self._gs2 + self._first_bare).encode()

    async def client_final(self, server_first: bytes) -> bytes:
        """The answer to server-first-message. The key derivation (PBKDF2, as many
        rounds as the server asks, up to :data:`MAX_SCRAM_ITERATIONS`) runs in a
        worker thread: the event loop serves the subscribers meanwhile."""
        text = server_first.decode()
        attrs = dict(part.split("=", 1) for part in text.split(",") if "=" in part)
        nonce, salt, iterations = attrs.get("r", ""), attrs.get("s"), int(attrs.get("i", "0"))
        if not nonce.startswith(self._nonce) or len(nonce) == len(self._nonce):
            raise ConnectError(None, "SCRAM: the server's nonce does not extend ours")
        if salt is None or iterations <= 0:
            raise ConnectError(None, f"SCRAM: malformed server-first-message {text!r}")
        if iterations > MAX_SCRAM_ITERATIONS:
            raise ConnectError(
                None,
                f"SCRAM: the server asks for {iterations:,} iterations, more than the "
                f"{MAX_SCRAM_ITERATIONS:,} this client computes",
            )
        salted = await asyncio.to_thread(
            hashlib.pbkdf2_hmac,
            "sha256",
            self._password,
            base64.b64decode(salt, validate=True),
            iterations,
        )
        client_key = _hmac(salted, b"Client Key")
        channel = base64.b64encode(self._gs2.encode() + (self._binding or b"")).decode()
        without_proof = f"c={channel},r={nonce}"
        auth_message = f"{self._first_bare},{text},{without_proof}".encode()
        signature = _hmac(hashlib.sha256(client_key).digest(), auth_message)
        proof = bytes(a ^ b for a, b in zip(client_key, signature, strict=True))
        self._server_signature = _hmac(_hmac(salted, b"Server Key"), auth_message)
        return f"{without_proof},p={base64.b64encode(proof).decode()}".encode()

    def verify_server_final(self, server_final: bytes) -> None:
        text = server_final.decode(errors="replace")
        if text.startswith("e="):
            raise ConnectError(None, f"SCRAM: the server refused: {text[2:]}")
        if (
            self._server_signature is None
            or not text.startswith("v=")
            or not hmac.compare_digest(base64.b64decode(text[2:]), self._server_signature)
        ):
            raise ConnectError(None, "SCRAM: the server's signature is wrong")
        self._verified = True

    @property
    def verified(self) -> bool:
        """Whether the server proved that it knows the password."""
        return self._verified


def _hmac(key: bytes, data: bytes) -> bytes:
    return hmac.new(key, data, hashlib.sha256).digest()


def _saslprep(password: str) -> str:
    """RFC 4013 as Postgres applies it: a password SASLprep rejects is used as it is."""
    if password.isascii():
        return password  # SASLprep leaves ASCII as it is, or rejects it (then: as it is)
    mapped = "".join(
        " " if stringprep.in_table_c12(c) else c for c in password if not stringprep.in_table_b1(c)
    )
    text = unicodedata.normalize("NFKC", mapped)
    prohibited = (
        stringprep.in_table_a1,
        stringprep.in_table_c12,
        stringprep.in_table_c21_c22,
        stringprep.in_table_c3,
        stringprep.in_table_c4,
        stringprep.in_table_c5,
        stringprep.in_table_c6,
        stringprep.in_table_c7,
        stringprep.in_table_c8,
        stringprep.in_table_c9,
    )
    if not text or any(check(c) for c in text for check in prohibited):
        return password
    if any(stringprep.in_table_d1(c) for c in text) and (
        any(stringprep.in_table_d2(c) for c in text)
        or not (stringprep.in_table_d1(text[0]) and stringprep.in_table_d1(text[-1]))
    ):
        return password
    return text


# -- the startup conversation ------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TlsSession:
    """What the TLS handshake established: whether the server's certificate chain was
    verified, and its ``tls-server-end-point`` data for channel binding."""

    verified: bool
    end_point: bytes | None


# What the messages name the server's requests (libpq's wording).
_CLEARTEXT: Final = "a cleartext password"
_MD5: Final = "a hashed password"
_SASL: Final = "SASL authentication"


class Startup:
    """StartupMessage, authentication, parameters, the backend's key, ReadyForQuery.

    ``receive`` takes each server message and returns what to answer (b"" for
    nothing); ``ready`` turns true at ReadyForQuery. Server errors, methods we do not
    implement or may not use, and messages that do not parse raise
    :class:`ConnectError`. ``tls`` is the session when the connection is TLS."""

    def __init__(
        self, params: ConnParams, host: str, port: int, *, tls: TlsSession | None = None
    ) -> None:
        self._params = params
        self._host, self._port = host, port
        self._tls = tls
        self._scram: ScramSha256 | None = None
        self._method: str | None = None  # the method the server used, once it asked
        self._ok = False  # AuthenticationOk came
        self.ready = False
        self.backend_pid = 0
        self.parameters: dict[str, str] = {}

    def message(self) -> bytes:
        p = self._params
        pairs = {
            "user": p.user,
            "database": p.dbname,
            "replication": "database",
            "client_encoding": "UTF8",
        }
        if p.application_name:
            pairs["application_name"] = p.application_name
        if p.options:
            pairs["options"] = p.options
        body = struct.pack("!I", PROTOCOL_3_0)
        body += b"".join(_cstring(k) + _cstring(v) for k, v in pairs.items()) + b"\x00"
        return struct.pack("!I", len(body) + 4) + body

    async def receive(self, kind: int, body: bytes) -> bytes:
        try:
            return await self._receive(kind, body)
        except (ValueError, struct.error) as e:  # also UnicodeDecodeError, binascii.Error
            raise ConnectError(
                None, f"malformed {chr(kind)!r} message from the server during startup"
            ) from e

    async def _receive(self, kind: int, body: bytes) -> bytes:
        if kind == ord("R"):
            return await self._authenticate(body)
        if kind == ord("S"):
            name, value, _ = body.split(b"\x00", 2)
            self.parameters[name.decode()] = value.decode(errors="replace")
        elif kind == ord("K"):
            (self.backend_pid,) = struct.unpack_from("!I", body)
        elif kind == ord("Z"):
            if not self._ok:
                raise ConnectError(None, "the server sent ReadyForQuery before authentication")
            self.ready = True
        elif kind == ord("E"):
            fields = error_fields(body)
            raise ConnectError(fields.get("C"), describe(fields))
        elif kind == ord("N"):
            log.info("Postgres: %s", describe(error_fields(body)))
        else:
            raise ConnectError(None, f"unexpected message {chr(kind)!r} during startup")
        return b""

    async def _authenticate(self, body: bytes) -> bytes:
        (code,) = struct.unpack_from("!I", body)
        data = body[4:]
        if self._ok:
            raise ConnectError(
                None, f"the server sent authentication request {code} after it ended"
            )
        if code == 0:
            self._authenticated()
            return b""
        if code == 3:
            password = self._password_over_this_connection("password", _CLEARTEXT)
            return message(b"p", _cstring(password))
        if code == 5:
            if len(data) != 4:
                raise ValueError("the MD5 salt is not 4 bytes")
            password = self._password_over_this_connection("md5", _MD5)
            return message(b"p", md5_password(self._params.user, password, data) + b"\x00")
        if code == 10:
            return self._start_scram([m.decode() for m in data.split(b"\x00") if m])
        scram = self._scram
        if code == 11 and scram is not None and not scram.started_final:
            return message(b"p", await scram.client_final(data))
        if code == 12 and scram is not None and scram.started_final and not scram.verified:
            scram.verify_server_final(data)
            return b""
        if code in (11, 12):
            raise ConnectError(None, f"the server sent SASL step {code} out of order")
        name = _AUTH_NAMES.get(code, f"request {code}")
        raise ConnectError(
            None, f"authentication method {name} is not supported by the replication connection"
        )

    def _authenticated(self) -> None:
        """AuthenticationOk: refused unless what happened is what we allow."""
        p = self._params
        if self._scram is not None and not self._scram.verified:
            raise ConnectError(None, "the server ended SCRAM before proving it knows the password")
        if p.channel_binding == "require" and not (self._scram is not None and self._scram.bound):
            raise ConnectError(
                None,
                "channel binding required, but server authenticated client without channel binding",
            )
        if self._method is None:  # trust: no password asked for
            if "none" not in p.auth.allowed:
                raise ConnectError(
                    None,
                    f'authentication method requirement "{p.auth.spec}" failed: '
                    "server did not complete authentication",
                )
            self._method = "none"
        self._ok = True

    def _password_over_this_connection(self, method: str, requested: str) -> str:
        """The password for a cleartext or MD5 request, if this connection may carry it."""
        p = self._params
        if self._method is not None:
            raise ConnectError(
                None, f"the server asked for {requested} after {self._method} authentication began"
            )
        p.auth.check(method, requested)
        if p.channel_binding == "require":
            raise ConnectError(
                None, f"channel binding required, but the server asked for {requested}"
            )
        verified = self._tls is not None and self._tls.verified
        if not (verified or is_local(self._host) or method in p.auth.named):
            over = "TLS without a verified server" if self._tls is not None else "no TLS"
            raise ConnectError(
                None,
                f"the server asks for {requested} over a connection whose server is not "
                f"verified ({over}): whoever answers in its place would get the password; "
                f"use sslmode=verify-full, or allow it with require_auth={method}",
            )
        self._method = method
        return self._password(requested)

    def _start_scram(self, mechanisms: list[str]) -> bytes:
        p = self._params
        if self._method is not None:
            raise ConnectError(
                None, f"the server asked for {_SASL} after {self._method} authentication began"
            )
        p.auth.check("scram-sha-256", _SASL)
        end_point = self._tls.end_point if self._tls is not None else None
        if p.channel_binding == "disable":
            end_point = None
        plus = ScramSha256.MECHANISM_PLUS in mechanisms
        if p.channel_binding == "require":
            if self._tls is None:
                raise ConnectError(None, "channel binding required, but SSL not in use")
            if not plus:
                raise ConnectError(
                    None,
                    "channel binding is required, but server did not offer an authentication "
                    "method that supports channel binding",
                )
            if end_point is None:
                raise ConnectError(
                    None,
                    "channel binding is required, but the server certificate's signature "
                    "algorithm has no hash for tls-server-end-point",
                )
        if plus and end_point is not None:
            self._scram = ScramSha256(self._password(_SASL), binding=end_point)
        elif ScramSha256.MECHANISM in mechanisms:
            self._scram = ScramSha256(
                self._password(_SASL), could_bind=end_point is not None and not plus
            )
        else:
            raise ConnectError(
                None,
                f"none of the server's SASL mechanisms {mechanisms} is supported "
                f"(only {ScramSha256.MECHANISM} and, over TLS, {ScramSha256.MECHANISM_PLUS})",
            )
        self._method = "scram-sha-256"
        first = self._scram.client_first()
        mechanism = self._scram.mechanism
        return message(b"p", _cstring(mechanism) + struct.pack("!i", len(first)) + first)

    def _password(self, method: str) -> str:
        p = self._params
        password = p.password or password_from_file(
            p.passfile, self._host, self._port, p.dbname, p.user
        )
        if password is None:
            raise ConnectError(
                None,
                f"the server asks for {method} and none was given "
                "(in the connection string, PGPASSWORD or the password file)",
            )
        return password
