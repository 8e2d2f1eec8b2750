"""The tail command against the real server: readable and JSON output."""

from __future__ import annotations

import asyncio
import io
import re
import signal
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
from websockets.asyncio.server import ServerConnection

from app.cli import build_parser, main
from app.client import ChangeStreamerClient, SubscriptionContext, run_tail, tail
from app.protocol.canonical_json import dumps, loads
from app.storage import Replication, Shard, create_change_db, parse_change_db_url
from tests.change_dbs import migrated
from tests.server.conftest import start_server
from tests.waiting import eventually

from .conftest import (
    CLI,
    TIMEOUT,
    Server,
    StubServer,
    command,
    command_env,
    in_terminal,
    stub_server,
    txn,
)

REL = {"schema": "public", "name": "issues", "rowKey": {"columns": ["id"]}}


def mixed(w: str) -> list[list[Any]]:
    return [
        ["begin", {"tag": "begin"}, {"commitWatermark": w}],
        ["data", {"tag": "update", "relation": REL, "key": {"id": "a"}, "new": {"id": "b"}}],
        ["data", {"tag": "delete", "relation": REL, "key": {"id": "b"}}],
        ["data", {"tag": "truncate", "relations": [REL]}],
        ["commit", {"tag": "commit"}, {"watermark": w}],
    ]


async def store(server: Server, *messages: list[Any]) -> None:
    stream = await asyncio.wait_for(server.source.wait_for_stream(), TIMEOUT)
    stream.push_all(messages)


async def test_readable_output_learns_the_replica_version(server: Server) -> None:
    out, err = io.StringIO(), io.StringIO()
    running = asyncio.create_task(
        tail(server.url, replica_version=None, watermark=None, json_output=False, out=out,
             limit=2, err=err)
    )  # fmt: skip
    await store(server, *txn("02", 2), *mixed("03"))
    assert await asyncio.wait_for(running, TIMEOUT) == 0, err.getvalue()
    assert out.getvalue().splitlines() == [
        "begin 02",
        '02  insert public.issues {"id":"02-0","title":"t0"}',
        '02  insert public.issues {"id":"02-1","title":"t1"}',
        "commit 02",
        "begin 03",
        '03  update public.issues {"id":"b"} key {"id":"a"}',
        '03  delete public.issues {"id":"b"}',
        "03  truncate public.issues",
        "commit 03",
    ]
    assert err.getvalue() == ""


async def test_json_output_from_a_watermark_via_the_argument_parser(server: Server) -> None:
    # A serving subscription is what starts the server's change stream.
    client = ChangeStreamerClient(server.url)
    async with await client.subscribe(SubscriptionContext("x", "01", "01")) as sub:
        await asyncio.wait_for(sub.__anext__(), TIMEOUT)
    await store(server, *txn("02"), *txn("03"))
    await asyncio.wait_for(server.service.storer.wait_durable("03"), TIMEOUT)
    args = build_parser().parse_args(["tail", server.url, "--from", "02", "--json", "--limit", "1"])
    out, err = io.StringIO(), io.StringIO()
    code = await asyncio.wait_for(asyncio.to_thread(run_tail, args, out, err), TIMEOUT)
    assert code == 0, err.getvalue()
    lines = out.getvalue().splitlines()
    assert lines[0] == '["status",{"tag":"status"}]'
    assert [loads(line) for line in lines[1:]] == txn("03")
    assert lines[1] == '["begin",{"tag":"begin"},{"commitWatermark":"03"}]'


async def test_an_in_band_error_is_one_line_and_exit_code_1(server: Server) -> None:
    out, err = io.StringIO(), io.StringIO()
    code = await asyncio.wait_for(
        tail(server.url, replica_version="0z", out=out, err=err, limit=1), TIMEOUT
    )
    assert code == 1
    assert out.getvalue() == ""
    assert err.getvalue() == (
        "changestreamer tail: WrongReplicaVersion: current replica version is 01 (requested 0z)\n"
    )


async def test_a_bad_url_is_exit_code_2() -> None:
    err = io.StringIO()
    assert await tail("ftp://x", out=io.StringIO(), err=err) == 2
    assert "must start with ws://" in err.getvalue()


MIXED_LINES = [
    "begin 03",
    '03  update public.issues {"id":"b"} key {"id":"a"}',
    '03  delete public.issues {"id":"b"}',
    "03  truncate public.issues",
    "commit 03",
]


async def test_through_a_pipe_the_command_prints_the_plain_lines(server: Server) -> None:
    running = asyncio.create_task(
        asyncio.to_thread(command, "tail", server.url, "--from", "02", "--limit", "1")
    )
    await store(server, *txn("02"), *mixed("03"))
    done = await asyncio.wait_for(running, TIMEOUT)
    assert (done.returncode, done.stderr) == (0, "")
    assert done.stdout.splitlines() == MIXED_LINES


async def test_on_a_terminal_the_transactions_are_a_table_in_colour(server: Server) -> None:
    running = asyncio.create_task(
        asyncio.to_thread(in_terminal, "tail", server.url, "--from", "02", "--limit", "1")
    )
    await store(server, *txn("02"), *mixed("03"))
    code, shown, err = await asyncio.wait_for(running, TIMEOUT)
    assert (code, err) == (0, "")
    assert re.search(r"\x1b\[[0-9;]*m", shown), shown
    rows = [line.split() for line in re.sub(r"\x1b\[[0-9;]*m", "", shown).splitlines()]
    assert rows == [
        ["WATERMARK", "CHANGE", "TABLE", "ROW"],
        ["03", "begin"],
        ["03", "update", "public.issues", '{"id":"b"}', "key", '{"id":"a"}'],
        ["03", "delete", "public.issues", '{"id":"b"}'],
        ["03", "truncate", "public.issues"],
        ["03", "commit"],
    ]


async def test_ctrl_c_ends_it_quietly_with_130(server: Server) -> None:
    proc = await asyncio.create_subprocess_exec(
        *CLI,
        "tail",
        server.url,
        env=command_env(),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        await store(server, *txn("02"))
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), TIMEOUT)
        assert line == b"begin 02\n"  # it streams
        proc.send_signal(signal.SIGINT)
        _, err = await asyncio.wait_for(proc.communicate(), TIMEOUT)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    assert (proc.returncode, err) == (130, b"")


async def test_with_discover_it_follows_the_change_log_from_owner_to_owner(
    tmp_path: Path,
) -> None:
    # A directory change DB names the owner, as a shared one does after a handoff. The
    # tail finds the first server, and when that one drops it, finds the second and
    # resumes after the last commit it printed.
    directory = tmp_path / "directory" / "cdc.db"
    directory.parent.mkdir()
    db = create_change_db(parse_change_db_url(str(directory)), Shard())
    servers = [start_server(tmp_path / name) for name in ("a", "b")]
    try:
        first, second = [await anext(s) for s in servers]
        await migrated(db, owner="node-a", address=first.url.removeprefix("ws://"))
        for server in (first, second):
            server.service.serving_started.set()  # both stream at once
        # The first has only 02 when it lets go; 03 is the second's, after the handoff.
        await store(first, *txn("02"))
        await store(second, *txn("02"), *txn("03"))
        out, err = io.StringIO(), io.StringIO()
        args = build_parser().parse_args(
            ["tail", "--discover", str(directory), "--json", "--limit", "2"]
        )
        printed = asyncio.create_task(asyncio.to_thread(run_tail, args, out, err))
        await eventually(lambda: "commit" in out.getvalue(), "the first commit", 10)
        # A handoff: the directory names the second node; the first lets go.
        await Replication(db).assume_ownership("node-b", second.url.removeprefix("ws://"))
        first.service.forwarder.close_all()
        assert await asyncio.wait_for(printed, TIMEOUT) == 0, err.getvalue()
        messages = [loads(line) for line in out.getvalue().splitlines()]
        assert [m[2]["watermark"] for m in messages if m[0] == "commit"] == ["02", "03"]
        assert [m[0] for m in messages].count("status") == 2  # one per connection
    finally:
        await db.dispose()
        for s in servers:
            await s.aclose()


def test_discover_without_a_change_db_is_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("ZERO_CHANGE_DB", raising=False)
    with pytest.raises(SystemExit) as exited:
        main(["tail", "--discover"])
    assert exited.value.code == 2
    assert (
        "--discover needs a change DB: name one, or set ZERO_CHANGE_DB" in capsys.readouterr().err
    )


async def test_discover_with_no_owner_gives_up_after_its_bound(tmp_path: Path) -> None:
    directory = tmp_path / "cdc.db"
    db = create_change_db(parse_change_db_url(str(directory)), Shard())
    try:
        await migrated(db)  # no owner
    finally:
        await db.dispose()
    args = build_parser().parse_args(
        ["tail", "--discover", str(directory), "--replica-version", "01", "--give-up-after", "0.3"]
    )
    out, err = io.StringIO(), io.StringIO()
    code = await asyncio.wait_for(asyncio.to_thread(run_tail, args, out, err), TIMEOUT)
    assert code == 1
    assert err.getvalue() == ("changestreamer tail: discovery: no change-streamer is running\n")


# -- what a hostile server sends reaches the terminal spelled out --------------------

# ESC [2J clears the screen, BEL rings, \x9b is C1's one-byte CSI (ESC [), a carriage
# return overwrites the line, a newline forges one.
HOSTILE = "\x1b[2J\x07\x9b\r"
SHOWN = "\\x1b[2J\\x07\\x9b\\r"
RAW = ("\x1b", "\x07", "\x9b", "\r")
HOSTILE_TXN: list[list[Any]] = [
    ["begin", {"tag": "begin"}, {"commitWatermark": "02"}],
    [
        "data",
        {
            "tag": "insert",
            "relation": {"schema": "s", "name": f"t{HOSTILE}", "rowKey": {"columns": ["id"]}},
            "new": {"id": "a", f"c{HOSTILE}": f"v{HOSTILE}\nFORGED"},
        },
    ],
    ["commit", {"tag": "commit"}, {"watermark": "02"}],
]
HOSTILE_ERROR = ["error", {"type": 1, "message": f"current replica version is {HOSTILE}01"}]


def sending(*messages: list[Any]) -> Callable[[ServerConnection, StubServer], Awaitable[None]]:
    """A stub change-streamer that sends ``messages`` to each subscriber."""

    async def handler(ws: ServerConnection, stub: StubServer) -> None:
        for i, message in enumerate([["status", {"tag": "status"}], *messages], 1):
            await ws.send(dumps({"id": i, "msg": message}))
        await ws.wait_closed()

    return handler


async def test_a_server_s_control_characters_are_printed_spelled_out() -> None:
    async with stub_server(sending(*HOSTILE_TXN)) as stub:
        out, err = io.StringIO(), io.StringIO()
        code = await asyncio.wait_for(
            tail(stub.url, replica_version="01", out=out, err=err, limit=1), TIMEOUT
        )
    assert (code, err.getvalue()) == (0, "")
    assert not any(c in out.getvalue() for c in RAW), repr(out.getvalue())
    assert out.getvalue().splitlines() == [
        "begin 02",
        f'02  insert s.t{SHOWN} {{"id":"a","c\\u001b[2J\\u0007\\x9b\\r":'
        f'"v\\u001b[2J\\u0007\\x9b\\r\\nFORGED"}}',
        "commit 02",
    ]


async def test_in_json_the_control_characters_are_escapes_of_the_same_value() -> None:
    async with stub_server(sending(*HOSTILE_TXN)) as stub:
        out, err = io.StringIO(), io.StringIO()
        code = await asyncio.wait_for(
            tail(stub.url, replica_version="01", json_output=True, out=out, err=err, limit=1),
            TIMEOUT,
        )
    assert (code, err.getvalue()) == (0, "")
    assert not any(c in out.getvalue() for c in RAW), repr(out.getvalue())
    assert [loads(line) for line in out.getvalue().splitlines()[1:]] == HOSTILE_TXN


async def test_a_server_s_error_text_is_one_line_spelled_out() -> None:
    async with stub_server(sending(HOSTILE_ERROR)) as stub:
        out, err = io.StringIO(), io.StringIO()
        code = await asyncio.wait_for(
            tail(stub.url, replica_version="01", out=out, err=err, limit=1), TIMEOUT
        )
    assert code == 1
    assert err.getvalue() == (
        f"changestreamer tail: WrongReplicaVersion: current replica version is {SHOWN}01\n"
    )


async def test_on_a_terminal_the_table_shows_control_characters_spelled_out() -> None:
    async with stub_server(sending(*HOSTILE_TXN)) as stub:
        code, shown, err = await asyncio.wait_for(
            asyncio.to_thread(
                in_terminal, "tail", stub.url, "--replica-version", "01", "--limit", "1"
            ),
            TIMEOUT,
        )
    assert (code, err) == (0, "")
    # rich's own colours are the only escapes; the terminal's line ends are \r\n.
    text = re.sub(r"\x1b\[[0-9;]*m", "", shown).replace("\r\n", "\n")
    assert not any(c in text for c in RAW), repr(text)
    rows = [line.split() for line in text.splitlines()]
    assert rows[2][:3] == ["02", "insert", f"s.t{SHOWN}"], rows
