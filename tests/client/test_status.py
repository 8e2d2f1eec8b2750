"""The status command against a stub /statz handler.

The real /statz endpoint is not part of the client: these tests serve a tiny
stand-in on 127.0.0.1 that checks Basic auth like the spec (wire.md §4.2) and
returns a fixed JSON document, and record each request line and header.
"""

from __future__ import annotations

import asyncio
import base64
import io
import re
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from app.cli import build_parser
from app.client import run_status, status
from app.client.status import format_statz
from app.protocol.canonical_json import dumps
from app.storage import Shard, create_change_db, parse_change_db_url
from tests.change_dbs import migrated

from .conftest import CLI, TIMEOUT, command, command_env, free_port, in_terminal

PASSWORD = "s3cret"
STATZ = (
    '{"changeLog":{"rows":42},'
    '"replication":{"lastWatermark":"0c3f2b","subscribers":[{"id":"a","acked":"0c3f2b"}]},'
    '"upstream":{"error":"connection refused"}}'
)


@dataclass
class Stub:
    url: str
    requests: list[tuple[str, dict[str, str]]] = field(default_factory=list)


@pytest.fixture
async def stub() -> AsyncIterator[Stub]:
    port = free_port()
    stub = Stub(f"ws://127.0.0.1:{port}/ignored?x=1")

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request_line = (await reader.readline()).decode().strip()
        headers: dict[str, str] = {}
        while (line := (await reader.readline()).decode().strip()) != "":
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        stub.requests.append((request_line, headers))
        auth = headers.get("authorization", "")
        # The user name is ignored, as in the reference.
        ok = auth.startswith("Basic ") and base64.b64decode(auth[6:]).decode().endswith(
            ":" + PASSWORD
        )
        if ok:
            body, head = STATZ.encode(), "HTTP/1.1 200 OK\r\nContent-Type: application/json"
        else:
            body = b"Unauthorized"
            head = (
                "HTTP/1.1 401 Unauthorized\r\nContent-Type: text/plain\r\n"
                'WWW-Authenticate: Basic realm="Statz Protected Area"'
            )
        writer.write(
            f"{head}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode() + body
        )
        await writer.drain()
        writer.close()
        await writer.wait_closed()

    server = await asyncio.start_server(handle, "127.0.0.1", port)
    async with server:
        yield stub


PLAIN = (
    "=== changeLog ===\n"
    "  rows: 42\n"
    "=== replication ===\n"
    "  lastWatermark: 0c3f2b\n"
    '  subscribers: [{"id":"a","acked":"0c3f2b"}]\n'
    "=== upstream ===\n"
    "  error: connection refused\n"
)
ANSI = re.compile(r"\x1b\[[0-9;]*m")


async def test_the_stats_are_printed_per_group(stub: Stub) -> None:
    out, err = io.StringIO(), io.StringIO()
    assert await status(stub.url, password=PASSWORD, out=out, err=err) == 0
    assert out.getvalue() == PLAIN
    assert err.getvalue() == ""
    [(request_line, headers)] = stub.requests
    assert request_line == "GET /statz?format=json HTTP/1.1"
    assert headers["authorization"] == "Basic " + base64.b64encode(b"admin:s3cret").decode()


async def test_a_wrong_password_is_one_line_and_exit_code_1(stub: Stub) -> None:
    out, err = io.StringIO(), io.StringIO()
    assert await status(stub.url, password="nope", out=out, err=err) == 1
    assert out.getvalue() == ""
    assert err.getvalue() == (
        "changestreamer status: unauthorized (HTTP 401): the admin password was rejected\n"
    )


async def test_no_password_sends_no_credentials_and_says_what_is_missing(stub: Stub) -> None:
    out, err = io.StringIO(), io.StringIO()
    assert await status(stub.url, password=None, out=out, err=err) == 1
    assert "authorization" not in stub.requests[0][1]
    assert err.getvalue().count("\n") == 1
    assert "ZERO_ADMIN_PASSWORD or --password-file" in err.getvalue()


async def test_the_password_comes_from_the_environment_or_a_file_not_argv(
    stub: Stub, tmp_path: Path
) -> None:
    secret = tmp_path / "admin-password"
    secret.write_text(PASSWORD + "\n")
    from_env = build_parser().parse_args(["status", stub.url])
    from_file = build_parser().parse_args(["status", stub.url, "--password-file", str(secret)])
    results = []
    for args, environ in ((from_env, {"ZERO_ADMIN_PASSWORD": PASSWORD}), (from_file, {})):
        out, err = io.StringIO(), io.StringIO()
        code = await asyncio.to_thread(run_status, args, out, err, environ=environ)
        results.append((code, out.getvalue().startswith("=== changeLog ===\n"), err.getvalue()))
    assert results == [(0, True, ""), (0, True, "")]
    expected = "Basic " + base64.b64encode(f"admin:{PASSWORD}".encode()).decode()
    assert [headers["authorization"] for _, headers in stub.requests] == [expected] * 2


async def test_without_a_password_a_401_asks_at_the_prompt(stub: Stub) -> None:
    args = build_parser().parse_args(["status", stub.url])
    out, err = io.StringIO(), io.StringIO()
    code = await asyncio.to_thread(run_status, args, out, err, environ={}, prompt=lambda: PASSWORD)
    assert (code, err.getvalue()) == (0, "")
    assert "authorization" not in stub.requests[0][1]  # asked first without
    assert stub.requests[1][1]["authorization"].startswith("Basic ")


async def test_password_on_argv_still_works_but_warns(stub: Stub) -> None:
    args = build_parser().parse_args(["status", stub.url, "--password", PASSWORD])
    out, err = io.StringIO(), io.StringIO()
    assert await asyncio.to_thread(run_status, args, out, err, environ={}) == 0
    assert out.getvalue().startswith("=== changeLog ===\n")
    assert "use ZERO_ADMIN_PASSWORD or --password-file" in err.getvalue()


async def test_an_unreachable_server_is_one_line_and_exit_code_1() -> None:
    err = io.StringIO()
    code = await status(
        f"http://127.0.0.1:{free_port()}", password=None, out=io.StringIO(), err=err
    )
    assert code == 1
    assert err.getvalue().startswith("changestreamer status: cannot reach http://127.0.0.1:")
    assert err.getvalue().count("\n") == 1


def test_format_statz_of_a_non_object() -> None:
    assert format_statz([1, 2]) == "[\n  1,\n  2\n]\n"


def password_file(tmp_path: Path) -> str:
    path = tmp_path / "admin-password"
    path.write_text(PASSWORD + "\n")
    return str(path)


async def test_through_a_pipe_the_command_prints_the_plain_text(stub: Stub, tmp_path: Path) -> None:
    done = await asyncio.to_thread(
        command, "status", stub.url, "--password-file", password_file(tmp_path)
    )
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout == PLAIN


async def test_on_a_terminal_each_group_is_a_table_in_colour(stub: Stub, tmp_path: Path) -> None:
    code, shown, err = await asyncio.to_thread(
        in_terminal, "status", stub.url, "--password-file", password_file(tmp_path)
    )
    assert (code, err) == (0, "")
    assert ANSI.search(shown), shown
    text = ANSI.sub("", shown)
    assert "===" not in text
    lines = text.splitlines()
    titles = [line.strip() for line in lines if line.strip().isalpha()]
    assert titles == ["changeLog", "replication", "upstream"]
    assert lines[1].startswith("╭")
    rows = [line.strip().strip("│").split("│") for line in lines if line.startswith("│")]
    assert [[cell.strip() for cell in row] for row in rows] == [
        ["rows", "42"],
        ["lastWatermark", "0c3f2b"],
        ["subscribers", '[{"id":"a","acked":"0c3f2b"}]'],
        ["error", "connection refused"],
    ]


async def test_ctrl_c_while_the_server_does_not_answer_exits_quietly_with_130() -> None:
    port = free_port()
    asked, release, closed = asyncio.Event(), asyncio.Event(), asyncio.Event()

    async def never_answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readline()
        asked.set()
        await release.wait()
        writer.close()
        await writer.wait_closed()
        closed.set()

    async with await asyncio.start_server(never_answer, "127.0.0.1", port):
        proc = await asyncio.create_subprocess_exec(
            *CLI,
            "status",
            f"http://127.0.0.1:{port}",
            env=command_env(),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        try:
            await asyncio.wait_for(asked.wait(), TIMEOUT)
            proc.send_signal(signal.SIGINT)
            # At once: not after the request's own 10 s timeout.
            out, err = await asyncio.wait_for(proc.communicate(), 5)
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
            release.set()
            await asyncio.wait_for(closed.wait(), TIMEOUT)
    assert (proc.returncode, out, err) == (130, b"", b"")


async def test_with_discover_it_asks_the_owner_the_change_db_names(
    stub: Stub, tmp_path: Path
) -> None:
    directory = tmp_path / "cdc.db"
    db = create_change_db(parse_change_db_url(str(directory)), Shard("myapp", 3))
    try:
        address = stub.url.removeprefix("ws://").split("/")[0]  # host:port, as serve writes it
        await migrated(db, owner="node-b", address=address)
    finally:
        await db.dispose()
    args = build_parser().parse_args(
        ["status", "--discover", str(directory), "--app-id", "myapp", "--shard-num", "3"]
    )
    out, err = io.StringIO(), io.StringIO()
    env = {"ZERO_ADMIN_PASSWORD": PASSWORD}
    assert await asyncio.to_thread(run_status, args, out, err, environ=env) == 0, err.getvalue()
    assert out.getvalue() == PLAIN
    # A change DB that names no owner: one line, exit code 1.
    unowned = tmp_path / "unowned.db"
    db = create_change_db(parse_change_db_url(str(unowned)), Shard())
    try:
        await migrated(db)
    finally:
        await db.dispose()
    other = build_parser().parse_args(["status", "--discover", str(unowned)])
    out, err = io.StringIO(), io.StringIO()
    assert await asyncio.to_thread(run_status, other, out, err, environ=env) == 1
    assert err.getvalue() == "changestreamer status: --discover: no change-streamer is running\n"


# -- what a hostile server sends reaches the terminal spelled out --------------------

# ESC [2J clears the screen, BEL rings, \x9b is C1's one-byte CSI (ESC [), a carriage
# return overwrites the line.
HOSTILE = "\x1b[2J\x07\x9b\r"
SHOWN = "\\x1b[2J\\x07\\x9b\\r"
RAW = ("\x1b", "\x07", "\x9b", "\r")
JSON_OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json"
HOSTILE_STATZ = dumps(
    {f"g{HOSTILE}": {f"k{HOSTILE}": f"v{HOSTILE}\nFORGED", "list": [f"x{HOSTILE}"]}}
).encode()


@asynccontextmanager
async def answering(head: bytes, body: bytes) -> AsyncIterator[str]:
    """A stand-in that answers every request with ``head`` and ``body``; its URL."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while (await reader.readline()).strip():
            pass
        writer.write(head + f"\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body)
        await writer.drain()
        writer.close()
        await writer.wait_closed()

    port = free_port()
    async with await asyncio.start_server(handle, "127.0.0.1", port):
        yield f"http://127.0.0.1:{port}"


async def test_a_server_s_control_characters_are_printed_spelled_out() -> None:
    async with answering(JSON_OK, HOSTILE_STATZ) as url:
        out, err = io.StringIO(), io.StringIO()
        assert await status(url, password=None, out=out, err=err) == 0
    assert not any(c in out.getvalue() for c in RAW), repr(out.getvalue())
    assert out.getvalue().splitlines() == [
        f"=== g{SHOWN} ===",
        f"  k{SHOWN}: v{SHOWN}\\nFORGED",
        '  list: ["x\\u001b[2J\\u0007\\x9b\\r"]',
    ]
    assert format_statz([HOSTILE]) == '[\n  "\\u001b[2J\\u0007\\u009b\\r"\n]\n'


async def test_a_server_s_http_reason_is_one_line_spelled_out() -> None:
    reason = "Bad\x1b[2J\x07\x9b".encode("latin-1")  # a status line ends at \r\n
    async with answering(b"HTTP/1.1 500 " + reason, b"") as url:
        out, err = io.StringIO(), io.StringIO()
        assert await status(url, password=None, out=out, err=err) == 1
    assert err.getvalue() == "changestreamer status: HTTP 500 Bad\\x1b[2J\\x07\\x9b\n"


async def test_on_a_terminal_the_tables_show_control_characters_spelled_out() -> None:
    async with answering(JSON_OK, HOSTILE_STATZ) as url:
        code, shown, err = await asyncio.to_thread(in_terminal, "status", url)
    assert (code, err) == (0, "")
    # rich's own colours are the only escapes; the terminal's line ends are \r\n.
    text = ANSI.sub("", shown).replace("\r\n", "\n")
    assert not any(c in text for c in RAW), repr(text)
    assert f"g{SHOWN}" in text
    rows = [line.strip("│ ").split("│") for line in text.splitlines() if line.startswith("│")]
    assert [[cell.strip() for cell in row] for row in rows] == [
        [f"k{SHOWN}", f"v{SHOWN}\\nFORGED"],
        ["list", '["x\\u001b[2J\\u0007\\x9b\\r"]'],
    ]
