"""K websocket subscribers in their own process, for ``bench.fanout --scenarios ws``.

    python -m bench.ws_subscribers URL K FINAL_WATERMARK

Each subscriber connects to ``URL`` (a ``/replication/v6|v7/changes`` URL without
the ``id``), acks every frame as soon as it arrives (all frames of one socket read
in one write), and stops at the commit of FINAL_WATERMARK. Prints one JSON line:
frames received in total and the seconds from the first frame to the last
subscriber's final commit.

The websocket client is ``bench.pg_subscribers.RawSocket``: with the
``websockets`` library this process needed ~38 µs of CPU per frame and, on a
2-core machine, was the bottleneck from K = 4 on, so the benchmark measured the
client rather than the service.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from urllib.parse import urlsplit

from bench.pg_subscribers import RawSocket


async def subscriber(url: str, final: str, first_frame: list[float]) -> int:
    parts = urlsplit(url)
    ws = await RawSocket.open(f"ws://{parts.netloc}", f"{parts.path}?{parts.query}")
    frames = 0
    # The final commit ends a v6 frame (`…}]}`) or a v7 batch (`…}]]}`).
    marker = f'{{"watermark":"{final}"}}]'.encode()
    try:
        async for count, last in ws.ack_each():
            if not first_frame:
                first_frame.append(time.perf_counter())
            frames += count
            if last.endswith((marker + b"}", marker + b"]}")):
                await ws.drain()
                return frames
            await ws.drain()
    finally:
        await ws.close()
    return frames


async def main(url: str, k: int, final: str) -> None:
    first_frame: list[float] = []
    results = await asyncio.gather(
        *(subscriber(f"{url}&id=bench-{i}", final, first_frame) for i in range(k))
    )
    elapsed = time.perf_counter() - first_frame[0]
    print(json.dumps({"frames": sum(results), "seconds": elapsed}), flush=True)


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], int(sys.argv[2]), sys.argv[3]))
