"""The scripted in-process source used by the service tests."""

from __future__ import annotations

import asyncio

import pytest

from app.protocol.messages import Begin, ChangeSourceMessage, Commit, MessageValidationError
from app.protocol.messages import parse_change_source_message as parse
from app.sources.base import ChangeSourceError
from tests.memory_source import MemoryChangeSource, MemoryChangeStream, StreamQueueFullError

BEGIN = ["begin", {"tag": "begin"}, {"commitWatermark": "0b"}]
COMMIT = ["commit", {"tag": "commit"}, {"watermark": "0b"}]


async def drain(stream: MemoryChangeStream) -> list[ChangeSourceMessage]:
    return [m async for m in stream]


async def test_each_start_records_a_new_stream_with_its_arguments() -> None:
    source = MemoryChangeSource()
    request = {"table": {"schema": "public", "name": "t", "metadata": None}, "columns": {}}
    first = await source.start_stream("0a", [])
    second = await source.start_stream("0b", [request])
    assert source.streams == [first, second]
    assert source.current is second
    assert (first.after_watermark, first.backfill_requests) == ("0a", [])
    assert (second.after_watermark, second.backfill_requests) == ("0b", [request])


async def test_pushed_tuples_and_messages_are_yielded_in_order() -> None:
    source = MemoryChangeSource()
    stream = await source.start_stream("0a", [])
    stream.push(BEGIN)
    source.push(parse(COMMIT))
    stream.end()
    messages = await drain(stream)
    assert [type(m) for m in messages] == [Begin, Commit]
    assert [m.as_list() for m in messages] == [BEGIN, COMMIT]


async def test_pushed_tuples_are_validated() -> None:
    stream = await MemoryChangeSource().start_stream("0a", [])
    with pytest.raises(MessageValidationError):
        stream.push(["begin", {"tag": "begin"}, {"commitWatermark": "not a watermark"}])
    assert stream.queued == 0


async def test_iteration_waits_for_pushed_messages() -> None:
    stream = await MemoryChangeSource().start_stream("0a", [])
    reader = asyncio.create_task(drain(stream))
    await asyncio.sleep(0)
    assert not reader.done()
    stream.push(BEGIN)
    stream.end()
    assert [m.as_list() for m in await reader] == [BEGIN]


async def test_fail_raises_after_the_queued_messages() -> None:
    stream = await MemoryChangeSource().start_stream("0a", [])
    stream.push(BEGIN)
    stream.fail(ChangeSourceError("connection reset"))
    assert isinstance(await stream.__anext__(), Begin)
    with pytest.raises(ChangeSourceError, match="connection reset"):
        await stream.__anext__()


async def test_pushing_after_end_is_a_test_bug() -> None:
    stream = await MemoryChangeSource().start_stream("0a", [])
    stream.end()
    with pytest.raises(RuntimeError, match="ended or failed"):
        stream.push(BEGIN)


async def test_acks_are_recorded_and_can_be_awaited() -> None:
    stream = await MemoryChangeSource().start_stream("0a", [])
    waiter = asyncio.create_task(stream.wait_for_acks(2))
    stream.ack(["status", {"tag": "commit"}, {"watermark": "0b"}])
    await asyncio.sleep(0)
    assert not waiter.done()
    stream.ack(["status", {"ack": True}, {"watermark": "0c"}])
    acks = await waiter
    assert [a[2]["watermark"] for a in acks] == ["0b", "0c"]


async def test_fail_next_starts_fails_exactly_n_starts() -> None:
    source = MemoryChangeSource()
    source.fail_next_starts(ChangeSourceError("upstream down"), 2)
    for _ in range(2):
        with pytest.raises(ChangeSourceError, match="upstream down"):
            await source.start_stream("0a", [])
    stream = await source.start_stream("0a", [])
    assert source.streams == [stream]
    assert source.start_calls == ["0a", "0a", "0a"]


async def test_the_queue_is_bounded() -> None:
    source = MemoryChangeSource(max_queued=2)
    stream = await source.start_stream("0a", [])
    stream.push_all([BEGIN, COMMIT])
    with pytest.raises(StreamQueueFullError):
        stream.push(BEGIN)


async def test_close_stops_a_pending_iteration_and_drops_later_pushes() -> None:
    stream = await MemoryChangeSource().start_stream("0a", [])
    reader = asyncio.create_task(drain(stream))
    await asyncio.sleep(0)
    await stream.close()
    await stream.close()
    assert await reader == []
    assert stream.closed
    stream.push(BEGIN)
    assert stream.queued == 0


async def test_wait_for_stream_returns_once_the_service_started_it() -> None:
    source = MemoryChangeSource()
    waiter = asyncio.create_task(source.wait_for_stream(2))
    await source.start_stream("0a", [])
    await asyncio.sleep(0)
    assert not waiter.done()
    second = await source.start_stream("0b", [])
    assert await waiter is second


async def test_current_without_a_stream_is_an_error() -> None:
    with pytest.raises(LookupError):
        _ = MemoryChangeSource().current
