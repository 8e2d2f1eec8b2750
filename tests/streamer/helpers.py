"""Test doubles for the streamer: a subscriber client that acks on demand."""

from __future__ import annotations

import asyncio
from typing import Any

from app.protocol.canonical_json import loads
from app.protocol.pieces import Text
from app.streamer.downstream import DEFAULT_MAX_UNCONSUMED_BYTES, Downstream, DownstreamClosed
from app.streamer.subscriber import Change, Mode, Subscriber


def make_sub(
    watermark: str = "00",
    *,
    id: str = "sub",
    mode: Mode = "serving",
    version: int = 6,
    high_water: int = 16 * 1024 * 1024,
    max_backlog_changes: int = 16_384,
    max_unconsumed_bytes: int = DEFAULT_MAX_UNCONSUMED_BYTES,
) -> tuple[Subscriber, Downstream]:
    ds = Downstream(max_unconsumed_bytes=max_unconsumed_bytes)
    sub = Subscriber(
        id=id,
        protocol_version=version,
        watermark=watermark,
        mode=mode,
        downstream=ds,
        latest_lag_report=lambda: None,
        high_water=high_water,
        max_backlog_changes=max_backlog_changes,
    )
    return sub, ds


def whole(text: Text) -> str:
    """``text`` as the ``str`` it is here: no message in these tests is large enough
    to travel as ``Pieces`` (which ``loads`` refuses)."""
    assert isinstance(text, str)
    return text


def drain(ds: Downstream, *, ack: bool = True) -> list[Any]:
    """Everything sent so far, parsed; acks each message when ``ack``."""
    out: list[Any] = []
    while (msg := ds.get_nowait()) is not None:
        out.append(loads(whole(msg)))
        if ack:
            ds.ack_next()
    return out


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def tx(watermark: str, n: int = 1) -> list[Change]:
    """A small transaction as forwarded changes."""
    out = [
        Change(
            watermark, "begin", f'["begin",{{"tag":"begin"}},{{"commitWatermark":"{watermark}"}}]'
        )
    ]
    out += [
        Change(watermark, "insert", f'["data",{{"tag":"insert","new":{{"i":{i}}}}}]')
        for i in range(n)
    ]
    out.append(
        Change(watermark, "commit", f'["commit",{{"tag":"commit"}},{{"watermark":"{watermark}"}}]')
    )
    return out


async def collect(ds: Downstream, count: int) -> list[Any]:
    out: list[Any] = []
    try:
        while len(out) < count:
            out.append(loads(whole(await asyncio.wait_for(ds.get(), 5))))
            ds.ack_next()
    except DownstreamClosed:
        pass
    return out
