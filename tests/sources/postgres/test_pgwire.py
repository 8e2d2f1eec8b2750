"""Connecting as libpq does: the password file, SCRAM, MD5, cleartext passwords and
TLS (the connection string's options are test_conninfo's).

The first half is the sans-I/O part against known answers (RFC 7677's SCRAM
example, MD5's formula, libpq's rules). The second logs in to a private
Postgres started for this module (the shared server trusts everyone and has no
TLS): its pg_hba asks each user for another method, and it serves TLS with a
certificate of a CA made here. Without the server binaries (or openssl, for
TLS) those tests are skipped, saying why.
"""

from __future__ import annotations

import os
import pwd
import shutil
import socket
import struct
import subprocess
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import psycopg
import pytest

from app.sources.postgres import pgwire
from app.sources.postgres.connection import FramePieces, ReplicationConnection
from app.sources.postgres.conninfo import (
    ConnectError,
    default_socket_dir,
    parse_conninfo,
)
from app.sources.postgres.pgoutput import Insert, XLogData, decode_message, parse_copy_data
from app.sources.postgres.pgwire import ScramSha256, Startup
from tests.sources.postgres.tls_certs import make_certs
from tests.waiting import eventually

# Every test here: no PG* variable, ~/.pgpass or ~/.postgresql of whoever runs them.
pytestmark = pytest.mark.usefixtures("clean_environment")


# -- SCRAM-SHA-256 and MD5 -----------------------------------------------------------

RFC_7677_SERVER_FIRST = (
    b"r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096"
)


def rfc_7677_client() -> ScramSha256:
    return ScramSha256("pencil", user="user", nonce="rOprNGfwEbeRWgbNEkqO")


async def test_scram_sha_256_gives_rfc_7677s_messages() -> None:
    scram = rfc_7677_client()
    assert scram.client_first() == b"n,,n=user,r=rOprNGfwEbeRWgbNEkqO"
    assert await scram.client_final(RFC_7677_SERVER_FIRST) == (
        b"c=biws,r=rOprNGfwEbeRWgbNEkqO%hvYDpWUa2RaTCAfuxFIlj)hNlF$k0,"
        b"p=dHzbZapWIk4jUhN+Ute9ytag9zjfMHgsqmmiz7AndVQ="
    )
    assert not scram.verified
    scram.verify_server_final(b"v=6rriTRBi23WpRR/wtup+mMhUZUn/dB5nLTJRsjl95G4=")
    assert scram.verified


async def test_scram_refuses_a_server_that_does_not_know_the_password() -> None:
    scram = rfc_7677_client()
    await scram.client_final(RFC_7677_SERVER_FIRST)
    with pytest.raises(ConnectError, match="signature is wrong"):
        scram.verify_server_final(b"v=AAAATRBi23WpRR/wtup+mMhUZUn/dB5nLTJRsjl95G4=")
    with pytest.raises(ConnectError, match="nonce does not extend ours"):
        await rfc_7677_client().client_final(b"r=someone-else,s=W22ZaJ0SNY7soEsUEjb6gQ==,i=4096")


def test_md5_answer_is_md5_of_md5_of_password_and_user_then_salt() -> None:
    import hashlib

    inner = hashlib.md5(b"secretalice").hexdigest()
    expected = "md5" + hashlib.md5(inner.encode() + b"\x01\x02\x03\x04").hexdigest()
    assert pgwire.md5_password("alice", "secret", b"\x01\x02\x03\x04") == expected.encode()


# -- the password file -----------------------------------------------------------


def write_passfile(path: Path, text: str, mode: int = 0o600) -> str:
    path.write_text(text)
    path.chmod(mode)
    return str(path)


def test_the_password_file_gives_the_first_matching_line(tmp_path: Path) -> None:
    passfile = write_passfile(
        tmp_path / "pgpass",
        "# comment\n"
        "db.example:5432:app:alice:first\n"
        "db.example:5432:app:alice:second\n"
        "*:*:*:bob:bob\\:s:pass\n"
        "other\\:host:*:*:*:escaped\n"
        "localhost:5432:*:carol:on-the-socket\n",
    )
    assert pgwire.password_from_file(passfile, "db.example", 5432, "app", "alice") == "first"
    assert pgwire.password_from_file(passfile, "db.example", 5433, "app", "alice") is None
    assert pgwire.password_from_file(passfile, "anywhere", 1, "x", "bob") == "bob:s:pass"
    assert pgwire.password_from_file(passfile, "other:host", 1, "x", "y") == "escaped"
    socket_dir = default_socket_dir()
    assert pgwire.password_from_file(passfile, socket_dir, 5432, "x", "carol") == "on-the-socket"


def test_a_password_file_others_can_read_is_ignored(tmp_path: Path) -> None:
    passfile = write_passfile(tmp_path / "pgpass", "*:*:*:*:secret\n", mode=0o644)
    assert pgwire.password_from_file(passfile, "h", 1, "d", "u") is None
    assert pgwire.password_from_file(str(tmp_path / "missing"), "h", 1, "d", "u") is None


def test_the_password_file_is_pgpassfile_or_dot_pgpass_in_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert parse_conninfo("").passfile == str(tmp_path / ".pgpass")
    monkeypatch.setenv("PGPASSFILE", str(tmp_path / "elsewhere"))
    assert parse_conninfo("").passfile == str(tmp_path / "elsewhere")


# -- the startup conversation (sans-I/O) ---------------------------------------------


def auth_request(code: int, data: bytes = b"") -> bytes:
    return struct.pack("!I", code) + data


def startup(
    conninfo: str, host: str = "127.0.0.1", tls: pgwire.TlsSession | None = None
) -> Startup:
    return Startup(parse_conninfo(conninfo), host, 5432, tls=tls)


def test_startup_message_asks_for_a_logical_replication_connection() -> None:
    message = startup("user=alice dbname=app application_name=me options=-cx=1").message()
    (length, version) = struct.unpack_from("!II", message)
    assert (length, version) == (len(message), 196608)
    pairs = message[8:].split(b"\x00")
    assert dict(zip(pairs[0:-2:2], pairs[1:-2:2], strict=True)) == {
        b"user": b"alice",
        b"database": b"app",
        b"replication": b"database",
        b"client_encoding": b"UTF8",
        b"application_name": b"me",
        b"options": b"-cx=1",
    }


async def test_startup_answers_password_requests_and_reads_what_the_server_tells() -> None:
    s = startup("user=alice password=secret")
    assert await s.receive(ord("R"), auth_request(3)) == b"p\x00\x00\x00\x0bsecret\x00"
    md5 = pgwire.md5_password("alice", "secret", b"salt")
    s = startup("user=alice password=secret")
    answer = await s.receive(ord("R"), auth_request(5, b"salt"))
    assert answer == b"p\x00\x00\x00\x28" + md5 + b"\x00"
    assert await s.receive(ord("R"), auth_request(0)) == b""
    await s.receive(ord("S"), b"server_version\x0015.2\x00")
    await s.receive(ord("K"), struct.pack("!II", 4242, 7))
    ready_before = s.ready
    await s.receive(ord("Z"), b"I")
    assert (ready_before, s.ready) == (False, True)
    assert (s.backend_pid, s.parameters) == (4242, {"server_version": "15.2"})


async def test_startup_refuses_what_it_cannot_do_with_a_reason() -> None:
    with pytest.raises(ConnectError, match=r"none was given \(in the connection string"):
        await startup("user=alice").receive(ord("R"), auth_request(10, b"SCRAM-SHA-256\x00\x00"))
    with pytest.raises(
        ConnectError, match=r"SASL mechanisms \['SCRAM-SHA-256-PLUS'\] is supported"
    ):
        await startup("password=x").receive(
            ord("R"), auth_request(10, b"SCRAM-SHA-256-PLUS\x00\x00")
        )
    with pytest.raises(ConnectError, match="authentication method GSSAPI is not supported"):
        await startup("password=x").receive(ord("R"), auth_request(7))
    s = startup("password=x")
    await s.receive(ord("R"), auth_request(10, b"SCRAM-SHA-256-PLUS\x00SCRAM-SHA-256\x00\x00"))
    with pytest.raises(ConnectError, match="ended SCRAM before proving it knows the password"):
        await s.receive(ord("R"), auth_request(0))
    error = b'SFATAL\x00VFATAL\x00C3D000\x00Mdatabase "nope" does not exist\x00\x00'
    with pytest.raises(ConnectError, match=r'^FATAL: database "nope" does not exist$') as info:
        await startup("").receive(ord("E"), error)
    assert info.value.sqlstate == "3D000"


VERIFIED = pgwire.TlsSession(verified=True, end_point=b"\x01" * 32)
UNVERIFIED = pgwire.TlsSession(verified=False, end_point=b"\x01" * 32)


@pytest.mark.parametrize(
    ("host", "tls", "conninfo", "sent"),
    [
        ("db.example", None, "", False),  # plaintext over the network
        ("db.example", UNVERIFIED, "sslmode=require", False),  # anyone's certificate
        ("db.example", VERIFIED, "sslmode=verify-full", True),
        ("db.example", None, "require_auth=password,md5", True),  # the operator's choice
        ("127.0.0.1", None, "", True),  # no network in between
        ("::1", None, "", True),
        ("localhost", None, "", True),
        ("/var/run/postgresql", None, "", True),
    ],
)
async def test_a_password_goes_in_the_clear_or_as_md5_only_where_no_one_can_take_it(
    host: str, tls: pgwire.TlsSession | None, conninfo: str, sent: bool
) -> None:
    for code, data in ((3, b""), (5, b"salt")):
        s = startup(f"user=alice password=secret {conninfo}", host, tls)
        if sent:
            assert (await s.receive(ord("R"), auth_request(code, data))).startswith(b"p")
        else:
            with pytest.raises(
                ConnectError, match="over a connection whose server is not verified"
            ) as info:
                await s.receive(ord("R"), auth_request(code, data))
            assert "require_auth=" in str(info.value)
            assert "secret" not in str(info.value)


async def test_no_other_method_once_scram_began_and_none_after_the_end() -> None:
    s = startup("password=x")
    await s.receive(ord("R"), auth_request(10, b"SCRAM-SHA-256\x00\x00"))
    with pytest.raises(ConnectError, match="cleartext password after scram-sha-256"):
        await s.receive(ord("R"), auth_request(3))
    s = startup("password=x")
    with pytest.raises(ConnectError, match="SASL step 12 out of order"):
        await s.receive(ord("R"), auth_request(12, b"v=xxxx"))
    s = startup("password=x")
    await s.receive(ord("R"), auth_request(0))  # trust
    with pytest.raises(ConnectError, match="request 3 after it ended"):
        await s.receive(ord("R"), auth_request(3))
    with pytest.raises(ConnectError, match="ReadyForQuery before authentication"):
        await startup("").receive(ord("Z"), b"I")


@pytest.mark.parametrize(
    ("require_auth", "code", "refusal"),
    [
        ("scram-sha-256", 3, '"scram-sha-256" failed: server requested a cleartext password'),
        ("scram-sha-256", 5, '"scram-sha-256" failed: server requested a hashed password'),
        ("!password", 3, '"!password" failed: server requested a cleartext password'),
        ("password", 10, '"password" failed: server requested SASL authentication'),
        ("!md5,!none", 0, '"!md5,!none" failed: server did not complete authentication'),
        ("md5", 0, '"md5" failed: server did not complete authentication'),
        ("none", 3, '"none" failed: server requested a cleartext password'),
    ],
)
async def test_require_auth_refuses_any_other_method(
    require_auth: str, code: int, refusal: str
) -> None:
    s = startup(f"password=x require_auth={require_auth}")
    data = {10: b"SCRAM-SHA-256\x00\x00", 5: b"salt"}.get(code, b"")
    with pytest.raises(ConnectError, match=f"^authentication method requirement {refusal}$"):
        await s.receive(ord("R"), auth_request(code, data))


async def test_require_auth_lets_through_the_methods_it_names() -> None:
    assert await startup("require_auth=none").receive(ord("R"), auth_request(0)) == b""
    s = startup("password=x require_auth=!password,!md5")
    assert (await s.receive(ord("R"), auth_request(10, b"SCRAM-SHA-256\x00\x00"))).startswith(b"p")


def client_first_of(answer: bytes) -> tuple[str, bytes]:
    """The mechanism and client-first-message in a SASLInitialResponse."""
    mechanism, rest = answer[5:].split(b"\x00", 1)
    return mechanism.decode(), rest[4:]


async def test_scram_binds_the_tls_channel_when_the_server_offers_to() -> None:
    both = auth_request(10, b"SCRAM-SHA-256-PLUS\x00SCRAM-SHA-256\x00\x00")
    plain = auth_request(10, b"SCRAM-SHA-256\x00\x00")
    cases = [
        ("", UNVERIFIED, both, "SCRAM-SHA-256-PLUS", b"p=tls-server-end-point,,"),
        ("", UNVERIFIED, plain, "SCRAM-SHA-256", b"y,,"),  # we could have: a downgrade shows
        ("", None, both, "SCRAM-SHA-256", b"n,,"),
        ("channel_binding=disable", UNVERIFIED, both, "SCRAM-SHA-256", b"n,,"),
        ("channel_binding=require", UNVERIFIED, both, "SCRAM-SHA-256-PLUS", b"p=tls"),
    ]
    for conninfo, tls, request, mechanism, gs2 in cases:
        answer = await startup(f"password=x {conninfo}", tls=tls).receive(ord("R"), request)
        got_mechanism, first = client_first_of(answer)
        assert (got_mechanism, first[: len(gs2)]) == (mechanism, gs2), conninfo


@pytest.mark.parametrize(
    ("tls", "offered", "refusal"),
    [
        (None, b"SCRAM-SHA-256-PLUS\x00SCRAM-SHA-256\x00", "SSL not in use"),
        (UNVERIFIED, b"SCRAM-SHA-256\x00", "server did not offer an authentication method"),
        (
            pgwire.TlsSession(verified=False, end_point=None),
            b"SCRAM-SHA-256-PLUS\x00",
            "signature algorithm has no hash",
        ),
    ],
)
async def test_channel_binding_require_refuses_scram_without_it(
    tls: pgwire.TlsSession | None, offered: bytes, refusal: str
) -> None:
    s = startup("password=x channel_binding=require", tls=tls)
    with pytest.raises(ConnectError, match=refusal):
        await s.receive(ord("R"), auth_request(10, offered + b"\x00"))


async def test_channel_binding_require_refuses_every_method_but_scram() -> None:
    for code in (3, 5):
        s = startup("password=x channel_binding=require", tls=VERIFIED)
        with pytest.raises(ConnectError, match="channel binding required, but the server asked"):
            await s.receive(ord("R"), auth_request(code, b"salt"))
    with pytest.raises(ConnectError, match="authenticated client without channel binding"):
        await startup("channel_binding=require", tls=VERIFIED).receive(ord("R"), auth_request(0))
    with pytest.raises(ConnectError, match='needs TLS, but sslmode is "disable"'):
        parse_conninfo("channel_binding=require sslmode=disable")


async def test_scram_refuses_more_iterations_than_its_cap_and_derives_off_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import hashlib
    import threading

    with pytest.raises(
        ConnectError, match="asks for 1,000,001 iterations, more than the 1,000,000"
    ):
        await rfc_7677_client().client_final(RFC_7677_SERVER_FIRST.replace(b"4096", b"1000001"))
    threads: list[int] = []
    pbkdf2 = hashlib.pbkdf2_hmac

    def recording(*args: object) -> bytes:
        threads.append(threading.get_ident())
        return pbkdf2(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(hashlib, "pbkdf2_hmac", recording)
    await rfc_7677_client().client_final(RFC_7677_SERVER_FIRST)
    assert threads
    assert threads[0] != threading.get_ident()


@pytest.mark.parametrize(
    ("kind", "body"),
    [
        (ord("R"), b"\x00\x00"),  # no room for the request's code
        (ord("R"), auth_request(5, b"s")),  # an MD5 salt of 1 byte
        (ord("R"), auth_request(10, b"\xff\xfe\x00\x00")),  # mechanisms not UTF-8
        (ord("S"), b"no terminators"),
        (ord("K"), b"\x00"),
    ],
)
async def test_a_startup_message_that_does_not_parse_is_a_connect_error(
    kind: int, body: bytes
) -> None:
    with pytest.raises(ConnectError, match=f"malformed {chr(kind)!r} message from the server"):
        await startup("password=x").receive(kind, body)


async def test_a_server_first_message_that_does_not_parse_is_a_connect_error() -> None:
    for server_first in (b"r=rOprNGfwEbeRWgbNEkqOxx,s=!!!,i=4096", b"\xff", b"i=many"):
        s = startup("password=x")
        await s.receive(ord("R"), auth_request(10, b"SCRAM-SHA-256\x00\x00"))
        with pytest.raises(ConnectError):
            await s.receive(ord("R"), auth_request(11, server_first))


def test_a_client_key_others_may_read_is_refused(tmp_path: Path) -> None:
    certs = make_certs(tmp_path)
    if certs is None:
        pytest.skip("no openssl to make a client certificate")
    key = certs / "server.key"
    base = f"sslmode=require sslcert={certs / 'server.crt'} sslkey={key}"
    key.chmod(0o644)
    with pytest.raises(ConnectError, match=r'private key file ".*server.key" has group or world'):
        pgwire.ssl_context(parse_conninfo(base))
    key.chmod(0o600)
    pgwire.ssl_context(parse_conninfo(base))
    with pytest.raises(ConnectError, match="certificate present, but not private key file"):
        pgwire.ssl_context(parse_conninfo(f"{base}.missing"))


def test_the_channel_binding_data_is_the_certificate_hashed_by_its_signature_hash(
    tmp_path: Path,
) -> None:
    import hashlib
    import ssl as ssl_module

    certs = make_certs(tmp_path)
    if certs is None:
        pytest.skip("no openssl to make a certificate")
    der = ssl_module.PEM_cert_to_DER_cert((certs / "server.crt").read_text())
    # make_certs signs with ECDSA and SHA-256 (openssl's default digest).
    assert pgwire.server_end_point(der) == hashlib.sha256(der).digest()
    assert pgwire.server_end_point(b"\x30\x03\x02\x01\x00") is None
    assert pgwire.server_end_point(b"") is None


# -- a private server: passwords and TLS for real -----------------------------------


@dataclass(frozen=True)
class PrivateServer:
    port: int
    socket_dir: str
    certs: Path | None  # ca.crt (the server's CA) and other-ca.crt; None without openssl

    def conninfo(self, user: str, extra: str = "") -> str:
        return f"host=127.0.0.1 port={self.port} dbname=postgres user={user} {extra}".strip()

    def admin_url(self) -> str:
        return f"host={self.socket_dir} port={self.port} dbname=postgres user=postgres"


PASSWORDS = {
    "scram_user": "pencil",
    "md5_user": "md5 secret",
    "pw_user": "clear text",
    "tls_user": "tls",
}
PG_HBA = """\
local all all trust
host all postgres 127.0.0.1/32 trust
host all scram_user 127.0.0.1/32 scram-sha-256
host all md5_user 127.0.0.1/32 md5
host all pw_user 127.0.0.1/32 password
hostssl all tls_user 127.0.0.1/32 scram-sha-256
hostnossl all tls_user 127.0.0.1/32 reject
"""


def server_bindir() -> Path | None:
    try:
        out = subprocess.run(["pg_config", "--bindir"], capture_output=True, text=True, check=True)
    except (OSError, subprocess.CalledProcessError):
        return None
    bindir = Path(out.stdout.strip())
    if (bindir / "initdb").exists():
        return bindir
    versions = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"))
    return versions[-1].parent if versions else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.fixture(scope="module")
def private_server() -> Iterator[PrivateServer]:
    bindir = server_bindir()
    if bindir is None:
        pytest.skip("no PostgreSQL server binaries (initdb, pg_ctl) to start a private server")
    prefix: list[str] = []
    root = Path(tempfile.mkdtemp(prefix="cs-pgwire-"))
    if os.geteuid() == 0:  # the server refuses to run as root
        try:
            owner = pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip("running as root and there is no postgres user to run a private server")
        prefix = ["runuser", "-u", "postgres", "--"]
    try:
        certs = make_certs(root)
        if prefix:
            for path in [root, *root.iterdir()]:
                os.chown(path, owner.pw_uid, owner.pw_gid)
        data = root / "data"

        def run(*args: str) -> None:
            done = subprocess.run([*prefix, *args], capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, f"{args[0]} failed: {done.stdout}{done.stderr}"

        run(str(bindir / "initdb"), "-D", str(data), "-A", "trust", "-U", "postgres", "--no-sync")
        port = free_port()
        settings = {
            "port": str(port),
            "listen_addresses": "'127.0.0.1'",
            "unix_socket_directories": f"'{root}'",
            "wal_level": "logical",
            "fsync": "off",
        }
        if certs is not None:
            (root / "server.key").chmod(0o600)
            settings |= {
                "ssl": "on",
                "ssl_cert_file": f"'{root / 'server.crt'}'",
                "ssl_key_file": f"'{root / 'server.key'}'",
            }
        with open(data / "postgresql.conf", "a") as conf:
            conf.writelines(f"{k} = {v}\n" for k, v in settings.items())
        (data / "pg_hba.conf").write_text(PG_HBA)
        run(str(bindir / "pg_ctl"), "-D", str(data), "-l", str(root / "log"), "-w", "start")
        server = PrivateServer(port, str(root), certs)
        try:
            with psycopg.connect(server.admin_url(), autocommit=True) as c:
                for user, password in PASSWORDS.items():
                    method = "md5" if user == "md5_user" else "scram-sha-256"
                    c.execute(f"SET password_encryption = '{method}'")
                    c.execute(
                        f"CREATE ROLE {user} LOGIN REPLICATION PASSWORD '{password}'".encode()
                    )
            yield server
        finally:
            run(str(bindir / "pg_ctl"), "-D", str(data), "-m", "immediate", "-w", "stop")
    finally:
        shutil.rmtree(root, ignore_errors=True)


async def is_tls(server: PrivateServer, pid: int) -> bool:
    async with await psycopg.AsyncConnection.connect(server.admin_url()) as c:
        cur = await c.execute("SELECT ssl FROM pg_stat_ssl WHERE pid = %s", (pid,))
        row = await cur.fetchone()
        assert row is not None
        return bool(row[0])


@pytest.mark.parametrize("user", ["scram_user", "md5_user", "pw_user"])
async def test_each_password_method_logs_in(private_server: PrivateServer, user: str) -> None:
    info = private_server.conninfo(user, f"password='{PASSWORDS[user]}' sslmode=disable")
    conn = await ReplicationConnection.connect(info)
    try:
        assert conn.backend_pid > 0
    finally:
        await conn.close()


@pytest.mark.parametrize("user", ["scram_user", "md5_user", "pw_user"])
async def test_a_wrong_password_is_one_clear_line(private_server: PrivateServer, user: str) -> None:
    info = private_server.conninfo(user, "password=wrong sslmode=disable")
    with pytest.raises(ConnectError) as failed:
        await ReplicationConnection.connect(info)
    assert str(failed.value) == (
        f'connection to server at "127.0.0.1", port {private_server.port} failed: '
        f'FATAL: password authentication failed for user "{user}"'
    )
    assert failed.value.sqlstate == "28P01"


async def test_the_password_comes_from_the_password_file(
    private_server: PrivateServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    passfile = write_passfile(
        tmp_path / "pgpass", f"127.0.0.1:{private_server.port}:postgres:scram_user:pencil\n"
    )
    monkeypatch.setenv("PGPASSFILE", passfile)
    conn = await ReplicationConnection.connect(private_server.conninfo("scram_user"))
    await conn.close()
    with pytest.raises(ConnectError, match="none was given"):
        await ReplicationConnection.connect(private_server.conninfo("md5_user"))


def tls_server(server: PrivateServer) -> Path:
    if server.certs is None:
        pytest.skip("no openssl to make the private server's certificates")
    return server.certs


async def test_tls_as_each_sslmode_asks(private_server: PrivateServer) -> None:
    certs = tls_server(private_server)
    ca, other_ca = certs / "ca.crt", certs / "other-ca.crt"
    password = "password=tls"
    for extra in (
        "sslmode=require",
        "sslmode=prefer",
        "sslmode=allow",  # tls_user is refused in plain: allow then tries TLS
        f"sslmode=verify-ca sslrootcert={ca}",
        f"sslmode=verify-full sslrootcert={ca}",
        f"sslmode=verify-full sslrootcert={ca} host=localhost",
    ):
        conn = await ReplicationConnection.connect(
            private_server.conninfo("tls_user", f"{password} {extra}")
        )
        try:
            assert await is_tls(private_server, conn.backend_pid), extra
        finally:
            await conn.close()

    with pytest.raises(ConnectError, match="no encryption") as refused:
        await ReplicationConnection.connect(
            private_server.conninfo("tls_user", f"{password} sslmode=disable")
        )
    assert refused.value.sqlstate == "28000"
    with pytest.raises(ConnectError, match="certificate verify failed"):
        await ReplicationConnection.connect(
            private_server.conninfo(
                "tls_user", f"{password} sslmode=verify-ca sslrootcert={other_ca}"
            )
        )
    with pytest.raises(ConnectError, match=r'root certificate file ".*missing.crt" does not exist'):
        await ReplicationConnection.connect(
            private_server.conninfo(
                "tls_user", f"{password} sslmode=verify-full sslrootcert={certs}/missing.crt"
            )
        )


async def test_scram_binds_the_channel_with_a_real_server(private_server: PrivateServer) -> None:
    """channel_binding=require logs in only with SCRAM-SHA-256-PLUS, which the server
    accepts only if our tls-server-end-point data is its certificate's hash."""
    certs = tls_server(private_server)
    for extra in ("sslmode=require", f"sslmode=verify-full sslrootcert={certs / 'ca.crt'}"):
        conn = await ReplicationConnection.connect(
            private_server.conninfo("tls_user", f"password=tls channel_binding=require {extra}")
        )
        await conn.close()
    # md5_user's method has no channel binding.
    with pytest.raises(ConnectError, match="channel binding required, but the server asked"):
        await ReplicationConnection.connect(
            private_server.conninfo(
                "md5_user", "password='md5 secret' sslmode=require channel_binding=require"
            )
        )


async def test_a_root_certificate_in_home_makes_require_verify(
    private_server: PrivateServer, tmp_path: Path
) -> None:
    certs = tls_server(private_server)
    (tmp_path / ".postgresql").mkdir()
    shutil.copy(certs / "other-ca.crt", tmp_path / ".postgresql" / "root.crt")
    with pytest.raises(ConnectError, match="certificate verify failed"):
        await ReplicationConnection.connect(
            private_server.conninfo("tls_user", "password=tls sslmode=require")
        )


async def test_a_large_frame_streams_in_pieces_over_tls(private_server: PrivateServer) -> None:
    await a_large_frame_in_pieces_over_tls(private_server, "on_asyncio")


def test_a_large_frame_streams_in_pieces_over_tls_on_uvloop(private_server: PrivateServer) -> None:
    uvloop = pytest.importorskip("uvloop")
    uvloop.run(a_large_frame_in_pieces_over_tls(private_server, "on_uvloop"))


async def a_large_frame_in_pieces_over_tls(server: PrivateServer, name: str) -> None:
    tls_server(server)
    value = os.urandom(3 << 20).hex()  # 6 MiB of text that does not compress
    slot = f"big_{name}"
    async with await psycopg.AsyncConnection.connect(server.admin_url(), autocommit=True) as c:
        await c.execute(f"CREATE TABLE big_{name} (id int PRIMARY KEY, v text)".encode())
        await c.execute(f"CREATE PUBLICATION pub_{name} FOR TABLE big_{name}".encode())
        await c.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (slot,))
        try:
            conn = await ReplicationConnection.connect(
                server.conninfo("tls_user", "password=tls sslmode=require")
            )
            try:
                await conn.start_replication(slot, 0, [f"pub_{name}"])
                await c.execute(f"INSERT INTO big_{name} VALUES (1, %s)".encode(), (value,))
                pieces = await first_large_frame(conn, 1 << 20)
                assert await is_tls(server, conn.backend_pid)
            finally:
                await conn.close()
            frame = b"".join(pieces.chunks)
            assert value.encode() in frame
            assert all(len(chunk) <= 1 << 20 for chunk in pieces.chunks)
            xlog = parse_copy_data(frame)
            assert isinstance(xlog, XLogData)
            assert isinstance(decode_message(xlog.payload), Insert)
        finally:
            await drop_slot_once_released(c, slot)


async def drop_slot_once_released(c: psycopg.AsyncConnection[object], slot: str) -> None:
    """The walsender ends a moment after our socket closes; then the slot can go."""

    async def dropped() -> bool:
        try:
            await c.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
            return True
        except psycopg.errors.ObjectInUse:
            return False

    await eventually(dropped, f"slot {slot} released after the connection closed", 10, poll_s=0.05)


async def first_large_frame(conn: ReplicationConnection, pieces_over: int) -> FramePieces:
    for _ in range(100):
        frame = await conn.read_frame(10, pieces_over=pieces_over)
        assert frame is not None, "no frame within 10 s"
        if isinstance(frame, FramePieces):
            return frame
    raise AssertionError("no frame came in pieces")
