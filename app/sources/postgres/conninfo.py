"""The upstream connection string, read once for both kinds of connection.

``ZERO_UPSTREAM_DB`` reaches Postgres two ways: our replication client
(``pgwire`` + ``connection``) and libpq (psycopg) for everything else. Both read it
here. :func:`parse_conninfo` is the one parser: it applies libpq's defaults
(``PQconndefaults``: the ``PG*`` environment, the OS user, ...) and refuses, with a
:class:`ConnectError` naming the option, whatever the replication client cannot
honour. :func:`connect` and :func:`async_connect` are the only way app code opens a
libpq connection to the upstream: the same parser first (so a string one kind
refuses, the other refuses too, with the same message), then psycopg is handed the
options this client chose where libpq's own default differs (:func:`libpq_conninfo`).

What is shared, and what libpq keeps doing itself, is in docs/postgres-connection.md.
"""

from __future__ import annotations

import getpass
import ipaddress
import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

import psycopg
from psycopg import pq
from psycopg.conninfo import conninfo_to_dict, make_conninfo
from psycopg.rows import TupleRow

from app.sources.base import ChangeSourceError

__all__ = [
    "AUTH_METHODS",
    "CONNECT_TIMEOUT_S",
    "AuthPolicy",
    "ConnParams",
    "ConnectError",
    "Keepalives",
    "async_connect",
    "connect",
    "default_socket_dir",
    "is_local",
    "libpq_conninfo",
    "parse_conninfo",
]

# A connection attempt (each host) waits this long when connect_timeout does not say.
CONNECT_TIMEOUT_S: Final = 30

DEFAULT_PORT: Final = 5432
SSLMODES: Final = ("disable", "allow", "prefer", "require", "verify-ca", "verify-full")
AUTH_METHODS: Final = ("password", "md5", "scram-sha-256", "gss", "sspi", "none")
CHANNEL_BINDINGS: Final = ("disable", "prefer", "require")

# Options the replication client implements.
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
        "require_auth",
        "channel_binding",
        "keepalives",
        "keepalives_idle",
        "keepalives_interval",
        "keepalives_count",
        "tcp_user_timeout",
    }
)
# Options that tune only what we do not do: accepted, and without effect.
_IGNORED: Final = frozenset(
    {
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


class ConnectError(ChangeSourceError):
    """The connection string was refused (by either kind of connection), or the
    replication connection could not be made; ``sqlstate`` is the server's, if it said."""

    def __init__(self, sqlstate: str | None, message: str) -> None:
        super().__init__(message)
        self.sqlstate = sqlstate


@dataclass(frozen=True, slots=True)
class AuthPolicy:
    """``require_auth``: the methods the server may use (``none``: no authentication)."""

    spec: str | None  # as given, for messages (None: not given, everything allowed)
    allowed: frozenset[str]
    named: frozenset[str]  # listed without ``!``: the operator asked for exactly these

    def check(self, method: str, requested: str) -> None:
        if method not in self.allowed:
            raise ConnectError(
                None,
                f'authentication method requirement "{self.spec}" failed: '
                f"server requested {requested}",
            )


@dataclass(frozen=True, slots=True)
class Keepalives:
    """TCP keepalives: on unless ``keepalives=0``, as libpq. Unlike libpq, the
    timings default to a dead peer noticed within about two minutes (60 s idle,
    then 6 probes 10 s apart) rather than the system's two hours: a server with
    ``wal_sender_timeout=0`` sends nothing while idle, and a host that vanished
    without a FIN would otherwise hold the stream for hours."""

    enabled: bool = True
    idle_s: int = 60
    interval_s: int = 10
    count: int = 6
    user_timeout_ms: int | None = None  # tcp_user_timeout; None: the system's


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
    auth: AuthPolicy = AuthPolicy(None, frozenset(AUTH_METHODS), frozenset())
    channel_binding: str = "prefer"
    keepalives: Keepalives = Keepalives()


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
    given_values = {k: str(v) for k, v in given.items() if v is not None and str(v) != ""}
    values.update(given_values)
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

    home = os.path.expanduser("~")
    sslrootcert = values.get("sslrootcert") or os.path.join(home, ".postgresql", "root.crt")
    sslmode = _sslmode(values, sslrootcert, explicit="sslmode" in given_values)
    channel_binding = values.get("channel_binding", "prefer")
    if channel_binding not in CHANNEL_BINDINGS:
        raise ConnectError(None, f'invalid channel_binding value: "{channel_binding}"')
    if channel_binding == "require" and sslmode == "disable":
        raise ConnectError(None, 'channel_binding=require needs TLS, but sslmode is "disable"')
    timeout = _integer(values, "connect_timeout") or 0
    tls_min = values.get("ssl_min_protocol_version", "TLSv1.2")
    tls_max = values.get("ssl_max_protocol_version")
    for version in (tls_min, tls_max):
        if version is not None and version.lower() not in _TLS_VERSIONS:
            raise ConnectError(None, f"invalid SSL protocol version {version!r}")
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
        sslrootcert=sslrootcert,
        sslcert=values.get("sslcert") or os.path.join(home, ".postgresql", "postgresql.crt"),
        sslkey=values.get("sslkey") or os.path.join(home, ".postgresql", "postgresql.key"),
        ssl_min_version=_TLS_VERSIONS[tls_min.lower()],
        ssl_max_version=None if tls_max is None else _TLS_VERSIONS[tls_max.lower()],
        # libpq: 0 or less waits forever, and less than 2 s is 2 s.
        connect_timeout_s=None if timeout <= 0 else float(max(timeout, 2)),
        auth=_require_auth(values.get("require_auth")),
        channel_binding=channel_binding,
        keepalives=_keepalives(values),
    )


def _sslmode(values: Mapping[str, str], sslrootcert: str, *, explicit: bool) -> str:
    """``sslmode``; with ``sslrootcert=system``, as libpq: verify-full unless set, and
    nothing weaker (the system's CAs sign certificates for anyone's host name)."""
    explicit = explicit or bool(os.environ.get("PGSSLMODE"))
    sslmode = values.get("sslmode", "prefer")
    if sslmode not in SSLMODES:
        raise ConnectError(None, f"invalid sslmode value: {sslmode!r}")
    if sslrootcert == "system":
        if not explicit:
            return "verify-full"
        if sslmode != "verify-full":
            raise ConnectError(
                None,
                f'weak sslmode "{sslmode}" may not be used with sslrootcert=system '
                '(use "verify-full")',
            )
    return sslmode


def _keepalives(values: Mapping[str, str]) -> Keepalives:
    default = Keepalives()
    idle, interval, count = (
        _integer(values, key)
        for key in ("keepalives_idle", "keepalives_interval", "keepalives_count")
    )
    return Keepalives(
        enabled=_integer(values, "keepalives") != 0,
        # libpq: 0 (or less) is the system's default; ours is the class's.
        idle_s=idle if idle is not None and idle > 0 else default.idle_s,
        interval_s=interval if interval is not None and interval > 0 else default.interval_s,
        count=count if count is not None and count > 0 else default.count,
        user_timeout_ms=_integer(values, "tcp_user_timeout"),
    )


def _integer(values: Mapping[str, str], key: str) -> int | None:
    text = values.get(key)
    if text is None:
        return None
    try:
        return int(text.strip())
    except ValueError:
        raise ConnectError(
            None, f'invalid integer value "{text}" for connection option "{key}"'
        ) from None


def _require_auth(spec: str | None) -> AuthPolicy:
    """libpq's ``require_auth``: ``md5,scram-sha-256`` allows those; ``!password,!md5``
    allows all but those; one or the other, each method once."""
    if not spec:
        return AuthPolicy(None, frozenset(AUTH_METHODS), frozenset())
    negated = spec.startswith("!")
    seen: set[str] = set()
    for item in spec.split(","):
        name = item[1:] if item.startswith("!") else item
        if item.startswith("!") != negated:
            kind = "negative" if item.startswith("!") else "non-negative"
            other = "non-negative" if item.startswith("!") else "negative"
            raise ConnectError(
                None, f'{kind} require_auth method "{item}" cannot be mixed with {other} methods'
            )
        if name not in AUTH_METHODS:
            raise ConnectError(None, f'invalid require_auth value: "{name}"')
        if name in seen:
            raise ConnectError(None, f'require_auth method "{name}" is specified more than once')
        seen.add(name)
    if negated:
        return AuthPolicy(spec, frozenset(AUTH_METHODS) - seen, frozenset())
    return AuthPolicy(spec, frozenset(seen), frozenset(seen))


def is_local(host: str) -> bool:
    """A Unix socket directory or a loopback address: no network between us and it."""
    if host.startswith("/") or host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# -- the libpq connections ---------------------------------------------------------


def libpq_conninfo(conninfo: str, **options: str | int) -> str:
    """The connection string psycopg gets for ``conninfo``: validated by
    :func:`parse_conninfo`, with this client's choices where libpq's default differs.

    ``options`` are the caller's keywords, which win as psycopg's own do, except
    ``options`` (server settings), which is added to the string's rather than
    replacing it. ``replication`` is left out: the string's may only be
    ``database`` (for our client), and a libpq connection asks for it by keyword."""
    params = parse_conninfo(conninfo)
    values: dict[str, str | int | None] = {
        k: v for k, v in conninfo_to_dict(conninfo).items() if k != "replication"
    }
    values["sslmode"] = params.sslmode  # e.g. verify-full under sslrootcert=system
    values["gssencmode"] = "disable"  # our client has no GSS encryption
    values["connect_timeout"] = int(params.connect_timeout_s or CONNECT_TIMEOUT_S)
    if params.keepalives.enabled:
        values["keepalives_idle"] = params.keepalives.idle_s
        values["keepalives_interval"] = params.keepalives.interval_s
        values["keepalives_count"] = params.keepalives.count
    require_auth = _libpq_require_auth(params)
    if require_auth is not None:
        values["require_auth"] = require_auth
    extra = options.pop("options", None)
    if extra is not None:
        values["options"] = " ".join(str(o) for o in (values.get("options"), extra) if o)
    values.update(options)
    return make_conninfo("", **values)


def _libpq_require_auth(params: ConnParams) -> str | None:
    """``require_auth`` for libpq, with our password rule (a cleartext or MD5 password
    only to a local server, over verified TLS, or when named) as far as a libpq
    option can say it: for the whole host list, before knowing how TLS went."""
    if params.auth.named or _password_safe(params):
        return params.auth.spec
    refused = [m for m in AUTH_METHODS if m not in params.auth.allowed or m in _PASSWORDS]
    return ",".join(f"!{m}" for m in refused)


_PASSWORDS: Final = frozenset({"password", "md5"})


def _password_safe(params: ConnParams) -> bool:
    """Whether every host is local or the TLS with each is sure to be verified
    (libpq, as ours, verifies the chain under ``require`` when a root certificate
    exists; ``allow`` and ``prefer`` may end up without TLS)."""
    if all(is_local(host) for host, _ in params.hosts):
        return True
    if params.sslmode in ("verify-ca", "verify-full"):
        return True
    return params.sslmode == "require" and os.path.exists(params.sslrootcert)


def connect(
    conninfo: str, *, autocommit: bool = False, **options: str | int
) -> psycopg.Connection[TupleRow]:
    """A blocking libpq connection to the upstream (see :func:`libpq_conninfo`)."""
    return psycopg.connect(libpq_conninfo(conninfo, **options), autocommit=autocommit)


async def async_connect(
    conninfo: str, *, autocommit: bool = False, **options: str | int
) -> psycopg.AsyncConnection[TupleRow]:
    """An asyncio libpq connection to the upstream (see :func:`libpq_conninfo`)."""
    return await psycopg.AsyncConnection.connect(
        libpq_conninfo(conninfo, **options), autocommit=autocommit
    )
