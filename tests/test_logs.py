"""The log (``app/logs.py``): one format per process, a subscriber's lines name it,
and no secret reaches a line."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import logging
import os
import re
import signal
import socket
import sys
import urllib.request
from asyncio.subprocess import Process
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from app.logs import (
    FIELD_CHARS,
    UVICORN_LOGGERS,
    LogFormat,
    LogHandler,
    bind_log_fields,
    configure_logging,
    log_extra,
    redact,
    redacted_conninfo,
)
from app.protocol.canonical_json import dumps
from app.streamer.downstream import Downstream
from tests.replica.conftest import new_replica
from tests.server.conftest import Server, start_server
from tests.waiting import eventually

REPO = Path(__file__).resolve().parents[1]
CLI = [sys.executable, "-m", "app.cli"]
PLANTED = "PLANTED-pw-7f3a"
START_TIMEOUT_S = 30.0
POLL_S = 0.05
TEXT_LINE = re.compile(
    r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z (DEBUG|INFO|WARNING|ERROR|CRITICAL) \S+: "
)

# -- secrets -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("postgres://zero:s3cret@db:5432/app", "postgres://zero:***@db:5432/app"),
        ("upstream 'postgresql://u:p%40ss@h/db'", "upstream 'postgresql://u:***@h/db'"),
        ("ws://user:pa/ss@cs.example:80/x", "ws://user:***@cs.example:80/x"),
        ("host=db password=s3cret dbname=app", "host=db password=*** dbname=app"),
        ("host=db password='a b\\' c' dbname=app", "host=db password=*** dbname=app"),
        # libpq's quoting, as libpq reads it: quoted with spaces, \' and \\ inside;
        # bare up to whitespace, a backslash escaping the next character.
        ("host=db password='s3cret Tail' user=z", "host=db password=*** user=z"),
        ("password = 'it\\'s s3cret' user=z", "password = *** user=z"),
        ("password='s3cret\\\\' user=z", "password=*** user=z"),
        ("password='a\\\\\\' b' user=z", "password=*** user=z"),
        ("password=s3cret\\ Tail user=z", "password=*** user=z"),
        ("host=db password='s3cret Tail", "host=db password=***"),  # a quote left open
        (
            "sslpassword='key pass' host=db password='pw d' user=z",
            "sslpassword=*** host=db password=*** user=z",
        ),
        ("PGPASSWORD='s3cret Tail' psql", "PGPASSWORD=*** psql"),
        ('{password="s3cret Tail" user=z}', "{password=*** user=z}"),
        # libpq's error about a bare password with a space quotes the password's tail.
        (
            'missing "=" after "Tail" in connection info string',
            'missing "=" after "***" in connection info string',
        ),
        (
            "postgres://db/app?password=s3cret&sslmode=require",
            "postgres://db/app?password=***&sslmode=require",
        ),
        (
            "wss://cs.example/changes/v0/stream?apiKey=K3Y&appID=zero",
            "wss://cs.example/changes/v0/stream?apiKey=***&appID=zero",
        ),
        ('"GET /keepalive?token=T0K HTTP/1.1" 200', '"GET /keepalive?token=*** HTTP/1.1" 200'),
        (
            "s3://b/x?X-Amz-Signature=abc&X-Amz-Credential=AK/1",
            "s3://b/x?X-Amz-Signature=***&X-Amz-Credential=***",
        ),
        # websockets' debug log of a handshake: the replication password in base64.
        ("> Authorization: Basic OnMzY3ItdA==", "> Authorization: Basic ***"),
        ("{'authorization': 'Bearer T0K'}", "{'authorization': 'Bearer ***'}"),
        ("(b'authorization', b'Basic OnMz')", "(b'authorization', b'Basic ***')"),
    ],
)
def test_redact_hides_passwords_and_secret_parameters(text: str, shown: str) -> None:
    assert redact(text) == shown


@pytest.mark.parametrize(
    "text",
    [
        "postgresql://postgres@127.0.0.1:5432/app",
        "ws://127.0.0.1:4849/replication/v6/changes?id=a&replicaVersion=01&watermark=0a",
        "adding subscriber vs-1 at 0a",
        "changestreamer status: unauthorized (HTTP 401): the admin password was rejected",
        "flow control waiting for a majority of subscribers: {'elapsedMs': 1200}",
    ],
)
def test_redact_leaves_lines_without_secrets_alone(text: str) -> None:
    assert redact(text) == text


def test_a_postgres_upstream_is_shown_as_user_host_port_and_database() -> None:
    assert redacted_conninfo(f"postgres://zero:{PLANTED}@db/app") == "zero@db:5432/app"
    assert redacted_conninfo(f"host=db port=6432 user=z password={PLANTED}") == "z@db:6432/"
    # Text libpq cannot parse is what the error is about: shown, without the password.
    assert redacted_conninfo(f"host=db password={PLANTED} dbname='app") == (
        "host=db password=*** dbname='app"
    )


def _lines(fmt: LogFormat) -> tuple[logging.Logger, Callable[[], list[str]]]:
    """A logger that writes through a ``LogHandler`` of ``fmt`` into memory."""
    out = io.StringIO()
    logger = logging.getLogger(f"tests.logs.{fmt}")
    logger.handlers = [LogHandler(fmt, out)]
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    return logger, lambda: out.getvalue().splitlines()


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_a_line_s_arguments_and_traceback_are_redacted(fmt: LogFormat) -> None:
    logger, lines = _lines(fmt)
    try:
        raise ConnectionError(f"cannot reach postgres://zero:{PLANTED}@db/app")
    except ConnectionError:
        logger.exception("upstream %s failed", f"host=db password={PLANTED}")
    output = "\n".join(lines())
    assert PLANTED not in output
    assert "password=***" in output
    assert "postgres://zero:***@db/app" in output  # the traceback's last line


def test_arguments_that_do_not_format_do_not_raise(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(logging, "raiseExceptions", False)  # logging's own report, silenced
    logger, lines = _lines("json")
    logger.info("%d subscribers", "many")  # logging reports it; the caller goes on
    logger.info("after")
    assert json.loads(lines()[-1])["message"] == "after"


# -- formats -------------------------------------------------------------------


def test_a_text_line_is_utc_time_level_logger_message_then_fields() -> None:
    logger, lines = _lines("text")
    logger.warning(
        "dropping subscriber %s",
        "vs 1",
        extra=log_extra({"subscriber": "vs 1", "task": "t1", "mode": "serving", "protocol": 6}),
    )
    [line] = lines()
    assert TEXT_LINE.match(line), line
    assert line.endswith(
        'WARNING tests.logs.text: dropping subscriber vs 1 subscriber="vs 1" task=t1 '
        "mode=serving protocol=6"
    )


FORGED = "x\n2026-12-01T11:42:09.392Z ERROR changestreamer: FORGED\r\x1b[31mred\x85\u2028end"


@pytest.mark.parametrize("fmt", ["text", "json"])
def test_a_client_chosen_id_cannot_forge_a_log_line(fmt: LogFormat) -> None:
    """``?id=x%0AFORGED…``: the id, in the message and in the fields, stays on its
    line, its control characters (newlines, ANSI escapes, C1, line separators) shown
    escaped; our own traceback keeps its lines."""
    logger, lines = _lines(fmt)
    logger.info("subscriber %s connected", FORGED, extra=log_extra({"subscriber": FORGED}))
    [line] = lines()
    assert not any(c in line for c in "\r\x1b\x85\u2028"), repr(line)
    if fmt == "text":
        assert "subscriber x\\n2026-12-01T11:42:09.392Z ERROR changestreamer: FORGED\\r" in line
        assert "\\x1b[31mred\\x85\\u2028end connected" in line
        assert 'subscriber="x\\n2026' in line
    else:
        assert json.loads(line)["subscriber"] == FORGED
    try:
        raise ValueError("ours")
    except ValueError:
        logger.exception("failed")
    if fmt == "text":
        assert len(lines()) > 3  # the traceback: one line per frame, as before
    else:
        assert "\n" in json.loads(lines()[-1])["exc"]


HUGE = "v" * (4 * 1024 * 1024)  # a v7 client's id and taskID of 4 MB (issue 43)
CUT = "v" * FIELD_CHARS + f"…({len(HUGE)} chars)"


@pytest.mark.parametrize("fmt", ["text", "json"])
async def test_a_client_s_4_mb_id_is_cut_in_every_line(fmt: LogFormat) -> None:
    logger, lines = _lines(fmt)

    async def connection() -> None:
        bind_log_fields({"subscriber": HUGE, "task": HUGE, "mode": "serving", "protocol": 7})
        logger.info("subscriber connected")
        logger.info("still pending", extra=log_extra({"pending": [HUGE, "vs-2"]}))

    await asyncio.create_task(connection())
    out = lines()
    assert len(out) == 2
    assert max(len(line) for line in out) < 2 * len(CUT) + 200
    if fmt == "text":
        assert out[0].endswith(f'subscriber="{CUT}" task="{CUT}" mode=serving protocol=7')
        assert out[1].endswith(f"still pending pending=\"['{CUT}', 'vs-2']\"")
    else:
        first, second = (json.loads(line) for line in out)
        assert (first["subscriber"], first["task"], first["protocol"]) == (CUT, CUT, 7)
        assert second["pending"] == [CUT, "vs-2"]


def test_a_child_s_traceback_keeps_its_lines_and_its_message_one_line() -> None:
    from app.runtime.replica_follower import parse_line
    from app.supervise import log_child_line

    line = '{"level":"ERROR","message":"bad\\nFORGED","exc":"Traceback (most recent call last):'
    parsed = parse_line(line + '\\n  x\\nE: e"}')
    logger, lines = _lines("text")
    log_child_line(logger, parsed)
    out = lines()
    assert out[0].endswith("ERROR tests.logs.text: bad\\nFORGED"), out
    assert out[1:] == ["Traceback (most recent call last):", "  x", "E: e"]


def test_a_json_line_is_one_object_shaped_like_zero_cache_s() -> None:
    logger, lines = _lines("json")
    try:
        raise ValueError("bad")
    except ValueError:
        logger.warning(
            "catch-up failed",
            exc_info=True,
            extra=log_extra({"subscriber": "vs-1", "task": "t1", "message": "not a field"}),
        )
    [line] = lines()
    record = json.loads(line)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", record.pop("time"))
    exc = record.pop("exc")
    assert exc.startswith("Traceback (most recent call last):")
    assert exc.endswith("ValueError: bad")
    assert record == {
        "level": "WARN",  # zero-cache's name
        "logger": "tests.logs.json",
        "message": "catch-up failed",  # a field cannot replace it
        "pid": os.getpid(),
        "subscriber": "vs-1",
        "task": "t1",
    }


# -- fields --------------------------------------------------------------------


@pytest.fixture
def captured() -> Iterator[Callable[[], list[dict[str, Any]]]]:
    """Every line this process logs at INFO or above, as JSON objects."""
    out = io.StringIO()
    handler = LogHandler("json", out)
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        yield lambda: [json.loads(line) for line in out.getvalue().splitlines()]
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


async def test_fields_bound_by_a_task_reach_the_tasks_it_starts_and_no_others(
    captured: Callable[[], list[dict[str, Any]]],
) -> None:
    log = logging.getLogger("tests.logs.fields")

    async def connection(name: str) -> None:
        bind_log_fields({"subscriber": name})
        await asyncio.create_task(child(name))

    async def child(name: str) -> None:
        log.info("in a task of %s", name)

    await asyncio.gather(connection("a"), connection("b"))
    log.info("outside")
    assert {(r["message"], r.get("subscriber")) for r in captured()} == {
        ("in a task of a", "a"),
        ("in a task of b", "b"),
        ("outside", None),
    }


async def test_fields_updated_in_place_reach_tasks_started_before(
    captured: Callable[[], list[dict[str, Any]]],
) -> None:
    log = logging.getLogger("tests.logs.fields")
    learned = asyncio.Event()

    async def sender() -> None:
        await learned.wait()
        log.info("sending")

    async def session() -> None:
        fields = bind_log_fields({"protocol": 7})
        running = asyncio.create_task(sender())  # started before the subscriber is known
        fields.update(subscriber="vs-1", task="t1")
        learned.set()
        await running

    await session()
    [line] = captured()
    assert (line["protocol"], line["subscriber"], line["task"]) == (7, "vs-1", "t1")


async def test_a_line_s_own_fields_replace_the_bound_ones(
    captured: Callable[[], list[dict[str, Any]]],
) -> None:
    async def connection() -> None:
        bind_log_fields({"subscriber": "mine", "task": "t-mine"})
        logging.getLogger("tests.logs.fields").info(
            "about another", extra=log_extra({"subscriber": "other"})
        )

    await asyncio.create_task(connection())
    [line] = captured()
    assert line["subscriber"] == "other"
    assert "task" not in line


async def test_a_downstream_overflow_names_its_subscriber_from_any_task(
    captured: Callable[[], list[dict[str, Any]]],
) -> None:
    fields = {"subscriber": "vs-9", "task": "t9", "mode": "serving", "protocol": 6}
    downstream = Downstream(max_unconsumed_bytes=100, log_fields=fields)
    downstream.push(["x" * 20] * 6)  # over the bound, pushed outside any connection task
    [line] = captured()
    assert line["message"].startswith("dropping subscriber vs-9: more than 100 bytes")
    assert {k: line[k] for k in fields} == fields


# -- a connection's lines --------------------------------------------------------


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[Server]:
    async for s in start_server(tmp_path):
        yield s


async def _closed(ws: Any) -> None:
    with pytest.raises(ConnectionClosed):
        while True:
            await asyncio.wait_for(ws.recv(), 10)


async def test_a_v6_subscriber_s_lines_carry_its_id_task_mode_and_protocol(
    server: Server, captured: Callable[[], list[dict[str, Any]]]
) -> None:
    query = "id=vs-6&replicaVersion=01&watermark=01&taskID=task-6"
    async with connect(f"{server.url}/replication/v6/changes?{query}") as ws:
        await asyncio.wait_for(ws.recv(), 10)  # the status
        await ws.send("not an ack")  # a protocol violation: logged by the connection
        await _closed(ws)
    expected = {"subscriber": "vs-6", "task": "task-6", "mode": "serving", "protocol": 6}
    mine = [r for r in captured() if r.get("subscriber") == "vs-6"]
    messages = [r["message"] for r in mine]
    assert "adding subscriber vs-6 at 01" in messages
    assert any(m.startswith("closing stream: ") for m in messages)  # the bound fields
    assert "removing subscriber vs-6" in messages
    for line in mine:
        assert {k: line[k] for k in expected} == expected, line


async def test_a_v7_session_s_lines_carry_what_its_messages_named(
    server: Server, captured: Callable[[], list[dict[str, Any]]]
) -> None:
    start = {
        "taskID": "task-7",
        "id": "vs-7",
        "mode": "backup",
        "replicaVersion": "01",
        "watermark": "01",
    }
    async with connect(f"{server.url}/replication/v7/subscribe") as ws:
        await ws.send(dumps({"id": 1, "msg": ["start-subscription", start]}))
        await asyncio.wait_for(ws.recv(), 10)
        await ws.send(dumps({"id": 1, "msg": ["start-subscription", start]}))  # a second one
        await _closed(ws)
    closing = [r for r in captured() if r["message"].startswith("closing stream: ")]
    assert closing, captured()
    [line] = closing  # logged by the session's own task, bound before the message came
    assert {k: line.get(k) for k in ("subscriber", "task", "mode", "protocol")} == {
        "subscriber": "vs-7",
        "task": "task-7",
        "mode": "backup",
        "protocol": 7,
    }


# -- processes -------------------------------------------------------------------


def test_configure_logging_leaves_one_handler_and_routes_uvicorn_to_it(
    restore_logging: None,
) -> None:
    access = logging.getLogger("uvicorn.access")
    access.addHandler(logging.StreamHandler())  # as uvicorn's own configuration does
    access.propagate = False
    configure_logging("warn", "text")
    configure_logging("info", "json")  # serve again after an auto-reset
    root = logging.getLogger()
    assert [type(h) for h in root.handlers if isinstance(h, LogHandler)] == [LogHandler]
    assert root.level == logging.INFO
    for name in UVICORN_LOGGERS:
        assert (logging.getLogger(name).handlers, logging.getLogger(name).propagate) == ([], True)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(**settings: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZERO_", "CHANGESTREAMER_"))}
    return {**env, "PYTHONPATH": str(REPO), **settings}


async def _until(condition: Callable[[], bool], what: str, proc: Process) -> None:
    def holds() -> bool:
        if condition():
            return True
        assert proc.returncode is None, f"exited with {proc.returncode} before {what}"
        return False

    await eventually(holds, what, START_TIMEOUT_S, poll_s=POLL_S)


@contextlib.asynccontextmanager
async def _running(
    args: list[str], env: dict[str, str], out: Path, err: Path
) -> AsyncIterator[Process]:
    """The command, its stdout and stderr in files; killed by its PID if still running after."""
    with out.open("wb") as stdout, err.open("wb") as stderr:
        proc = await asyncio.create_subprocess_exec(
            *CLI, *args, cwd=out.parent, env=env, stdout=stdout, stderr=stderr
        )
        try:
            yield proc
        finally:
            if proc.returncode is None:
                proc.kill()
                await asyncio.wait_for(proc.wait(), 10)


async def _stop(proc: Process, sig: signal.Signals) -> None:
    proc.send_signal(sig)
    await asyncio.wait_for(proc.wait(), 30)


def _get(url: str) -> int | None:
    try:
        with urllib.request.urlopen(url, timeout=2) as response:
            return int(response.status)
    except OSError:
        return None


async def test_serve_with_zero_log_format_json_writes_only_json_lines(tmp_path: Path) -> None:
    port = _free_port()
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    env = _env(NODE_ENV="development", ZERO_LOG_FORMAT="json")
    async with _running(["serve", "--port", str(port)], env, out, err) as proc:
        base = f"127.0.0.1:{port}"
        await _until(lambda: _get(f"http://{base}/") == 200, "answer on /", proc)
        query = "id=vs-json&replicaVersion=01&watermark=01&taskID=task-json"
        async with connect(f"ws://{base}/replication/v6/changes?{query}") as ws:
            await asyncio.wait_for(ws.recv(), 10)
            await ws.send("not an ack")
            await _closed(ws)
        # uvicorn's access line for this request quotes the query: redacted.
        assert await asyncio.to_thread(_get, f"http://{base}/keepalive?apiKey={PLANTED}")
        await _until(lambda: "removing subscriber vs-json" in err.read_text(), "removal", proc)
        await _stop(proc, signal.SIGTERM)
    lines = [line for path in (out, err) for line in path.read_text().splitlines()]
    records = [json.loads(line) for line in lines]  # every line, uvicorn's included
    for record in records:
        assert {"time", "level", "logger", "message"} <= set(record), record
    loggers = {r["logger"] for r in records}
    assert {"uvicorn.error", "uvicorn.access", "changestreamer"} <= loggers
    assert any("Application shutdown complete" in r["message"] for r in records)
    about = [
        r
        for r in records
        if ("vs-json" in r["message"] and not r["logger"].startswith("uvicorn"))
        or r.get("subscriber") == "vs-json"
    ]
    assert len(about) >= 3, records  # added, the violation, removed
    for record in about:
        assert (record.get("subscriber"), record.get("task")) == ("vs-json", "task-json"), record
    assert PLANTED not in "\n".join(lines)
    assert any("/keepalive?apiKey=*** " in r["message"] for r in records)


async def test_with_json_logs_a_failed_start_ends_with_a_json_line_without_secrets(
    tmp_path: Path,
) -> None:
    upstream = f"postgres://user:{PLANTED}@127.0.0.1:{_free_port()}/db"  # nothing listens
    out, err = tmp_path / "stdout", tmp_path / "stderr"
    env = _env(NODE_ENV="development", ZERO_LOG_FORMAT="json", ZERO_UPSTREAM_DB=upstream)
    async with _running(["serve", "--port", str(_free_port())], env, out, err) as proc:
        assert await asyncio.wait_for(proc.wait(), START_TIMEOUT_S) == 1
    text = err.read_text()
    records = [json.loads(line) for line in text.splitlines()]  # every line JSON
    last = records[-1]
    assert (last["level"], last["logger"]) == ("ERROR", "changestreamer"), last
    assert "127.0.0.1" in last["message"], last  # says which upstream it could not reach
    assert PLANTED not in text


async def test_replicate_takes_zero_s_log_settings_and_hides_the_url_s_password(
    tmp_path: Path,
) -> None:
    replica = new_replica(tmp_path / "replica.db")
    url = f"ws://user:{PLANTED}@127.0.0.1:{_free_port()}"  # nothing listens there
    err = tmp_path / "stderr"
    env = _env(ZERO_LOG_FORMAT="json", ZERO_LOG_LEVEL="debug")
    args = ["replicate", url, "--replica", str(replica)]
    async with _running(args, env, tmp_path / "stdout", err) as proc:
        await _until(lambda: "replicating" in err.read_text(), "first line", proc)
        await _stop(proc, signal.SIGINT)
    records = [json.loads(line) for line in err.read_text().splitlines()]
    shown = f"replicating ws://user:***@{url.split('@')[1]} into {replica}"
    assert shown in [r["message"] for r in records]
    assert PLANTED not in err.read_text()
