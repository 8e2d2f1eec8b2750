"""One connection string, two clients.

First the options as ``parse_conninfo`` reads them (libpq's syntax, defaults and
refusals). Then both clients against one string: libpq (``conninfo.connect`` and
``async_connect``) and our replication client refuse the same strings with the same
message and apply the same defaults (docs/postgres-connection.md, "One parser for
both")."""

from __future__ import annotations

import asyncio
import os
import pwd
import re
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from app.sources.postgres.connection import ReplicationConnection
from app.sources.postgres.conninfo import (
    ConnectError,
    Keepalives,
    async_connect,
    connect,
    default_socket_dir,
    libpq_conninfo,
    parse_conninfo,
)
from tests.sources.postgres.test_connection import Inbox, auth, fake_server

# Every test here: no PG* variable, ~/.pgpass or ~/.postgresql of whoever runs them.
pytestmark = pytest.mark.usefixtures("clean_environment")


# -- the options, as libpq reads them ------------------------------------------------


def test_a_url_and_key_value_pairs_give_the_same_parameters() -> None:
    url = parse_conninfo(
        "postgres://u:p%40ss@db.example:6000/app?sslmode=require&application_name=x"
    )
    kv = parse_conninfo(
        "host=db.example port=6000 user=u password=p@ss dbname=app sslmode=require "
        "application_name=x"
    )
    assert url == kv
    assert url.hosts == (("db.example", 6000),)
    assert (url.user, url.password, url.dbname, url.sslmode) == ("u", "p@ss", "app", "require")


def test_what_the_conninfo_leaves_out_comes_from_libpqs_environment_variables(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for name, value in {
        "PGHOST": "envhost",
        "PGPORT": "6543",
        "PGUSER": "envuser",
        "PGPASSWORD": "envpass",
        "PGDATABASE": "envdb",
        "PGSSLMODE": "verify-full",
        "PGAPPNAME": "envapp",
        "PGCONNECT_TIMEOUT": "1",
        "PGOPTIONS": "-c work_mem=64MB",
    }.items():
        monkeypatch.setenv(name, value)
    params = parse_conninfo("dbname=given")
    assert params.hosts == (("envhost", 6543),)
    assert (params.user, params.password, params.dbname) == ("envuser", "envpass", "given")
    assert (params.sslmode, params.application_name) == ("verify-full", "envapp")
    assert params.options == "-c work_mem=64MB"
    assert params.connect_timeout_s == 2  # libpq's minimum


def test_without_a_host_the_default_unix_socket_is_used_and_the_db_is_named_after_the_user() -> (
    None
):
    params = parse_conninfo("user=someone")
    assert params.hosts == ((default_socket_dir(), 5432),)
    assert params.dbname == "someone"
    assert params.sslmode == "prefer"
    assert params.connect_timeout_s is None
    assert parse_conninfo("").user == pwd.getpwuid(os.geteuid()).pw_name


def test_several_hosts_are_tried_with_their_ports() -> None:
    assert parse_conninfo("host=a,b,/run/pg port=1,2,3").hosts == (
        ("a", 1),
        ("b", 2),
        ("/run/pg", 3),
    )
    assert parse_conninfo("postgres://a,b:7/db").hosts == (("a", 5432), ("b", 7))
    assert parse_conninfo("host=a,b port=9").hosts == (("a", 9), ("b", 9))
    with pytest.raises(ConnectError, match="could not match 2 port numbers to 3 hosts"):
        parse_conninfo("host=a,b,c port=1,2")


@pytest.mark.parametrize(
    ("conninfo", "refused"),
    [
        ("service=mine", "service$"),
        ("hostaddr=10.0.0.1", "hostaddr$"),
        ("sslpassword=secret", "sslpassword$"),
        ("target_session_attrs=read-write", "target_session_attrs='read-write'"),
        ("client_encoding=LATIN1", "client_encoding='LATIN1'"),
    ],
)
def test_options_that_would_change_the_connection_are_refused_by_name(
    conninfo: str, refused: str
) -> None:
    with pytest.raises(ConnectError, match=f"does not support {refused}"):
        parse_conninfo(conninfo)


def test_options_that_only_tune_what_we_do_not_do_are_accepted() -> None:
    parse_conninfo(
        "keepalives=1 keepalives_idle=30 sslsni=0 client_encoding=utf8 gssencmode=prefer"
    )
    with pytest.raises(ConnectError, match="invalid connection string"):
        parse_conninfo("no_such_option=1")
    with pytest.raises(ConnectError, match="invalid sslmode"):
        parse_conninfo("sslmode=sometimes")


@pytest.mark.parametrize(
    ("spec", "refusal"),
    [
        ("md5,!password", 'negative require_auth method "!password" cannot be mixed'),
        ("!md5,password", 'non-negative require_auth method "password" cannot be mixed'),
        ("md5,md5", 'require_auth method "md5" is specified more than once'),
        ("kerberos", 'invalid require_auth value: "kerberos"'),
    ],
)
def test_a_require_auth_libpq_would_refuse_is_refused(spec: str, refusal: str) -> None:
    with pytest.raises(ConnectError, match=refusal):
        parse_conninfo(f"require_auth={spec}")


def test_sslrootcert_system_means_verify_full_and_nothing_weaker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert parse_conninfo("sslrootcert=system").sslmode == "verify-full"
    assert parse_conninfo("sslrootcert=system sslmode=verify-full").sslmode == "verify-full"
    for weaker in ("disable", "allow", "prefer", "require", "verify-ca"):
        with pytest.raises(
            ConnectError,
            match=f'^weak sslmode "{weaker}" may not be used with sslrootcert=system',
        ):
            parse_conninfo(f"postgres://h/db?sslrootcert=system&sslmode={weaker}")
    monkeypatch.setenv("PGSSLMODE", "require")
    with pytest.raises(ConnectError, match='weak sslmode "require"'):
        parse_conninfo("sslrootcert=system")


def test_keepalives_and_their_timings_are_read_as_libpq_reads_them() -> None:
    assert parse_conninfo("").keepalives == Keepalives(True, 60, 10, 6, None)
    assert parse_conninfo("keepalives_idle=0").keepalives.idle_s == 60
    params = parse_conninfo(
        "keepalives=1 keepalives_idle=7 keepalives_interval=3 keepalives_count=4 "
        "tcp_user_timeout=9000"
    )
    assert params.keepalives == Keepalives(True, 7, 3, 4, 9000)
    assert not parse_conninfo("keepalives=0").keepalives.enabled
    with pytest.raises(
        ConnectError, match='invalid integer value "soon" for connection option "keepalives_idle"'
    ):
        parse_conninfo("keepalives_idle=soon")


# -- both clients, one string -------------------------------------------------------

REFUSED = [
    ("service=upstream", "the replication connection does not support service"),
    ("hostaddr=127.0.0.1", "the replication connection does not support hostaddr"),
    (
        "target_session_attrs=read-write",
        "the replication connection does not support target_session_attrs='read-write'",
    ),
    ("sslmode=verify", "invalid sslmode value: 'verify'"),
    ("sslmode=require sslrootcert=system", 'weak sslmode "require" may not be used'),
    ("require_auth=md5,!password", 'negative require_auth method "!password" cannot be mixed'),
    ("keepalives_idle=soon", 'invalid integer value "soon" for connection option'),
]


@pytest.mark.parametrize(("option", "message"), REFUSED)
async def test_a_string_the_replication_client_refuses_is_refused_by_every_connection(
    db_url: str, option: str, message: str
) -> None:
    """libpq would take ``service`` or ``hostaddr``; the replication connection then
    could not stream from that very string. Both refuse it, before any network."""
    conninfo = f"{db_url} {option}"
    errors = []
    attempts: list[Callable[[], Awaitable[object]]] = [
        lambda: ReplicationConnection.connect(conninfo),
        lambda: async_connect(conninfo, autocommit=True),
        lambda: asyncio.to_thread(connect, conninfo),
    ]
    for attempt in attempts:
        with pytest.raises(ConnectError, match=message) as refused:
            await attempt()
        errors.append(str(refused.value))
    assert len(set(errors)) == 1


async def test_the_default_keepalives_and_connect_timeout_are_libpqs_too(db_url: str) -> None:
    """libpq's own default is the system's keepalive timing (two hours idle) and no
    connect timeout; the replication client's (60 s, 10 s, 6 probes; 30 s) apply to
    both. test_connection checks the replication socket."""
    async with await async_connect(db_url, autocommit=True) as conn:
        sock = socket.socket(fileno=socket.dup(conn.pgconn.socket))
        try:
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 60
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL) == 10
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == 6
        finally:
            sock.close()
        assert conn.info.get_parameters()["connect_timeout"] == "30"
    given = make_conninfo(db_url, keepalives_idle=7, connect_timeout=5)
    with connect(given) as blocking:
        sock = socket.socket(fileno=socket.dup(blocking.pgconn.socket))
        try:
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == 7
        finally:
            sock.close()
        assert blocking.info.get_parameters()["connect_timeout"] == "5"
    assert parse_conninfo(given).keepalives.idle_s == 7
    assert parse_conninfo(given).connect_timeout_s == 5


def test_the_sslmode_chosen_is_the_one_libpq_gets(monkeypatch: pytest.MonkeyPatch) -> None:
    for conninfo, sslmode in [
        ("host=db.example", "prefer"),
        ("host=db.example sslrootcert=system", "verify-full"),
        ("host=db.example sslmode=disable", "disable"),
    ]:
        assert parse_conninfo(conninfo).sslmode == sslmode
        assert conninfo_to_dict(libpq_conninfo(conninfo))["sslmode"] == sslmode
    monkeypatch.setenv("PGSSLMODE", "require")
    assert parse_conninfo("host=db.example").sslmode == "require"
    assert conninfo_to_dict(libpq_conninfo("host=db.example"))["sslmode"] == "require"
    with pytest.raises(ConnectError, match='weak sslmode "require"'):
        libpq_conninfo("host=db.example sslrootcert=system")


async def ask_for_a_cleartext_password(inbox: Inbox, writer: asyncio.StreamWriter) -> None:
    """``fake_server``'s script: after its "no TLS", asks for a cleartext password
    and hangs up on the answer."""
    writer.write(auth(3))
    await inbox.next()
    writer.close()


def a_loopback_name() -> str:
    """A host name (not ``localhost``) for a loopback address: to the password rule,
    a host on the network."""
    name = socket.gethostname()
    try:
        addresses = {str(a[4][0]) for a in socket.getaddrinfo(name, None, socket.AF_INET)}
    except OSError:
        addresses = set()
    if name == "localhost" or not addresses or not all(a.startswith("127.") for a in addresses):
        pytest.skip(f"this machine's name {name!r} is not a loopback address")
    return name


async def test_no_connection_sends_a_password_in_the_clear_to_a_host_on_the_network() -> None:
    host = a_loopback_name()
    async with fake_server(ask_for_a_cleartext_password) as (port, received):
        conninfo = f"host={host} port={port} user=alice password=secret"
        with pytest.raises(ConnectError, match="cleartext password"):
            await ReplicationConnection.connect(conninfo)
        with pytest.raises(psycopg.OperationalError, match="server requested a cleartext"):
            await async_connect(conninfo)
        assert all(b"secret" not in m for m in received)
        # Named, the method is the operator's choice: both send it.
        with pytest.raises(ConnectError):
            await ReplicationConnection.connect(f"{conninfo} require_auth=password")
        with pytest.raises(psycopg.OperationalError):
            await async_connect(f"{conninfo} require_auth=password")
        assert sum(b"secret" in m for m in received) == 2


def test_the_password_rule_as_libpq_gets_it() -> None:
    def require_auth(conninfo: str) -> str | None:
        value = conninfo_to_dict(libpq_conninfo(conninfo)).get("require_auth")
        return None if value is None else str(value)

    assert require_auth("host=db.example") == "!password,!md5"
    assert require_auth("host=db.example sslmode=require") == "!password,!md5"
    assert require_auth("host=db.example require_auth=!scram-sha-256") == (
        "!password,!md5,!scram-sha-256"
    )
    assert require_auth("host=db.example,127.0.0.1") == "!password,!md5"
    # Local, verified or named: as given.
    assert require_auth("host=127.0.0.1") is None
    assert require_auth("host=/tmp,localhost") is None
    assert require_auth("host=db.example sslmode=verify-ca") is None
    assert require_auth("host=db.example sslrootcert=system") is None
    assert require_auth("host=db.example require_auth=md5") == "md5"


async def test_libpq_gets_an_ordinary_connection_and_keeps_the_strings_options(
    db_url: str,
) -> None:
    """``replication=database`` is for the replication client (a libpq connection
    asks for it by keyword), and a caller's ``options`` add to the string's."""
    conninfo = make_conninfo(db_url, replication="database", options="-c search_path=cs_x")
    async with await async_connect(
        conninfo, autocommit=True, options="-c statement_timeout=4321"
    ) as conn:
        cur = await conn.execute("SELECT %s::int, current_setting('search_path')", [7])
        assert await cur.fetchone() == (7, "cs_x")
        cur = await conn.execute("SHOW statement_timeout")
        assert await cur.fetchone() == ("4321ms",)
    async with await async_connect(conninfo, replication="database") as repl:
        cur = await repl.execute(b"IDENTIFY_SYSTEM")
        assert (await cur.fetchone()) is not None


def test_no_module_but_conninfo_opens_a_libpq_connection_itself() -> None:
    """A ``psycopg.connect`` elsewhere would read the upstream string its own way.

    One other module connects, to the *change DB*, not the upstream:
    ``storage/log_reader.py`` (the replica follower's reads), with the URL the
    change DB's engine hands psycopg too, so both read it as libpq does."""
    app = Path(__file__).resolve().parents[3] / "app"
    direct = re.compile(r"psycopg\.(connect|(Async)?Connection\.connect)\(")
    found = [
        str(path.relative_to(app))
        for path in sorted(app.rglob("*.py"))
        if direct.search(path.read_text()) and path.name != "conninfo.py"
    ]
    assert found == ["storage/log_reader.py"]
    # And it opens only the change DB: the one call, on what engine.reader_target gave.
    reader = (app / "storage" / "log_reader.py").read_text()
    assert len(direct.findall(reader)) == 1
    assert "app.sources" not in reader
