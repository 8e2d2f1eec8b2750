"""Getting a replication connection established: conninfo, TLS, startup and authentication.

Everything here is sans-I/O (``connection`` does the reading and writing): what the
connection string and the environment ask for (:func:`parse_conninfo`), the TLS
context (:func:`ssl_context`), and the startup conversation as a state machine
(:class:`Startup`: each server message in, the bytes to answer out).

Supported, as libpq does it:

* conninfo as a URL or ``key=value`` (``psycopg.conninfo.conninfo_to_dict``); what it
  leaves out comes from libpq's own defaults table (``PQconndefaults``: ``PGHOST``,
  ``PGPORT``, ``PGUSER`` (else the OS user), ``PGPASSWORD``, ``PGDATABASE`` (else the
  user), ``PGSSLMODE``, ``PGAPPNAME``, ``PGOPTIONS``, ``PGCONNECT_TIMEOUT``, ...);
  the password file (``passfile`` / ``PGPASSFILE`` / ``~/.pgpass``, ignored when
  group- or world-readable);
* several hosts (``host=a,b port=1,2``), tried in order; a host starting with ``/``
  is a Unix socket directory, no host the default one;
* ``sslmode`` disable / allow / prefer / require / verify-ca / verify-full with
  ``sslrootcert`` (``system``: the default CA store), ``sslcert``, ``sslkey``
  (defaults under ``~/.postgresql/``), ``ssl_min_protocol_version`` and
  ``ssl_max_protocol_version``; as in libpq, a root certificate that exists makes
  even ``require`` verify the server's chain; no TLS on Unix sockets;
* authentication: trust, cleartext password, MD5, SCRAM-SHA-256 (without channel
  binding: ``channel_binding=require`` is refused).

Refused with a clear :class:`ConnectError`: every other option with a value
(``service``, ``hostaddr``, ``require_auth``, ``sslcrl``, ``sslpassword``,
``target_session_attrs`` other than ``any``, ``gssencmode=require``, a client
encoding other than UTF-8, ...), and Kerberos, GSSAPI, SSPI or SCM authentication.
Options that only tune what we do not do (TCP keepalives, ``sslsni``,
``krbsrvname``...) are accepted and ignored.
"""

from __future__ import annotations

import base64
import getpass
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

import psycopg
from psycopg import pq
from psycopg.conninfo import conninfo_to_dict

from app.sources.base import ChangeSourceError

__all__ = [
    "SSL_REQUEST",
    "TERMINATE",
    "ConnParams",
    "ConnectError",
    "ScramSha256",
    "Startup",
    "describe",
    "error_fields",
    "md5_password",
    "message",
    "parse_conninfo",
    "password_from_file",
    "ssl_context",
]

log = logging.getLogger(__name__)

PROTOCOL_3_0: Final = 196608
SSL_REQUEST: Final = struct.pack("!II", 8, 80877103)
TERMINATE: Final = b"X\x00\x00\x00\x04"
DEFAULT_PORT: Final = 5432
SSLMODES: Final = ("disable", "allow", "prefer", "require", "verify-ca", "verify-full")

# Options this module implements.
_USED: Final = frozenset(
    {
        "host",
        "port",
        "user",
        "password",
        "passfile",
        "dbname",
        "connect_timeout",
        "application_name",
        "fallback_application_name",
        "options",
        "sslmode",
        "sslrootcert",
        "sslcert",
        "sslkey",
        "ssl_min_protocol_version",
        "ssl_max_protocol_version",
    }
)
# Options that tune only what we do not do: accepted, and without effect.
_IGNORED: Final = frozenset(
    {
        "keepalives",
        "keepalives_idle",
        "keepalives_interval",
        "keepalives_count",
        "tcp_user_timeout",
        "sslcompression",
        "sslsni",
        "krbsrvname",
        "gsslib",
        "gssdelegation",
    }
)
# Options accepted only with these values (libpq's defaults and their equivalents).
_ACCEPTED: Final[Mapping[str, frozenset[str]]] = {
    "replication": frozenset({"database"}),
    "client_encoding": frozenset({"utf8", "utf-8", "unicode"}),
    "channel_binding": frozenset({"disable", "prefer"}),
    "gssencmode": frozenset({"disable", "prefer"}),
    "target_session_attrs": frozenset({"any"}),
    "load_balance_hosts": frozenset({"disable"}),
    "sslnegotiation": frozenset({"postgres"}),
    "sslcertmode": frozenset({"allow"}),
    "min_protocol_version": frozenset({"3.0"}),
    "max_protocol_version": frozenset({"3.0"}),
}
_TLS_VERSIONS: Final[Mapping[str, ssl.TLSVersion]] = {
    "tlsv1": ssl.TLSVersion.TLSv1,
    "tlsv1.1": ssl.TLSVersion.TLSv1_1,
    "tlsv1.2": ssl.TLSVersion.TLSv1_2,
    "tlsv1.3": ssl.TLSVersion.TLSv1_3,
}
_AUTH_NAMES: Final[Mapping[int, str]] = {
    2: "Kerberos V5",
    6: "SCM credentials",
    7: "GSSAPI",
    8: "GSSAPI",
    9: "SSPI",
}


class ConnectError(ChangeSourceError):
    """The replication connection could not be made; ``sqlstate`` is the server's, if it said."""

    def __init__(self, sqlstate: str | None, message: str) -> None:
        super().__init__(message)
        self.sqlstate = sqlstate


@dataclass(frozen=True, slots=True)
class ConnParams:
    """A connection string with libpq's defaults applied."""

    hosts: tuple[tuple[str, int], ...]  # (name, address or socket directory; port)
    user: str
    dbname: str
    password: str | None
    passfile: str
    application_name: str | None
    options: str | None
    sslmode: str
    sslrootcert: str
    sslcert: str
    sslkey: str
    ssl_min_version: ssl.TLSVersion
    ssl_max_version: ssl.TLSVersion | None
    connect_timeout_s: float | None


def default_socket_dir() -> str:
    return "/var/run/postgresql" if os.path.isdir("/var/run/postgresql") else "/tmp"


def parse_conninfo(conninfo: str) -> ConnParams:
    try:
        given = conninfo_to_dict(conninfo)
    except psycopg.Error as e:
        raise ConnectError(None, f"invalid connection string: {e}") from e
    values = {
        o.keyword.decode(): o.val.decode() for o in pq.Conninfo.get_defaults() if o.val is not None
    }
    values.update({k: str(v) for k, v in given.items() if v is not None and str(v) != ""})
    for key, value in values.items():
        if key in _USED or key in _IGNORED or value.lower() in _ACCEPTED.get(key, ()):
            continue
        shown = f"{key}={value!r}" if key in _ACCEPTED else key  # not a secret's value
        raise ConnectError(None, f"the replication connection does not support {shown}")

    hosts = values.get("host", "").split(",")
    ports = values.get("port", "").split(",")
    if len(ports) == 1:
        ports *= len(hosts)
    if len(ports) != len(hosts):
        raise ConnectError(None, f"could not match {len(ports)} port numbers to {len(hosts)} hosts")
    try:
        targets = tuple(
            (host or default_socket_dir(), int(port) if port else DEFAULT_PORT)
            for host, port in zip(hosts, ports, strict=True)
        )
    except ValueError as e:
        raise ConnectError(None, f"invalid port number in {values.get('port')!r}") from e

    sslmode = values.get("sslmode", "prefer")
    if sslmode not in SSLMODES:
        raise ConnectError(None, f"invalid sslmode value: {sslmode!r}")
    try:
        timeout = int(values.get("connect_timeout") or 0)
    except ValueError as e:
        raise ConnectError(None, f"invalid connect_timeout {values['connect_timeout']!r}") from e
    tls_min = values.get("ssl_min_protocol_version", "TLSv1.2")
    tls_max = values.get("ssl_max_protocol_version")
    for version in (tls_min, tls_max):
        if version is not None and version.lower() not in _TLS_VERSIONS:
            raise ConnectError(None, f"invalid SSL protocol version {version!r}")
    home = os.path.expanduser("~")
    user = values.get("user") or getpass.getuser()
    return ConnParams(
        hosts=targets,
        user=user,
        dbname=values.get("dbname") or user,
        password=values.get("password"),
        passfile=values.get("passfile") or os.path.join(home, ".pgpass"),
        application_name=values.get("application_name") or values.get("fallback_application_name"),
        options=values.get("options") or None,
        sslmode=sslmode,
        sslrootcert=values.get("sslrootcert") or os.path.join(home, ".postgresql", "root.crt"),
        sslcert=values.get("sslcert") or os.path.join(home, ".postgresql", "postgresql.crt"),
        sslkey=values.get("sslkey") or os.path.join(home, ".postgresql", "postgresql.key"),
        ssl_min_version=_TLS_VERSIONS[tls_min.lower()],
        ssl_max_version=None if tls_max is None else _TLS_VERSIONS[tls_max.lower()],
        # libpq: 0 or less waits forever, and less than 2 s is 2 s.
        connect_timeout_s=None if timeout <= 0 else float(max(timeout, 2)),
    )


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
            ctx.load_cert_chain(params.sslcert, params.sslkey)
    except (OSError, ssl.SSLError) as e:
        raise ConnectError(None, f"could not set up TLS: {e}") from e
    return ctx


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
    """The client side of SCRAM-SHA-256 without channel binding (gs2 header ``n,,``).

    Postgres takes the user from the startup message and ignores SCRAM's, so it is
    empty unless given (RFC 7677's example names one)."""

    MECHANISM: Final = "SCRAM-SHA-256"

    def __init__(self, password: str, *, user: str = "", nonce: str | None = None) -> None:
        self._password = _saslprep(password).encode()
        self._nonce = nonce or base64.b64encode(secrets.token_bytes(18)).decode()
        name = user.replace("=", "=3D").replace(",", "=2C")
        self._first_bare = f"n={name},r={self._nonce}"
        self._server_signature: bytes | None = None
        self._verified = False

    def client_first(self) -> bytes:
        return ("n,," + self._first_bare).encode()

    def client_final(self, server_first: bytes) -> bytes:
        text = server_first.decode()
        attrs = dict(part.split("=", 1) for part in text.split(",") if "=" in part)
        nonce, salt, iterations = attrs.get("r", ""), attrs.get("s"), int(attrs.get("i", "0"))
        if not nonce.startswith(self._nonce) or len(nonce) == len(self._nonce):
            raise ConnectError(None, "SCRAM: the server's nonce does not extend ours")
        if salt is None or iterations <= 0:
            raise ConnectError(None, f"SCRAM: malformed server-first-message {text!r}")
        salted = hashlib.pbkdf2_hmac("sha256", self._password, base64.b64decode(salt), iterations)
        client_key = _hmac(salted, b"Client Key")
        without_proof = f"c=biws,r={nonce}"
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


class Startup:
    """StartupMessage, authentication, parameters, the backend's key, ReadyForQuery.

    ``receive`` takes each server message and returns what to answer (b"" for
    nothing); ``ready`` turns true at ReadyForQuery. Server errors and methods we do
    not implement raise :class:`ConnectError`."""

    def __init__(self, params: ConnParams, host: str, port: int) -> None:
        self._params = params
        self._host, self._port = host, port
        self._scram: ScramSha256 | None = None
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

    def receive(self, kind: int, body: bytes) -> bytes:
        if kind == ord("R"):
            return self._authenticate(body)
        if kind == ord("S"):
            name, value, _ = body.split(b"\x00", 2)
            self.parameters[name.decode()] = value.decode(errors="replace")
        elif kind == ord("K"):
            (self.backend_pid,) = struct.unpack_from("!I", body)
        elif kind == ord("Z"):
            self.ready = True
        elif kind == ord("E"):
            fields = error_fields(body)
            raise ConnectError(fields.get("C"), describe(fields))
        elif kind == ord("N"):
            log.info("Postgres: %s", describe(error_fields(body)))
        else:
            raise ConnectError(None, f"unexpected message {chr(kind)!r} during startup")
        return b""

    def _authenticate(self, body: bytes) -> bytes:
        (code,) = struct.unpack_from("!I", body)
        data = body[4:]
        if code == 0:
            if self._scram is not None and not self._scram.verified:
                raise ConnectError(
                    None, "the server ended SCRAM before proving it knows the password"
                )
            return b""
        if code == 3:
            return message(b"p", _cstring(self._password("a cleartext password")))
        if code == 5:
            password = self._password("an MD5 password")
            return message(b"p", md5_password(self._params.user, password, data[:4]) + b"\x00")
        if code == 10:
            mechanisms = [m.decode() for m in data.split(b"\x00") if m]
            if ScramSha256.MECHANISM not in mechanisms:
                raise ConnectError(
                    None,
                    f"none of the server's SASL mechanisms {mechanisms} is supported "
                    f"(only {ScramSha256.MECHANISM})",
                )
            self._scram = ScramSha256(self._password("SCRAM-SHA-256"))
            first = self._scram.client_first()
            return message(
                b"p", _cstring(ScramSha256.MECHANISM) + struct.pack("!i", len(first)) + first
            )
        if code == 11 and self._scram is not None:
            return message(b"p", self._scram.client_final(data))
        if code == 12 and self._scram is not None:
            self._scram.verify_server_final(data)
            return b""
        name = _AUTH_NAMES.get(code, f"request {code}")
        raise ConnectError(
            None, f"authentication method {name} is not supported by the replication connection"
        )

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
